"""``verify_qdq`` and ``compare_qdq``: how closely a Q/DQ file follows the PyTorch model."""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

from .._graph import constants, producers, tensor_value
from ..errors import InvalidArgumentError, VacuousCheckWarning
from ..rounding import check_floor_arguments, cosine, perturbed_runs


@dataclass(frozen=True)
class QDQOutputComparison:
    """One output: error in units of its last quantization step, cosine, top-1 agreement."""

    name: str
    max_abs_error: float
    output_scale: float | None
    max_error_in_steps: float | None
    cosine_similarity: float
    top1_agreement: float
    #: cosines of the model with itself run with its float ops rounding differently, one per seed
    #: (``compare_qdq(..., rounding_floor=True)``; see :func:`onnxport.rounding_floor`), else None.
    #: Flips at rounding boundaries are rare events: on a model that does not amplify them, one
    #: flip more or less moves the cosine in the fourth decimal, so judge the file by the range
    #: (near it: rounding; far below it: the file computes something else), not by its minimum.
    rounding_floor: tuple[float, ...] | None = None

    @property
    def within_floor(self) -> bool | None:
        """The fidelity criterion for a random-weight model: the file is at most twice as far
        from its model as the model's own one-ulp floor (1 - cosine <= 2 (1 - lowest floor
        seed)), or at cosine >= 0.9999. ``None`` when no floor was measured."""
        if self.rounding_floor is None:
            return None
        return self.cosine_similarity >= FAITHFUL_COSINE or 1 - self.cosine_similarity <= 2 * (1 - min(self.rounding_floor))


#: Cosine at or above which a file agrees with its model whatever the model's own floor.
FAITHFUL_COSINE = 0.9999


@dataclass(frozen=True)
class QDQComparison:
    outputs: tuple[QDQOutputComparison, ...]
    n_samples: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        floors = any(o.rounding_floor is not None for o in self.outputs)
        lines = [f"{'output':<16} {'max abs':>10} {'steps':>7} {'cosine':>9} {'top-1':>7}"
                 + ("  rounding floor (min-max)" if floors else "")]
        for o in self.outputs:
            steps = f"{o.max_error_in_steps:7.2f}" if o.max_error_in_steps is not None else "      -"
            line = f"{o.name:<16} {o.max_abs_error:>10.4g} {steps} {o.cosine_similarity:>9.6f} {o.top1_agreement:>7.2%}"
            if o.rounding_floor is not None:
                verdict = "within 2x the floor" if o.within_floor else "BELOW 2x the floor: the file computes something else"
                line += f"  {min(o.rounding_floor):.6f}-{max(o.rounding_floor):.6f}  {verdict}"
            lines.append(line)
        return "\n".join(lines)


def _split(model: Any, sample: Any, n_batches: Any, onnx_path: Any = None) -> tuple[Any, list[tuple], tuple[str, ...] | None]:
    """(what to call, ``sample`` cut into batches of positional inputs, their keyword names when
    given by name): ``n_batches`` equal batches, or — by default — batches of the file's own batch
    when it was exported with a fixed one."""
    from .._inputs import bind_sample, file_batch, split_batches

    call, inputs, names = bind_sample(model, sample)
    return call, split_batches(inputs, n_batches, file_batch(onnx_path) if onnx_path is not None else None), names


def _output_scale(model: onnx.ModelProto, output: str, base_dir: str | None) -> float | None:
    """The scale of the last DequantizeLinear on the way to ``output`` (float ops may follow it)."""
    graph = model.graph
    made_by = producers(graph)
    consts = constants(graph)
    frontier, seen = [output], set()
    while frontier:
        name = frontier.pop(0)
        if name in seen or name not in made_by:
            continue
        seen.add(name)
        node = made_by[name]
        if node.op_type == "DequantizeLinear" and node.input[1] in consts:
            return float(np.max(tensor_value(consts[node.input[1]], base_dir)))
        frontier.extend(i for i in node.input if i and i not in consts)
    return None


def runs_optimized(model: Any, optimized: bool | None) -> bool:
    """Whether a comparison runs the file as ONNX Runtime's CPU provider deploys it.

    ``None`` decides by the model's record: a file made for ONNX Runtime (``target='onnxruntime'``,
    or a torchao weight-only model, which ORT runs as MatMulNBits) is measured as ORT deploys it;
    a file for another consumer (TensorRT, QNN, the default) by its ONNX semantics, since ORT's
    CPU kernels are not how that consumer computes it.
    """
    if optimized is not None:
        if not isinstance(optimized, bool):
            raise InvalidArgumentError(f"optimized must be True, False or None, not {optimized!r}.")
        return optimized
    from ..quantize.spec import quant_spec

    spec = quant_spec(model)
    return spec is None or spec.target == "onnxruntime" or spec.backend == "torchao"


def _session_options(optimized: bool) -> Any:
    """ONNX Runtime's default level (None), or every graph optimisation off."""
    if optimized:
        return None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def compare_qdq(
    model: Any, onnx_path: str | os.PathLike, sample: Any, n_batches: int = 1, *, optimized: bool | None = None,
    rounding_floor: bool = False, floor_seeds: int = 3,
) -> QDQComparison:
    """Compare every output of the ONNX file with the PyTorch model on ``sample``.

    Args:
        model: the (quantized) PyTorch model the file was exported from.
        onnx_path: the ONNX file.
        sample: a tensor, a tuple of tensors or a dict of them by name, batch first.
        n_batches: split ``sample`` into this many equal batches (a graph exported with a fixed
            batch needs its own batch size).
        optimized: ``True`` runs the file as ONNX Runtime deploys it (its default graph
            optimisation: fused INT8 kernels, and a float Conv/Gemm bias beside dequantized
            inputs rounded to int32). ``False`` runs it with every optimisation off: the file's
            own ONNX semantics, the measure for a file made for another consumer (a
            ``'tensorrt'`` file keeps its biases float, which TensorRT reads as they are).
            ``None`` (default): ``True`` for a model quantized for ``target='onnxruntime'``, a
            torchao weight-only model (or one without a record), ``False`` for any other target.
        rounding_floor: also run the model ``floor_seeds`` times with every float result
            perturbed by one float32 ulp (:func:`onnxport.rounding_floor`), and give each
            output's cosines with the plain run: how close any runtime whose float kernels are not
            bit-equal to PyTorch's can be expected to come. A file near or above that floor
            computes what the model computes; one far below it does not.
        floor_seeds: how many perturbed runs when ``rounding_floor`` is set.

    Per output: max absolute error, that error in units of the scale of the last
    DequantizeLinear before the output (how many quantization steps apart), cosine similarity,
    and top-1 agreement along the last axis.
    """
    import torch

    from .._inputs import flatten_outputs
    from .._torch import eval_mode, require_module
    from ..runtime import ONNXModel, run_inputs

    require_module(model)
    if not isinstance(rounding_floor, bool):
        raise InvalidArgumentError(f"rounding_floor must be True or False, not {rounding_floor!r}.")
    if rounding_floor:
        check_floor_arguments(floor_seeds, 1.0)
    from .._io import read_onnx

    header = read_onnx(onnx_path, "onnx_path")  # read once: the file's batch here, its output scales below
    call, batches, names = _split(model, sample, n_batches, header)
    runner = ONNXModel(onnx_path, session_options=_session_options(runs_optimized(model, optimized)))
    refs: list[list[np.ndarray]] = []
    gots: list[list[np.ndarray]] = []
    with eval_mode(model), torch.no_grad():
        for batch in batches:
            refs.append([t.detach().cpu().numpy() for t in flatten_outputs(call(*batch))])
            gots.append(run_inputs(runner, batch, names))
        perturbed = perturbed_runs(call, batches, floor_seeds, 1.0) if rounding_floor else None
    base = os.path.dirname(os.fspath(onnx_path))
    results = []
    for index, name in enumerate(runner.output_names):
        ref = np.concatenate([r[index] for r in refs]).astype(np.float64)
        got = np.concatenate([g[index] for g in gots]).astype(np.float64)
        _warn_if_input_independent(name, ref)
        max_abs = float(np.max(np.abs(ref - got))) if ref.size else 0.0
        scale = _output_scale(header, name, base)
        top1 = float(np.mean(ref.argmax(-1) == got.argmax(-1))) if ref.ndim >= 1 and ref.shape[-1] > 0 else 1.0
        floor = tuple(cosine(ref, run[index]) for run in perturbed) if perturbed is not None else None
        results.append(QDQOutputComparison(name, max_abs, scale, max_abs / scale if scale else None,
                                           cosine(ref, got), top1, floor))
    return QDQComparison(tuple(results), sum(int(b[0].shape[0]) for b in batches))


#: below this spread across the samples (relative to the output's size), an output is taken as
#: not depending on its input: CaiT's and EVA02's logits at initialisation vary by 2e-5
_INPUT_INDEPENDENT = 1e-3


def _warn_if_input_independent(name: str, ref: np.ndarray) -> None:
    """Warn when every sample gives (nearly) the same output: any file that computes that one
    constant then agrees with the model, and a cosine of 1.0 proves nothing."""
    if ref.ndim < 1 or ref.shape[0] < 2 or not ref.size:
        return
    rows = ref.reshape(ref.shape[0], -1)
    mean = rows.mean(0)
    size = float(np.linalg.norm(mean))
    spread = float(np.max(np.linalg.norm(rows - mean, axis=1)))
    if spread <= _INPUT_INDEPENDENT * size:
        warnings.warn(
            f"Output {name!r} of the PyTorch model is nearly the same for every input of the sample (it varies "
            f"by {spread / size if size else 0.0:.1e} of its size), so any file that computes that one value agrees "
            "with it: the comparison is vacuous here. Use inputs that change the output, or a trained model.",
            VacuousCheckWarning,
            stacklevel=3,
        )


def verify_qdq(model: Any, onnx_path: str | os.PathLike, sample: Any, n_batches: int = 1, *,
               optimized: bool | None = None) -> float:
    """Fraction of inputs on which the ONNX graph and the PyTorch model predict the same class.

    The class is the argmax over the last axis of the first output. ``sample`` is split into
    ``n_batches`` equal batches (by default, batches of the file's fixed batch). ``optimized``
    as for :func:`compare_qdq`. Warns (:class:`VacuousCheckWarning`) when the PyTorch model
    predicts one class for every input, since agreement then proves nothing.
    """
    import torch

    from .._inputs import flatten_outputs
    from .._torch import eval_mode, require_module
    from ..runtime import ONNXModel, run_inputs

    require_module(model)
    call, batches, names = _split(model, sample, n_batches, onnx_path)
    runner = ONNXModel(onnx_path, session_options=_session_options(runs_optimized(model, optimized)))
    agreed = total = 0
    classes: set[int] = set()
    with eval_mode(model), torch.no_grad():
        for batch in batches:
            ref = flatten_outputs(call(*batch))[0].detach().cpu().numpy().argmax(-1)
            got = run_inputs(runner, batch, names)[0].argmax(-1)
            agreed += int(np.sum(ref == got))
            total += int(ref.size)
            classes.update(np.unique(ref).tolist())
    if len(classes) <= 1:
        warnings.warn(
            "The PyTorch model predicts a single class for every input, so this agreement is 1.0 whatever "
            "the ONNX graph computes: the check is vacuous here. Use a trained model and inputs whose "
            "predictions vary, or compare_qdq for the outputs themselves.",
            VacuousCheckWarning,
            stacklevel=2,
        )
    return agreed / total
