"""Symbolic axes: ``dynamic_axes`` in ``torch.onnx.export``'s form, checked against the model's
inputs, captured by ``torch.export`` and proven on the file at two sizes.

One label names one size: ``{'input_ids': {0: 'batch', 1: 'sequence'}, 'attention_mask': {0:
'batch', 1: 'sequence'}}`` says both inputs share their batch and their sequence length, which is
what a transformers model needs (its mask and its ids must agree) and what the file declares.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import ExportRefusedError, FixedAxesError, InvalidArgumentError

if TYPE_CHECKING:  # torch is imported where it runs: the file-only commands (stats, encodings) never load it
    import torch

#: input name → {axis: label}
Axes = dict[str, dict[int, str]]

#: Where a captured (pt2e) model keeps the axes it was captured with, by input name.
AXES_KEY = "onnxport_dynamic_axes"
#: The axes a caller named in ``dynamic_axes`` (not the batch ``dynamic_batch`` adds by default):
#: a file written without axes of its own keeps these, as they were asked for.
ASKED_AXES_KEY = "onnxport_asked_axes"

BATCH = "batch"

T = TypeVar("T")


def default_label(axis: int) -> str:
    """The label of an axis given by index only: inputs that list the same index share it."""
    return BATCH if axis == 0 else f"axis_{axis}"


def resolve_axes(
    dynamic_axes: Any,
    *,
    dynamic_batch: bool,
    names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    argument: str = "dynamic_axes",
    aliases: Mapping[str, str] | None = None,
) -> Axes:
    """Check ``dynamic_axes`` against the model's inputs and add the batch when asked.

    ``dynamic_axes`` maps an input name to ``{axis: label}`` or to a list of axes (labelled
    ``'batch'`` for 0 and ``'axis_<k>'`` otherwise). ``dynamic_batch`` adds axis 0 of every input
    with a dimension, labelled ``'batch'``, where the mapping does not already name it.
    ``aliases`` maps other names an input answers to (the model's ``forward`` parameters, for a
    positional sample) to its name in the file.
    """
    axes: Axes = {}
    if dynamic_axes is not None:
        if not isinstance(dynamic_axes, Mapping):
            raise InvalidArgumentError(
                f"{argument} must be a dict from input name to {{axis: name}} or to a list of axes, such as "
                f"{{'input_ids': {{0: 'batch', 1: 'sequence'}}}}, not {type(dynamic_axes).__name__}."
            )
        ranks = {name: t.dim() for name, t in zip(names, inputs)}
        for name, spec in dynamic_axes.items():
            if name not in ranks and aliases and aliases.get(name) in ranks:
                name = aliases[name]
            if name not in ranks:
                raise InvalidArgumentError(
                    f"{argument} names the input {name!r}, which the model does not have; its inputs are "
                    f"{', '.join(map(repr, names))} (from input_names, or the sample's keyword names)"
                    + (f", or by forward's parameters {', '.join(map(repr, aliases))}" if aliases else "") + "."
                )
            if isinstance(spec, Mapping):
                pairs = list(spec.items())
            elif isinstance(spec, Sequence) and not isinstance(spec, str):
                pairs = [(axis, None) for axis in spec]
            else:
                raise InvalidArgumentError(
                    f"{argument}[{name!r}] must be {{axis: name}} or a list of axes, not {spec!r}."
                )
            for axis, label in pairs:
                if isinstance(axis, bool) or not isinstance(axis, int):
                    raise InvalidArgumentError(f"{argument}[{name!r}] has the axis {axis!r}; axes are integers.")
                rank = ranks[name]
                if not -rank <= axis < rank:
                    raise InvalidArgumentError(
                        f"{argument}[{name!r}] names axis {axis}, but {name!r} has {rank} dimension(s) "
                        f"(shape {tuple(inputs[list(names).index(name)].shape)})."
                    )
                axis %= rank
                if label is None:
                    label = default_label(axis)
                if not isinstance(label, str) or not label.isidentifier():
                    raise InvalidArgumentError(
                        f"{argument}[{name!r}][{axis}] is {label!r}; an axis name must be an identifier such as 'sequence'."
                    )
                axes.setdefault(name, {})[axis] = label
    if dynamic_batch:
        for name, tensor in zip(names, inputs):
            if tensor.dim() == 0:
                if dynamic_axes is None:
                    raise InvalidArgumentError(
                        f"dynamic_batch=True needs a batch dimension on every input, but {name!r} is a scalar; "
                        f"pass dynamic_batch=False."
                    )
                continue
            axes.setdefault(name, {}).setdefault(0, BATCH)
    _check_shared_sizes(axes, names, inputs, argument)
    return {name: dict(sorted(spec.items())) for name, spec in axes.items() if spec}


def _check_shared_sizes(axes: Axes, names: Sequence[str], inputs: Sequence[torch.Tensor], argument: str) -> None:
    tensors = dict(zip(names, inputs))
    seen: dict[str, tuple[str, int, int]] = {}
    for name, spec in axes.items():
        for axis, label in spec.items():
            size = int(tensors[name].shape[axis])
            if label in seen and seen[label][2] != size:
                other, other_axis, other_size = seen[label]
                raise InvalidArgumentError(
                    f"{argument} gives {name!r} axis {axis} and {other!r} axis {other_axis} the same name {label!r}, "
                    f"but the sample's sizes differ ({size} and {other_size}); name them differently or fix the sample."
                )
            seen.setdefault(label, (name, axis, size))


def describe(axes: Axes) -> str:
    return "; ".join(f"{name}: " + ", ".join(f"{axis}={label}" for axis, label in spec.items())
                     for name, spec in axes.items()) or "none"


# -- capture --------------------------------------------------------------------------------
def tracing_inputs(inputs: tuple[torch.Tensor, ...], names: Sequence[str], axes: Axes) -> tuple[torch.Tensor, ...]:
    """torch.export specialises a dimension of size 0 or 1: such a symbolic axis is traced at
    size 2, repeating the sample along it (a batch row, a token)."""
    import torch

    grow = {label for name, t in zip(names, inputs) for axis, label in axes.get(name, {}).items() if t.shape[axis] < 2}
    if not grow:
        return inputs
    out = []
    for name, tensor in zip(names, inputs):
        for axis, label in axes.get(name, {}).items():
            if label in grow:
                if tensor.shape[axis] == 0:
                    raise InvalidArgumentError(
                        f"The sample's {name!r} has size 0 on its symbolic axis {axis} ({label!r}); give a sample "
                        f"with at least one element there."
                    )
                tensor = torch.cat([tensor, tensor], dim=axis)
        out.append(tensor)
    return tuple(out)


def _dims(axes: Axes, ranges: Mapping[str, tuple[int | None, int | None]]) -> dict[str, Any]:
    import torch

    dims = {}
    for spec in axes.values():
        for label in spec.values():
            if label not in dims:
                low, high = ranges.get(label, (None, None))
                bounds = {key: value for key, value in (("min", low), ("max", high)) if value is not None}
                dims[label] = torch.export.Dim(label, **bounds)
    return dims


def export_shapes(axes: Axes, names: Sequence[str], inputs: Sequence[torch.Tensor],
                  ranges: Mapping[str, tuple[int | None, int | None]] | None = None, *, auto: bool = False) -> tuple | None:
    """``dynamic_shapes`` for ``torch.export``: one ``Dim`` per label, shared by the inputs that
    name it; with ``auto``, ``Dim.AUTO`` everywhere (torch.export then bounds each size by the
    guards the model needs, such as a feature map that must stay wider than 1)."""
    import torch

    if not axes:
        return None
    dims = {label: torch.export.Dim.AUTO for spec in axes.values() for label in spec.values()} if auto \
        else _dims(axes, ranges or {})
    return tuple({axis: dims[label] for axis, label in axes[name].items()} if name in axes and t.dim() else None
                 for name, t in zip(names, inputs))


_RANGE_FIX = re.compile(r"^\s*(\w+)\s*=\s*Dim\(\s*'(\w+)'\s*(?:,\s*min\s*=\s*(\d+))?\s*(?:,\s*max\s*=\s*(\d+))?\s*\)\s*$")
_STATIC_FIX = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*$")


def suggested_fixes(message: str) -> tuple[dict[str, tuple[int | None, int | None]], dict[str, int]]:
    """torch.export's "Suggested fixes" of a constraint violation: ranges the model bounds a
    symbolic size to (a position table's length), and sizes it fixes to a constant."""
    ranges: dict[str, tuple[int | None, int | None]] = {}
    static: dict[str, int] = {}
    if "Suggested fixes" not in message:
        return ranges, static
    for line in message.split("Suggested fixes", 1)[1].splitlines()[1:]:
        if not line.strip():
            break
        if m := _RANGE_FIX.match(line):
            ranges[m.group(1)] = (int(m.group(3)) if m.group(3) else None, int(m.group(4)) if m.group(4) else None)
        elif m := _STATIC_FIX.match(line):
            static[m.group(1)] = int(m.group(2))
    return ranges, static


_MODEL_LINE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _where(message: str, sizes: Sequence[int] = ()) -> str:
    for symbol, size, file, line, function in _GUARD.findall(message):
        if int(size) in sizes and "torch/" not in file:
            return f" (at {file.rsplit('/', 1)[-1]}:{line}, in {function})"
    places = [p for p in _MODEL_LINE.findall(message) if "/torch/" not in p[0] and "/onnxport/" not in p[0]]
    return f" (at {places[-1][0]}:{places[-1][1]}, in {places[-1][2]})" if places else ""


def capture_with_axes(export: Callable[[tuple | None], T], axes: Axes, names: Sequence[str],
                      inputs: Sequence[torch.Tensor], model: Any,
                      ranges: Mapping[str, tuple[int | None, int | None]] | None = None) -> tuple[T, str]:
    """Run ``export(dynamic_shapes)`` with the axes' ``Dim``s, accepting the ranges torch.export
    proves the model bounds a size to (then retrying once with them), and refusing, by input and
    axis, a size it proves the model fixes.

    Returns the export's result and the guards torch added on the way, each with the line of
    model code that added it (for :func:`specialized_error`, when the caller finds a size
    fixed in the result).
    """
    ranges = dict(ranges or {})
    for _ in range(3):
        try:
            with _guard_log() as guards:
                return export(export_shapes(axes, names, inputs, ranges)), "\n".join(guards)
        except Exception as error:  # torch raises UserError (and wrappers around it)
            message = _innermost(error) + "\n" + "\n".join(guards)
            found, static = suggested_fixes(message)
            static.update(_specialized(message, axes))
            if static:
                raise specialized_error(model, axes, static, message) from error
            found = {label: rng for label, rng in found.items() if label in {lb for s in axes.values() for lb in s.values()}}
            if not found or all(ranges.get(label) == rng for label, rng in found.items()):
                if "Constraints violated" not in message:
                    raise
                # guards torch cannot phrase as a range (a strided map that must stay wider than
                # 1): let torch.export bound the sizes itself; the caller checks they stayed symbolic
                with _guard_log() as guards:
                    return export(export_shapes(axes, names, inputs, auto=True)), "\n".join(guards)
            ranges.update(found)
    raise ExportRefusedError(f"torch.export kept refusing the symbolic axes {describe(axes)}.")


@contextlib.contextmanager
def _guard_log() -> Iterator[list[str]]:
    """The guards torch's shape environment adds while the block runs, each with the line of
    model code that added it (``eval Eq(s27, 16) [guard added] (model.py:5 in forward)``), kept
    from the user's log."""
    found: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "[guard added]" in message:
                found.append(message)

    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    # torch gives this logger a stderr handler of its own: set aside while we listen at INFO
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    for other in handlers:
        logger.removeHandler(other)
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield found
    finally:
        logger.handlers = handlers
        logger.setLevel(level)
        logger.propagate = propagate


_GUARD = re.compile(r"eval Eq\((\w+), (\d+)\) \[guard added\] \((.+?):(\d+) in (\w+)\)")


def _innermost(error: BaseException) -> str:
    texts = [str(error)]
    while error.__cause__ is not None and error.__cause__ is not error:
        error = error.__cause__
        texts.append(str(error))
    return "\n".join(texts)


_SPECIALIZED = re.compile(r"You marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)")


def _specialized(message: str, axes: Axes) -> dict[str, int]:
    labels = {label for spec in axes.values() for label in spec.values()}
    return {m.group(1): int(m.group(2)) for m in _SPECIALIZED.finditer(message) if m.group(1) in labels}


def specialized_error(model: Any, axes: Axes, static: Mapping[str, int], message: str) -> FixedAxesError:
    """The refusal of a capture whose model code fixes the size of symbolic axes (``static``: their
    labels and sizes), naming the inputs, axes and the line of model code."""
    parts = []
    for label, size in static.items():
        where = [f"{name!r} axis {axis}" for name, spec in axes.items() for axis, lb in spec.items() if lb == label]
        parts.append(f"{' and '.join(where)} ({label!r}) to {size}")
    reason = (f"torch.export proves that {type(model).__name__} fixes the size of {'; '.join(parts)}"
              f"{_where(message, list(static.values()))}: the model's code turns that size into a constant (a mask or "
              f"cache built with a Python int, a check against a fixed length)")
    return FixedAxesError(f"{reason}, so the file cannot accept other sizes. Leave that axis out of dynamic_axes, or "
                          f"make the model compute it from the input's shape.", dict(static), reason)


# -- files ----------------------------------------------------------------------------------
def fixed_in_capture(module: Any, names: Sequence[str], axes: Axes) -> dict[str, int]:
    """Labels whose axis a torch.export capture (its graph module) holds at a fixed size."""
    import torch

    fixed = {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for name, node in zip(names, placeholders):
        value = node.meta.get("val")
        for axis, label in axes.get(name, {}).items():
            if isinstance(value, torch.Tensor) and not isinstance(value.shape[axis], torch.SymInt):
                fixed[label] = int(value.shape[axis])
    return fixed


def fixed_in_program(graph: Any, axes: Axes) -> dict[str, int]:
    """Labels whose axis the exporter wrote with a fixed size (it specialised it), and that size;
    ``graph`` is the program's ``onnx_ir`` graph."""
    fixed = {}
    inputs = {value.name: value for value in graph.inputs}
    for name, spec in axes.items():
        value = inputs.get(name)
        if value is None or value.shape is None:
            continue
        for axis, label in spec.items():
            size = value.shape[axis] if axis < len(value.shape) else None
            if isinstance(size, int):
                fixed[label] = size
    return fixed


def file_axes_problems(model: Any, axes: Axes) -> list[str]:
    """The requested symbolic axes that a file's inputs hold fixed (``model`` is its header)."""
    problems = []
    inputs = {value.name: value for value in model.graph.input}
    for name, spec in axes.items():
        value = inputs.get(name)
        if value is None:
            continue
        dims = value.type.tensor_type.shape.dim
        for axis, label in spec.items():
            if axis >= len(dims) or not dims[axis].dim_param:
                size = dims[axis].dim_value if axis < len(dims) else "missing"
                problems.append(f"{name!r} axis {axis} ({label!r}) is fixed ({size})")
    return problems


def second_size(feeds: Mapping[str, np.ndarray], axes: Axes) -> dict[str, np.ndarray]:
    """The feeds with every symbolic axis one longer (the first row or the last position repeated),
    so a file is run at a second size of each of its symbolic axes."""
    out = {}
    for name, value in feeds.items():
        for axis, label in axes.get(name, {}).items():
            index = 0 if label == BATCH and axis == 0 else value.shape[axis] - 1
            value = np.concatenate([value, np.take(value, [index], axis=axis)], axis=axis)
        out[name] = value
    return out


def carry_axes(source: Any, target: Any) -> None:
    """Copy the axes records a capture left on ``source.meta`` to ``target.meta``."""
    for key in (AXES_KEY, ASKED_AXES_KEY):
        if key in source.meta:
            target.meta[key] = source.meta[key]


def asked_axes(model: Any) -> list[dict[int, str]] | None:
    """The axes the caller named when the model was captured, per input (``None`` when not recorded)."""
    meta = getattr(model, "meta", None)
    axes = meta.get(ASKED_AXES_KEY) if isinstance(meta, dict) else None
    return [dict(spec) for spec in axes] if axes is not None else None


def captured_axes(model: Any) -> list[dict[int, str]] | None:
    """The axes a pt2e model was captured with, per input in its order (``None`` when not recorded)."""
    meta = getattr(model, "meta", None)
    axes = meta.get(AXES_KEY) if isinstance(meta, dict) else None
    return [dict(spec) for spec in axes] if axes is not None else None
