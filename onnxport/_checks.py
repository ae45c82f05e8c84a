"""Post-conditions checked on produced graphs and files: opset, dynamic batch, identical outputs, runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from ._core.io import needs_external_data, walk_graphs
from ._core.ir import opset_of, write_model
from .compare import Exact, RunResults, compare_runs
from .errors import ExportRefusedError
from .runtime import make_session


def check_declared_opset(model: onnx.ModelProto, requested: int, what: str = "The produced file") -> None:
    declared = opset_of(model)
    if declared != requested:
        raise ExportRefusedError(
            f"{what} declares opset {declared}, not the requested {requested}; nothing was kept."
        )


def non_symbolic_batch(model: onnx.ModelProto) -> list[str]:
    """Names of the graph inputs and outputs whose first dimension is not symbolic."""
    fixed = []
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if not dims or not dims[0].dim_param:
            fixed.append(value.name)
    return fixed


def check_dynamic_batch(model: onnx.ModelProto) -> None:
    fixed = non_symbolic_batch(model)
    if fixed:
        raise ExportRefusedError(
            f"dynamic_batch=True was asked for, but the batch dimension of {', '.join(fixed)} is "
            f"fixed in the produced file; nothing was kept."
        )


def source(model: onnx.ModelProto | str | os.PathLike, scratch: Path | None, name: str) -> bytes | str:
    """What ONNX Runtime and the checker can read: bytes, or a file when over protobuf's limit."""
    if not isinstance(model, onnx.ModelProto):
        return str(model)
    if not needs_external_data(model):
        return model.SerializeToString()
    if scratch is None:
        raise ExportRefusedError("A model over 2 GB can only be checked through a file; no scratch folder was given.")
    path = scratch / name
    write_model(model, path, external_data=True)
    return str(path)


def run(
    model: onnx.ModelProto | str | os.PathLike,
    feeds: Mapping[str, np.ndarray],
    *,
    optimized: bool,
    scratch: Path | None = None,
) -> list[np.ndarray]:
    """Run ``model`` once in ONNX Runtime on CPU; a model it cannot load or run is a refusal."""
    return run_batches(source(model, scratch, "run.onnx"), [feeds], optimized=optimized)[0]


def run_batches(
    source: bytes | str, batches: list[Mapping[str, np.ndarray]], *, optimized: bool,
    save_optimised: Path | None = None,
) -> list[list[np.ndarray]]:
    """One ONNX Runtime session on ``source``, run once per feed dict in ``batches``
    (``save_optimised``: where ORT also writes the graph it optimised, weights beside it)."""
    level = "default" if optimized else "unoptimised"
    options = None
    if save_optimised is not None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.optimized_model_filepath = str(save_optimised)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         save_optimised.name + ".data")
        options.log_severity_level = 3  # saving an optimised graph warns that it is machine-specific
    try:
        session = make_session(source, optimized=optimized, session_options=options)
        return [session.run(None, dict(feeds)) for feeds in batches]
    except Exception as error:  # ORT's pybind errors share no base class worth naming
        raise ExportRefusedError(
            f"ONNX Runtime cannot run the graph at its {level} level: {first_line(error)}; nothing was kept."
        ) from error


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name when it says nothing), for a refusal that quotes it."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_identical_outputs(
    got: list[np.ndarray], expected: list[np.ndarray], what: str
) -> None:
    """Raise unless both runs returned the same outputs, byte for byte (the :class:`Exact` strategy)."""
    if len(got) != len(expected):
        raise ExportRefusedError(f"{what}: {len(got)} outputs instead of {len(expected)}; nothing was kept.")
    report = compare_runs(_numbered("the rewritten graph", got), _numbered("the graph as produced", expected), Exact())
    for index, result in enumerate(report.outputs):
        if not result.passed:
            raise ExportRefusedError(
                f"{what}: output {index} differs from the graph as produced (max abs diff {result.max_abs_error:.3g}"
                + (f", {result.note}" if result.note else "") + "); nothing was kept."
            )


def _numbered(runner: str, outputs: list[np.ndarray]) -> RunResults:
    return RunResults(runner, {str(i): np.asarray(a) for i, a in enumerate(outputs)}, 0)


#: Operators ONNX Runtime registers in the default domain that onnx does not define: its fused
#: RMS norm (onnxscript writes it there, where ORT's CPU kernel is registered).
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def checker_view(path: Path) -> Path:
    """The file the checker reads: ``path`` itself, or — when it holds one of
    :data:`ORT_DEFAULT_DOMAIN_OPS` — a copy of its header beside it (same external data) with
    those nodes seen as contrib operators, so the rest of the graph is still checked in full
    (the runtime's own runs prove those nodes)."""
    header = onnx.load_model(str(path), load_external_data=False)
    found = False
    for graph in walk_graphs(header.graph):
        for node in graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in ORT_DEFAULT_DOMAIN_OPS:
                node.domain, found = "com.microsoft", True
    if not found:
        return path
    if "com.microsoft" not in {o.domain for o in header.opset_import}:
        header.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    view = path.parent / f".checker-view-{path.name}"
    onnx.save_model(header, str(view))
    return view
