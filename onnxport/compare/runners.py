"""Runners: a PyTorch model or an ONNX file run on a sample, giving :class:`RunResults`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .results import RunResults


def _joined(runs: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Each output of several batch runs, concatenated along the batch."""
    return runs[0] if len(runs) == 1 else [np.concatenate(parts) for parts in zip(*runs)]


def _n_samples(batches: Sequence[tuple]) -> int:
    return sum(int(b[0].shape[0]) if b[0].dim() else 1 for b in batches)


def torch_batches(call: Callable, batches: Sequence[tuple], runner: str = "torch") -> RunResults:
    """``call`` (a bound model, see :func:`onnxport._core.inputs.bind_sample`) on each batch, outputs joined."""
    import torch

    from .._core.inputs import flatten_outputs

    with torch.no_grad():
        runs = [[t.detach().cpu().numpy() for t in flatten_outputs(call(*batch))] for batch in batches]
    arrays = _joined(runs)
    return RunResults(runner, {f"output_{i}": a for i, a in enumerate(arrays)}, _n_samples(batches))


def onnx_batches(runner: Any, batches: Sequence[tuple], names: Sequence[str] | None, level: str) -> RunResults:
    """An :class:`onnxport.ONNXModel` on each batch: by name when the inputs were given by keyword
    and the file's inputs carry those names (a dict's order need not be the file's), else by position."""
    by_name = names is not None and set(names) == set(runner.input_names)
    runs = [runner.run_numpy(**dict(zip(names, batch))) if by_name else runner.run_numpy(*batch) for batch in batches]
    return RunResults(f"onnxruntime ({level})", dict(zip(runner.output_names, _joined(runs))), _n_samples(batches),
                      {"file": os.fspath(runner.path), "level": level})


def run_torch(model: Any, sample: Any, *, n_batches: int = 1, onnx_path: str | os.PathLike | None = None) -> RunResults:
    """Run a PyTorch model (in eval mode, its mode restored after) on ``sample``.

    Args:
        model: an ``nn.Module`` (float, pt2e-quantized or torchao weight-only).
        sample: a tensor, a tuple of tensors (one per input) or a dict of them by name.
        n_batches: cut the sample into this many equal batches.
        onnx_path: a file whose fixed batch the sample is cut to (so the two runs see the same batches).
    """
    from .._core.inputs import bind_sample, file_batch, split_batches
    from .._core.torch_helpers import eval_mode, require_module

    require_module(model)
    call, inputs, _ = bind_sample(model, sample)
    batches = split_batches(inputs, n_batches, file_batch(onnx_path) if onnx_path is not None else None)
    with eval_mode(model):
        return torch_batches(call, batches)


def run_onnx(
    onnx_path: str | os.PathLike, sample: Any, *, optimized: bool = True, n_batches: int = 1,
    session_options: Any = None,
) -> RunResults:
    """Run an ONNX file in ONNX Runtime on the CPU on ``sample``.

    Args:
        onnx_path: the file.
        sample: a tensor or array, a tuple of them (one per input, in the file's order) or a dict
            of them by input name.
        optimized: at ONNX Runtime's default optimisation level (as it deploys the file), or with
            every optimisation off (the file's own ONNX semantics).
        n_batches: cut the sample into this many equal batches (by default: batches of the
            file's fixed batch, when it has one).
    """
    import torch

    from .._core.inputs import file_batch, split_batches
    from ..runtime import ONNXModel, session_options_for

    def tensor(value: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(value)) if not isinstance(value, torch.Tensor) else value

    if isinstance(sample, Mapping):
        names: tuple[str, ...] | None = tuple(sample)
        inputs = tuple(tensor(v) for v in sample.values())
    else:
        names, inputs = None, tuple(tensor(v) for v in (sample if isinstance(sample, (tuple, list)) else (sample,)))
    runner = ONNXModel(onnx_path, session_options=session_options or session_options_for(optimized))
    batches = split_batches(inputs, n_batches, file_batch(onnx_path))
    return onnx_batches(runner, batches, names, "default level" if optimized else "unoptimised")
