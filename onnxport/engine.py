"""The export engine: every exporter is an :class:`ExportPlan`, and :func:`run_plan` is the one
function that runs one — the only code in onnxport that stages an output file or builds a
:class:`~onnxport.pipeline.Pipeline`.

A plan declares what an export is: the sample feeds and symbolic axes every proof runs at, how the
graph is captured, the steps (each an ``onnx_ir`` pass with its typed proof), the checks on the
graph as captured, the file's rules and the opset it must declare. :func:`run_plan` then does
what every export does the same way: it stages the output beside its target, captures, runs the
steps one at a time (the reference outputs computed once, when the first identical-outputs step
needs them), writes the file once, proves it as the user will read it and only then moves it into
place — or leaves the target exactly as it was. Progress is counted from the steps, and each step
and proof is logged on ``logging.getLogger("onnxport")`` (the CLI's ``-v`` shows them).

:func:`save_model` is the same atomic write for a model that is already built (the encodings
converter's output); :func:`share_weights` stores a weight two files of one folder hold once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from ._core.axes import Axes
from ._core.io import EXTERNAL_SIZE_THRESHOLD, check_output_path, staged_folder, staged_output
from ._core.ir import write_model
from .errors import ExportRefusedError, InvalidArgumentError
from .pipeline import Pipeline, Step, sizes_of

log = logging.getLogger("onnxport")

#: The oldest default-domain opset any exporter writes: onnxport lowers the exporter's graph
#: exactly down to it at most.
MIN_OPSET = 13


def validate_opset(opset_version: Any, *, lowest: int = MIN_OPSET, why: str = "") -> int:
    """``opset_version`` as an int, or an :class:`InvalidArgumentError` naming the range the
    exporter accepts (``lowest`` up to the newest opset the installed onnx knows) and ``why``."""
    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset_version, bool) or not isinstance(opset_version, int) or not lowest <= opset_version <= newest:
        reason = why or (
            f"the exporter writes opset 18 or later, and onnxport lowers it exactly down to {MIN_OPSET} at most."
        )
        raise InvalidArgumentError(
            f"opset_version must be an integer from {lowest} to {newest}, not {opset_version!r}: {reason}"
        )
    return opset_version


@dataclass
class ExportPlan:
    """What one export writes and how each of its promises is proven.

    Args:
        name: the exporter's name, shown on the progress bar and in the log.
        opset: the default-domain opset the file must declare.
        feeds: the sample, by graph input name, that every proof run uses.
        capture: produces the graph (``torch.onnx`` on the model, usually); called once, inside
            the stage.
        steps: the graph steps in order, or a function of the stage's scratch folder that returns
            them (for a step that needs somewhere to put files).
        axes: the symbolic axes the file promises: every run is made at two sizes of each.
        samples: the feeds of every run instead, when the axes are tied to each other.
        captured_proofs: checks of the graph as captured (its Q/DQ pairs are the model's, …).
        keep_reference: keep a copy of the captured graph for identical-outputs steps (a plan
            with none saves the weights' size in memory with ``False``).
        rules: the written file's own checks, run before ONNX Runtime's default-level runs.
        on_default_run: given those runs' outputs and ONNX Runtime's optimised graph.
        before_write: reads the final graph before it is written (what was fused, …).
        after_write: called once the file is written, before it is proven: an exporter that owns
            the model its capture read gives the weights back here, so the proofs' ONNX Runtime
            sessions do not sit beside them.
        metadata: ``metadata_props`` the file carries.
        external_data: ``None`` decides by size; ``True``/``False`` force it.
    """

    name: str
    opset: int
    feeds: Mapping[str, np.ndarray]
    capture: Callable[[], ir.Model]
    steps: Sequence[Step] | Callable[[Path], Sequence[Step]]
    axes: Axes = field(default_factory=dict)
    samples: Sequence[Mapping[str, np.ndarray]] | None = None
    captured_proofs: Sequence[Callable[[ir.Model], None]] = ()
    keep_reference: bool = True
    rules: Sequence[Callable[[Path], None]] = ()
    on_default_run: Callable[[list[list[np.ndarray]], Path], None] | None = None
    before_write: Callable[[ir.Model], None] | None = None
    after_write: Callable[[], None] | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    external_data: bool | None = None

    def sizes(self) -> list[Mapping[str, np.ndarray]]:
        """The feeds every proof run uses: the sample, and one longer on every symbolic axis
        (or ``samples``)."""
        return sizes_of(self.feeds, self.axes, self.samples)


@dataclass
class PlanResult:
    """What :func:`run_plan` did: the file, the steps that changed the graph, and the ONNX
    Runtime sessions its proofs opened."""

    path: Path
    changed: list[str]
    sessions: int
    seconds: float


def run_plan(plan: ExportPlan, output_path: str | os.PathLike) -> PlanResult:
    """Run ``plan`` and write its file to ``output_path`` (validated by the caller with
    :func:`onnxport._core.io.check_output_path`), or refuse with nothing written."""
    from tqdm.auto import tqdm

    target = Path(output_path)
    started = time.perf_counter()
    with staged_output(target) as staged:
        steps = list(plan.steps(staged.parent) if callable(plan.steps) else plan.steps)
        with tqdm(total=len(steps) + 3, desc=plan.name, leave=False, disable=None) as bar:
            pipeline = Pipeline(plan.feeds, scratch=staged.parent, axes=plan.axes, samples=plan.samples)
            log.info("%s: capturing the graph", plan.name)
            graph = plan.capture()
            log.info("%s: captured %d nodes; checking the graph as captured (%d checks)",
                     plan.name, len(graph.graph), len(plan.captured_proofs))
            pipeline.start(graph, plan.captured_proofs, keep_reference=plan.keep_reference)
            bar.update()
            for step in steps:
                graph = pipeline.apply(graph, [step])
                bar.update()
            if plan.before_write is not None:
                plan.before_write(graph)
            graph.metadata_props.update(plan.metadata)
            pipeline.write(graph, staged, external_data=plan.external_data)
            del graph
            log.info("%s: wrote %s (%.1f MB)", plan.name, target.name, staged.stat().st_size / 1e6)
            if plan.after_write is not None:
                plan.after_write()
            bar.update()
            pipeline.prove_file(staged, opset=plan.opset, rules=plan.rules, on_default_run=plan.on_default_run)
            bar.update()
    seconds = time.perf_counter() - started
    log.info("%s: %s proven and in place (%d steps changed the graph, %d ONNX Runtime sessions, %.1f s)",
             plan.name, target, len(pipeline.changed), pipeline.sessions, seconds)
    return PlanResult(target, list(pipeline.changed), pipeline.sessions, seconds)


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    check: bool = True,
) -> Path:
    """Write ``model`` to ``path`` atomically, with external data when it is over 2 GB.

    Args:
        model: the model to write; it is not modified.
        path: the target ``.onnx`` file; a previous file there is replaced only once the new one
            is complete and (with ``check``) has passed ``onnx.checker``.
        external_data: ``None`` decides by size; ``True``/``False`` force it.
        check: run ``onnx.checker`` on the staged file before it replaces the target.
    """
    if not isinstance(model, onnx.ModelProto):
        raise InvalidArgumentError(f"model must be an onnx.ModelProto, not {type(model).__name__}.")
    target = check_output_path(path, "path")
    with staged_output(target) as staged:
        write_model(model, staged, external_data=external_data)
        if check:
            try:
                onnx.checker.check_model(str(staged))
            except onnx.checker.ValidationError as error:
                raise InvalidArgumentError(
                    f"The model fails onnx.checker, so '{target}' was not written: {str(error).splitlines()[0]} "
                    f"Fix the model, or pass check=False to write it anyway."
                ) from error
    return target


@contextlib.contextmanager
def output_folder_stage(output_dir: str | os.PathLike) -> Iterator[Path]:
    """A stage for an exporter that writes a folder (a model file with its companions): the plans
    run into it (each file staged and proven by :func:`run_plan`), and the folder's files are moved
    into ``output_dir`` together when the block succeeds, the model files last; on an exception
    ``output_dir`` is left as it was."""
    with staged_folder(output_dir) as stage:
        yield stage


#: Weights from this size up are looked for in the other file (an embedding table, a head):
#: smaller ones cost less than the comparison.
SHARE_MIN_BYTES = 1 << 20


def share_weights(stage: str | os.PathLike, owner: str, reader: str, *, min_bytes: int = SHARE_MIN_BYTES) -> list[str]:
    """Store once the weights two proven files of a staged folder both hold (a shared embedding
    table): ``owner``'s weights move to its data file (``<owner>.data``), ``reader``'s equal ones
    point into it (ONNX external data, resolved beside the file: the folder's files travel
    together) and its others go to its own (``<reader>.data``). Written tensor by tensor, and
    read lazily when the files keep their weights in data files already.

    Each rewritten file is proven the file it replaces: the same graph, and every weight's bytes
    equal, read back through its new place. Returns the reader's initializers now read from the
    owner's data file (none: both files are left as they were).
    """
    folder = Path(stage)
    read, own = ir.load(folder / reader), ir.load(folder / owner)
    candidates: dict[tuple, list[tuple[str, Any]]] = {}
    for graph in own.graphs():
        for name, value in graph.initializers.items():
            if value.const_value is not None and value.const_value.nbytes >= min_bytes:
                tensor = value.const_value
                candidates.setdefault((tensor.dtype, tuple(tensor.shape)), []).append((name, tensor))
    matches: dict[str, str] = {}
    for graph in read.graphs():
        for name, value in graph.initializers.items():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < min_bytes:
                continue
            found = candidates.get((tensor.dtype, tuple(tensor.shape)), [])
            match = next((owned_name for owned_name, other in found if _same_bytes(tensor, other)), None)
            if match is not None:
                matches[name] = match
    if not matches:
        return []
    del own, candidates
    owned = {v.name: v.const_value for g in _with_external_weights(folder, owner).graphs()
             for v in g.initializers.values()}
    shared: dict[str, ir.ExternalTensor] = {name: owned[match] for name, match in matches.items()}  # type: ignore[misc]
    values = {name: value for graph in read.graphs() for name, value in graph.initializers.items() if name in shared}
    for value in values.values():
        value.const_value = None  # out of the reader's own data: they are the owner's
    scratch = folder / ".sharing"
    scratch.mkdir()
    try:
        # the reader's own weights stream to its own data file, one at a time
        ir.external_data.unload_from_model(read, scratch, f"{reader}.data",
                                           size_threshold_bytes=EXTERNAL_SIZE_THRESHOLD - 1)
        for name, value in values.items():
            source = shared[name]
            # the location is the owner's data file, beside the reader once it is in the folder
            value.const_value = ir.ExternalTensor(source.location, offset=source.offset, length=source.length,
                                                  dtype=source.dtype, shape=source.shape, name=name,
                                                  base_dir=folder)
        ir.save(read, scratch / reader)
        _replace_proven(folder, reader, scratch)
    finally:
        _remove_tree(scratch)
    log.info("%s reads %d weights (%.1f MB) from %s's data file", reader, len(shared),
             sum(t.nbytes for t in shared.values()) / 1e6, owner)
    return sorted(shared)


def _initializer_tensors(model: ir.Model) -> Iterator[Any]:
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value


def _with_external_weights(folder: Path, name: str) -> ir.Model:
    """``name`` loaded lazily, its weights from :data:`EXTERNAL_SIZE_THRESHOLD` up in its data file
    (rewritten so, and proven, when it kept them inline)."""
    model = ir.load(folder / name)
    inline = [t for t in _initializer_tensors(model)
              if t.nbytes >= EXTERNAL_SIZE_THRESHOLD and not isinstance(t, ir.ExternalTensor)]
    if not inline:
        return model
    scratch = folder / ".external"
    scratch.mkdir()
    try:
        ir.save(model, scratch / name, external_data=f"{name}.data", size_threshold_bytes=EXTERNAL_SIZE_THRESHOLD - 1)
        _replace_proven(folder, name, scratch)
    finally:
        _remove_tree(scratch)
    return ir.load(folder / name)


def _replace_proven(folder: Path, name: str, scratch: Path) -> None:
    """Move the rewritten ``scratch/name`` (and its data file) into ``folder`` once it is proven
    the file it replaces: the same graph, and every weight's bytes equal."""
    previous = scratch / "previous"
    previous.mkdir()
    for file in (name, f"{name}.data"):
        if (folder / file).exists():
            os.replace(folder / file, previous / file)
    for file in (name, f"{name}.data"):
        if (scratch / file).exists():
            os.replace(scratch / file, folder / file)
    why = _differs(previous / name, folder / name)
    if why is not None:
        raise ExportRefusedError(f"Storing {name}'s weights anew changed the file ({why}); nothing was kept.")
    from ._checks import checker_view

    view = checker_view(folder / name)  # ONNX Runtime's default-domain operators seen as its own
    try:
        onnx.checker.check_model(str(view), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ExportRefusedError(
            f"{name}, its weights stored anew, fails onnx.checker: {str(error).strip().splitlines()[0]}; nothing was kept."
        ) from error
    finally:
        if view != folder / name:
            view.unlink()


def _differs(before: Path, after: Path) -> str | None:
    """Why two files are not the same model (graph and weights), or None."""
    def skeleton(path: Path) -> bytes:
        model = onnx.load(str(path), load_external_data=False)
        for tensor in onnx.external_data_helper._get_all_tensors(model):
            tensor.ClearField("raw_data")
            tensor.ClearField("external_data")
            tensor.ClearField("data_location")
        return model.SerializeToString(deterministic=True)

    if skeleton(before) != skeleton(after):
        return "its graph or weight names differ"
    old, new = ir.load(before), ir.load(after)
    new_tensors = {v.name: v.const_value for g in new.graphs() for v in g.initializers.values()}
    for graph in old.graphs():
        for name, value in graph.initializers.items():
            tensor, other = value.const_value, new_tensors.get(name)
            if (tensor is None) != (other is None) or (tensor is not None and not _same_bytes(tensor, other)):
                return f"weight '{name}' differs"
    return None


#: Bytes compared at once by :func:`_same_bytes`.
_COMPARE_SLICE = 1 << 24


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same values bit for bit, compared a slice at a time, with no
    copy of either; a tensor read from a data file is unmapped after (its pages would otherwise
    stay in the process's memory until the model is dropped, and a 7B pair holds many gigabytes)."""
    def compare() -> bool:  # its views of the mapped files are gone when it returns
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return False
        x, y = (np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8) for t in (a, b))
        return x.size == y.size and all(np.array_equal(x[i:i + _COMPARE_SLICE], y[i:i + _COMPARE_SLICE])
                                        for i in range(0, x.size, _COMPARE_SLICE))

    try:
        return compare()
    finally:
        for tensor in (a, b):
            if isinstance(tensor, ir.ExternalTensor):
                with contextlib.suppress(BufferError):  # a view held elsewhere keeps its mapping
                    tensor.release()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
