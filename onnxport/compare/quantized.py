"""``verify_qdq`` and ``compare_qdq``: how closely a Q/DQ file follows the PyTorch model."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import onnx_ir as ir

from .._core.ir import const_tensor, read_model, read_values
from ..errors import InvalidArgumentError, VacuousCheckWarning
from ..rounding import check_floor_arguments, cosine, perturbed_runs
from . import Measure, OutputResult, Report, WithinFloor, compare_runs

#: The names compare_qdq's results had before the one comparison model; the same types now.
QDQComparison = Report
QDQOutputComparison = OutputResult


def split_sample(model: Any, sample: Any, n_batches: Any, onnx_path: Any = None) -> tuple[Any, list[tuple], tuple[str, ...] | None]:
    """(what to call, ``sample`` cut into batches of positional inputs, their keyword names when
    given by name): ``n_batches`` equal batches, or — by default — batches of the file's own batch
    when it was exported with a fixed one."""
    from .._core.inputs import bind_sample, file_batch, split_batches

    call, inputs, names = bind_sample(model, sample)
    return call, split_batches(inputs, n_batches, file_batch(onnx_path) if onnx_path is not None else None), names


def output_scale(model: ir.Model, output: str) -> float | None:
    """The scale of the last DequantizeLinear on the way to ``output`` (float ops may follow it)."""
    start = next((v for v in model.graph.outputs if v.name == output), None)
    frontier, seen = [start], set()
    while frontier:
        value = frontier.pop(0)
        if value is None or id(value) in seen or (node := value.producer()) is None:
            continue
        seen.add(id(value))
        if node.op_type == "DequantizeLinear" and (scale := const_tensor(node.inputs[1])) is not None:
            return float(np.max(read_values(scale)))
        frontier.extend(i for i in node.inputs if i is not None and const_tensor(i) is None)
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


def compare_qdq(
    model: Any, onnx_path: str | os.PathLike, sample: Any, n_batches: int = 1, *, optimized: bool | None = None,
    rounding_floor: bool = False, floor_seeds: int = 3,
) -> Report:
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
    from .._core.io import read_onnx
    from .._core.torch_helpers import eval_mode, require_module
    from ..runtime import ONNXModel, session_options_for
    from .runners import onnx_batches, torch_batches

    require_module(model)
    if not isinstance(rounding_floor, bool):
        raise InvalidArgumentError(f"rounding_floor must be True or False, not {rounding_floor!r}.")
    if rounding_floor:
        check_floor_arguments(floor_seeds, 1.0)
    header = read_onnx(onnx_path, "onnx_path")  # read once: the file's batch here, its output scales below
    graph, _ = read_model(header, base=os.path.dirname(os.fspath(onnx_path)))
    call, batches, names = split_sample(model, sample, n_batches, header)
    optimized = runs_optimized(model, optimized)
    runner = ONNXModel(onnx_path, session_options=session_options_for(optimized))
    with eval_mode(model):
        reference = torch_batches(call, batches)
        perturbed = perturbed_runs(call, batches, floor_seeds, 1.0) if rounding_floor else None
    got = onnx_batches(runner, batches, names, "default level" if optimized else "unoptimised")
    distinct, rows = _distinct_rows(batches)
    for name, ref in zip(got.names, reference.arrays):
        _warn_if_input_independent(name, ref[distinct] if distinct and ref.ndim and len(ref) == rows else ref)
    scales = {name: output_scale(graph, name) for name in got.names}
    floors = ({name: tuple(cosine(ref, run[i]) for run in perturbed) for i, (name, ref) in enumerate(zip(got.names, reference.arrays))}
              if perturbed is not None else None)
    return compare_runs(got, reference, WithinFloor() if rounding_floor else Measure(), scales=scales, floors=floors)


#: below this spread across the samples (relative to the output's size), an output is taken as
#: not depending on its input: CaiT's and EVA02's logits at initialisation vary by 2e-5
_INPUT_INDEPENDENT = 1e-3


def _distinct_rows(batches: list[tuple]) -> tuple[list[int], int]:
    """The rows of the joined batches whose inputs differ from every earlier row's, and how many
    rows there are (``[]`` when the inputs have no common batch axis): a sample grown
    by repeating its first row (a second batch size, ``second_size``) gives that row's output
    twice, which says nothing about whether the output depends on its input."""
    import torch

    rows: list[tuple] = []
    for batch in batches:
        tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0]
        size = len(tensors[0]) if tensors else 0
        if not tensors or any(len(t) != size for t in tensors):
            return [], 0  # no batch axis to tell rows apart by: judge the output as it is
        rows.extend(tuple(t[i] for t in tensors) for i in range(size))
    distinct: list[int] = []
    for i, row in enumerate(rows):
        if not any(all(torch.equal(a, b) for a, b in zip(row, rows[j])) for j in distinct):
            distinct.append(i)
    return distinct, len(rows)


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
    from .._core.torch_helpers import eval_mode, require_module
    from ..runtime import ONNXModel, session_options_for
    from .runners import onnx_batches, torch_batches

    require_module(model)
    call, batches, names = split_sample(model, sample, n_batches, onnx_path)
    optimized = runs_optimized(model, optimized)
    runner = ONNXModel(onnx_path, session_options=session_options_for(optimized))
    with eval_mode(model):
        reference = torch_batches(call, batches)
    got = onnx_batches(runner, batches, names, "default level" if optimized else "unoptimised")
    first = reference.arrays[0]
    if len(np.unique(first.argmax(-1))) <= 1:
        warnings.warn(
            "The PyTorch model predicts a single class for every input, so this agreement is 1.0 whatever "
            "the ONNX graph computes: the check is vacuous here. Use a trained model and inputs whose "
            "predictions vary, or compare_qdq for the outputs themselves.",
            VacuousCheckWarning,
            stacklevel=2,
        )
    return compare_runs(got, reference).outputs[0].top1_agreement
