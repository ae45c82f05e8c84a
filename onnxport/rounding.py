"""How close a quantized model comes to itself when its float arithmetic rounds differently.

A Q/DQ file run by another runtime cannot be expected to reproduce a PyTorch model bit for bit:
its float kernels (a conv's or a norm's sums, a softmax's exponentials) add in another order and
round a last bit differently, and an element that sits that close to a rounding boundary lands
one quantization step away at the next QuantizeLinear. On a network that amplifies such flips
(deep, random or badly conditioned weights) the outputs then drift far apart with no op at
fault. :func:`rounding_floor` measures that floor on the model itself: it runs the model with
every float result (and every value a quantizer rounds) scaled by ``1 + ε``,
``ε ~ N(0, (ulps · 2⁻²⁴)²)`` — by default one float32 ulp, no more than two kernels that sum in
different orders differ by (a conv's float sum of a few hundred products is further than that from
the exact integer sum ONNX Runtime's INT8 kernels compute) — and gives the cosine of each output
with the unperturbed run. A file whose cosine with the model is near that floor is as faithful as
float arithmetic allows; one far below it computes something else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidArgumentError

#: ops every runtime computes alike (they move, select or clamp values, or round them by one
#: IEEE rule): jittering them would blame a runtime for rounding it does not do.
_EXACT = frozenset({
    "clone", "_to_copy", "copy", "copy_", "cat", "stack", "constant_pad_nd", "embedding", "index_select",
    "gather", "index", "repeat", "repeat_interleave", "relu", "hardtanh", "clamp", "clamp_min", "clamp_max",
    "max_pool2d_with_indices", "max_pool1d_with_indices", "max_pool3d_with_indices", "max", "min",
    "amax", "amin", "adaptive_max_pool2d", "upsample_nearest2d", "topk", "sort", "im2col", "index_put",
    "floor", "ceil", "round", "sign", "maximum", "minimum", "where", "masked_fill", "flip", "roll",
    "pixel_shuffle", "pixel_unshuffle",
    "scatter", "slice_scatter", "select_scatter", "neg", "abs", "zeros_like", "ones_like", "full_like",
    "empty_like", "fill", "lift_fresh", "alias", "detach",
})


def _perturbing_mode(generator: Any, ulps: float) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    relative = ulps * 2.0**-24

    def quantizes(func: Any) -> bool:
        return func.namespace == "quantized_decomposed" and func.overloadpacket.__name__.startswith("quantize_per")

    def exact(func: Any) -> bool:
        schema = func._schema
        return (
            func.namespace == "quantized_decomposed"  # dequantizing is exact; quantizing, see below
            or func.overloadpacket.__name__.rstrip("_") in _EXACT
            or any(r.alias_info is not None for r in schema.returns)  # views and in-place ops
        )

    def jitter(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
            return (value.double() * (1 + relative * noise)).to(value.dtype)
        return value

    class _Perturbed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if quantizes(func) and args:
                # ONNX QuantizeLinear divides by the scale, torch multiplies by its reciprocal: up
                # to an ulp apart on the value rounded, whatever op produced it
                args = (jitter(args[0]), *args[1:])
            result = func(*args, **(kwargs or {}))
            if exact(func):
                return result
            return torch.utils._pytree.tree_map(jitter, result)

    return _Perturbed()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two arrays in float64; two all-zero arrays agree (1.0)."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denom) if denom else float(np.array_equal(a, b))


def perturbed_runs(call: Any, batches: list[tuple], seeds: int, ulps: float) -> list[list[np.ndarray]]:
    """Per seed, every output of ``call`` over ``batches`` (concatenated) with its float ops perturbed."""
    import torch

    from ._core.inputs import flatten_outputs

    runs = []
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        per_batch = []
        for batch in batches:
            with _perturbing_mode(generator, float(ulps)):
                per_batch.append([t.detach().cpu().numpy() for t in flatten_outputs(call(*batch))])
        runs.append([np.concatenate([b[i] for b in per_batch]) for i in range(len(per_batch[0]))])
    return runs


def check_floor_arguments(seeds: Any, ulps: Any) -> None:
    """Refuse a non-positive or non-integer seed count, or a non-positive ulp count."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise InvalidArgumentError(f"seeds must be a positive integer, not {seeds!r}.")
    if isinstance(ulps, bool) or not isinstance(ulps, (int, float)) or not ulps > 0:
        raise InvalidArgumentError(f"ulps must be a positive number of float32 ulps such as 1.0, not {ulps!r}.")


def rounding_floor(model: Any, sample: Any, seeds: int = 3, ulps: float = 1.0) -> list[tuple[float, ...]]:
    """How close ``model`` comes to itself when its float ops round differently: per output, the
    cosine of each perturbed run (one per seed) with the plain run.

    Args:
        model: a PyTorch model (a pt2e-quantized one, typically: Q/DQ ops are never perturbed).
        sample: a tensor, a tuple of tensors or a dict of them by name, as for ``compare_qdq``.
        seeds: how many perturbed runs (each with its own noise).
        ulps: the noise's standard deviation, in float32 ulps of each result (2⁻²⁴ relative per ulp).

    Every float result of every op except the exact ones (dequantization, data movement, views,
    ReLU and clamps, max/min, padding, lookups) is scaled by ``1 + ulps · 2⁻²⁴ · ε``,
    ``ε ~ N(0, 1)``, and rounded back to its dtype; so is every value a quantizer rounds (ONNX
    QuantizeLinear divides by the scale where torch multiplies by its reciprocal). A runtime whose float kernels are not bit-equal to PyTorch's cannot
    be expected to come closer to the model than these runs do: ``compare_qdq(...,
    rounding_floor=True)`` puts the two side by side.
    """
    import torch

    from ._core.inputs import bind_sample, flatten_outputs
    from ._core.torch_helpers import eval_mode, require_module

    require_module(model)
    check_floor_arguments(seeds, ulps)
    call, inputs, _ = bind_sample(model, sample)
    with eval_mode(model), torch.no_grad():
        plain = [t.detach().cpu().numpy() for t in flatten_outputs(call(*inputs))]
        runs = perturbed_runs(call, [tuple(inputs)], seeds, ulps)
    return [tuple(cosine(reference, run[index]) for run in runs) for index, reference in enumerate(plain)]
