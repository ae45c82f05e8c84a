"""The steps and proofs every export plan runs (through :func:`onnxport.engine.run_plan`, the only
caller that builds a :class:`Pipeline`): named graph steps, each with its proof, then the file's
proofs, with the file written once.

A step is an ``onnx_ir`` pass and the proof that its result still computes what the exporter
produced, one of four :class:`Proof` kinds: :class:`IdenticalOutputs` (ONNX Runtime,
unoptimised, byte for byte against the reference outputs, computed once, when first needed),
:class:`Structural` (a rewrite that changes no value: the checker) and :class:`LastBit` (a
rewrite that may move a last bit: the checker, and no identical-outputs step after it, since its
reference is the graph as produced — the Pipeline refuses a list in the wrong order) and
:class:`OnFile` (a rewrite that changes values on purpose, proven by the written file's rules). A step that changes nothing is not proven again, and a refusal names its
step. Every step that changed the graph is also held to ``onnx.checker`` with full shape
inference, run once on the written file: :meth:`Pipeline.prove_file` checks the file as the user
will read it — that checker, the declared opset, the record's rules, and runs at ONNX Runtime's
default level (at two batch sizes, in one session, when the batch is dynamic).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from . import _checks
from ._core.axes import Axes, describe, file_axes_problems, second_size
from ._core.io import release_freed_memory
from ._core.ir import STREAM_INLINE_BYTES, save_ir
from .errors import ExportRefusedError

log = logging.getLogger("onnxport")


class Proof:
    """How a step's result is proven; the Pipeline enforces the order the kinds may come in."""

    label = ""
    #: proven against the graph-as-produced outputs (so no last-bit step may come before it)
    needs_reference = False
    #: leaves those outputs a last bit off (so no step that needs them may come after it)
    moves_last_bit = False


class IdenticalOutputs(Proof):
    """ONNX Runtime, unoptimised, byte for byte against the outputs of the graph as produced.
    Valid only while every earlier step left those outputs exactly as they were."""

    label, needs_reference = "identical outputs", True


class Structural(Proof):
    """The rewrite changes no value (an attribute, an opset import): ``onnx.checker`` on the
    file. It may come anywhere."""

    label = "checker (no value changes)"


class LastBit(Proof):
    """The rewrite may move a value by its last bit (another summation order, one rounding
    fewer), so the graph-as-produced outputs are no reference after it: ``onnx.checker`` on
    the file, and no step proven by identical outputs may follow."""

    label, moves_last_bit = "checker (a last bit may move)", True


class OnFile(Proof):
    """The rewrite changes values on purpose (weights become stored integers, ONNX Runtime's
    quantizer quantizes): its proof is the written file's, by the rules the exporter gives
    :meth:`Pipeline.prove_file` (the integers equal the model's, agreement with the model), which
    the Pipeline then refuses to go without. No identical-outputs step may follow."""

    label, moves_last_bit = "the written file's rules", True


@dataclass(frozen=True)
class Step:
    """One named rewrite of the graph and how its result is proven (a :class:`Proof` kind)."""

    name: str
    rewrite: ir.passes.PassBase
    proof: type[Proof] = IdenticalOutputs

    def __post_init__(self) -> None:
        assert isinstance(self.proof, type) and issubclass(self.proof, Proof), f"unknown proof {self.proof!r}"


def check_order(steps: Sequence[Step]) -> None:
    """Refuse a step list whose proofs cannot hold: a step proven by identical outputs after one
    that may move a last bit would compare against a reference the graph no longer computes."""
    after = None
    for step in steps:
        if step.proof.needs_reference and after is not None:
            raise AssertionError(
                f"Step '{step.name}' is proven by {step.proof.label} but follows '{after}', proven by "
                f"{LastBit.label}: its reference outputs no longer hold. Order the steps by proof.")
        if step.proof.moves_last_bit and after is None:
            after = step.name


def sizes_of(feeds: Mapping[str, np.ndarray], axes: Axes,
             samples: Sequence[Mapping[str, np.ndarray]] | None = None) -> list[Mapping[str, np.ndarray]]:
    """The feeds every proof run uses: ``samples`` when given, else the sample and the sample one
    longer on every symbolic axis (the sample alone when nothing is symbolic)."""
    if samples is not None:
        return list(samples)
    return [feeds, second_size(feeds, axes)] if axes else [feeds]


@dataclass
class Pipeline:
    """Runs :class:`Step` lists against one set of reference outputs.

    Args:
        feeds: the sample, by graph input name, that every run uses.
        scratch: a folder for models over protobuf's 2 GB limit, which can only be run from files.
        axes: the symbolic axes the file promises; every run is then made at two sizes of each
            (the sample, and the sample one longer on every symbolic axis).
        samples: the feeds of every run instead, when the axes are tied to each other (a
            decoder's mask is as long as its past and its new tokens together, so one longer on
            every axis is no valid input): e.g. a prompt with an empty past, and one decode step.
    """

    feeds: Mapping[str, np.ndarray]
    scratch: Path
    axes: Axes = field(default_factory=dict)
    samples: Sequence[Mapping[str, np.ndarray]] | None = None
    reference: list[np.ndarray] | None = None
    #: ONNX Runtime sessions this pipeline created (the benchmark reports it).
    sessions: int = 0
    #: the steps that changed the graph, in order.
    changed: list[str] = field(default_factory=list)
    _produced: onnx.ModelProto | None = field(default=None, repr=False)
    _applied: list[Step] = field(default_factory=list, repr=False)
    _no_reference: bool = field(default=False, repr=False)

    def sizes(self) -> list[Mapping[str, np.ndarray]]:
        """The feeds every run uses: the sample, and one longer on every symbolic axis."""
        return sizes_of(self.feeds, self.axes, self.samples)

    def _run(self, model: onnx.ModelProto | Path, *, optimized: bool) -> list[np.ndarray]:
        """Every output at every size, in one session."""
        self.sessions += 1
        source = _checks.source(model, self.scratch, "run.onnx")
        return [out for outs in _checks.run_batches(source, self.sizes(), optimized=optimized) for out in outs]

    def start(self, produced: ir.Model, proofs: Iterable[Callable[[ir.Model], None]] = (),
              *, keep_reference: bool = True) -> None:
        """Check the graph as the exporter produced it and keep it as the reference.

        Its outputs are computed once, when the first step proven by identical outputs changes
        the graph; an export whose steps change nothing (or only attributes) runs no extra session.
        ``keep_reference=False`` keeps no copy (for step lists with no identical-outputs step,
        where a copy would only cost the weights' size in memory): such a step then refuses.
        """
        for proof in proofs:
            proof(produced)
        if not keep_reference:
            self._no_reference = True
            return
        self._produced = ir.to_proto(produced)

    def _reference(self) -> list[np.ndarray]:
        if self.reference is None:
            if self._produced is None:
                raise AssertionError("Pipeline.start must run, keeping its reference, before a step proven by identical outputs")
            self.reference = self._run(self._produced, optimized=False)
            self._produced = None  # the produced graph is not needed any more
        return self.reference

    def apply(self, model: ir.Model, steps: Sequence[Step]) -> ir.Model:
        """Run ``steps`` in order on ``model``, proving each one that changes it (their order
        checked first, and across calls: a later call may not bring an identical-outputs step
        after a last-bit one)."""
        check_order([*self._applied, *steps])
        if self._no_reference and any(step.proof is IdenticalOutputs for step in steps):
            raise AssertionError("Pipeline.start kept no reference graph, so no step may be proven by identical outputs.")
        self._applied.extend(steps)
        for step in steps:
            try:
                result = step.rewrite(model)
            except ExportRefusedError as error:
                raise ExportRefusedError(f"Step '{step.name}': {error}") from error
            model = result.model
            if not result.modified:
                log.debug("step '%s': unchanged", step.name)
                continue
            self.changed.append(step.name)
            log.info("step '%s': changed the graph; proof: %s", step.name, step.proof.label)
            if step.proof is IdenticalOutputs:
                reference = self._reference()
                proto = ir.to_proto(model)
                try:
                    got = self._run(proto, optimized=False)
                except ExportRefusedError as error:
                    raise ExportRefusedError(f"Step '{step.name}': {error}") from error
                del proto
                _checks.check_identical_outputs(got, reference, f"Step '{step.name}'")
        return model

    def write(self, model: ir.Model, path: Path, *, external_data: bool | None = None) -> Path:
        """Write the final graph once (inside :func:`onnxport._core.io.staged_output`), streamed by
        ``ir.save``: weights go to ``<name>.data`` when they would not fit one protobuf (or when
        ``external_data`` says so), and lazily loaded tensors are copied from their files."""
        self._produced = None  # the steps are over: the reference graph is not needed any more
        return save_ir(model, path, external_data=external_data)

    def prove_file(
        self,
        path: Path,
        *,
        opset: int,
        rules: Iterable[Callable[[Path], None]] = (),
        on_default_run: Callable[[list[list[np.ndarray]], Path], None] | None = None,
    ) -> None:
        """The written file's promises: the full checker (the proof of every step that changed the
        graph; a failure names them), declared opset, its symbolic axes, ``rules``, and runs at
        the default level — at two sizes of every symbolic axis, in one session.

        ``on_default_run(outputs, optimised)`` is then given those runs' outputs (one list per
        size) and the graph ONNX Runtime optimised them with, saved in the scratch folder, for
        the exporter's own checks of what the runtime made of the file.
        """
        rules = list(rules)
        log.info("proving the file: onnx.checker (full), opset %d, symbolic axes %s, %d rules, ONNX Runtime's "
                 "default level at %d sizes", opset, describe(self.axes) if self.axes else "none", len(rules),
                 len(self.sizes()))
        on_file = [s.name for s in self._applied if s.proof is OnFile and s.name in self.changed]
        if on_file and not rules:
            raise AssertionError(f"The steps {on_file} are proven by the written file's rules, but none were given.")
        try:
            onnx.checker.check_model(str(_checks.checker_view(path)), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
            after = f" (after the steps {', '.join(map(repr, self.changed))})" if self.changed else ""
            raise ExportRefusedError(
                f"The written file fails onnx.checker{after}: {str(error).strip().splitlines()[0]}; nothing was kept."
            ) from error
        header = onnx.load_model(str(path), load_external_data=False)
        _checks.check_declared_opset(header, opset)
        fixed = file_axes_problems(header, self.axes)
        if fixed:
            raise ExportRefusedError(
                f"The symbolic axes {describe(self.axes)} were asked for, but in the produced file {', '.join(fixed)}; "
                f"nothing was kept."
            )
        if self.axes and all(self.axes.get(value.name, {}).get(0) == "batch" for value in header.graph.input):
            _checks.check_dynamic_batch(header)
        # A file under 2 GB holds its weights: not to be kept while the rules and the sessions
        # below read the file again (at 1.1B parameters, 0.7 GB on top of ONNX Runtime's own).
        del header
        if path.stat().st_size >= STREAM_INLINE_BYTES:  # a collection costs 0.1-0.3 s: only where it pays
            release_freed_memory()
        for rule in rules:
            try:
                rule(path)
            except Exception as error:
                # a rule that runs the file where ONNX Runtime refuses it (a shape fixed at capture
                # failing at another size) is a refusal like any other; anything else is a bug
                if not type(error).__module__.startswith("onnxruntime"):
                    raise
                raise ExportRefusedError(
                    f"ONNX Runtime cannot run the written file while proving it: {_checks.first_line(error)}; "
                    f"nothing was kept."
                ) from error
        self.sessions += 1
        if on_default_run is None:
            _checks.run_batches(str(path), self.sizes(), optimized=True)
            return
        optimised = self.scratch / "ort-optimised.onnx"
        outputs = _checks.run_batches(str(path), self.sizes(), optimized=True, save_optimised=optimised)
        on_default_run(outputs, optimised)
