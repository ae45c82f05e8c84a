"""One call of ``torch.onnx.export(dynamo=True)``, with onnxport's input/output conventions."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import ExportRefusedError, InvalidArgumentError
from .axes import Axes, capture_with_axes, fixed_in_program, specialized_error, tracing_inputs
from .torch_helpers import without_kv_cache

#: The oldest opset the dynamo exporter writes; older requests are lowered afterwards.
EXPORTER_MIN_OPSET = 18


@contextlib.contextmanager
def quiet_registry():
    """Silence the exporter's registry for the block.

    It logs a warning per torchvision operator it cannot register when torchvision is absent
    (it is, on purpose): noise that says nothing about the user's model.
    """
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def default_names(prefix: str, count: int) -> list[str]:
    return [prefix] if count == 1 else [f"{prefix}_{i}" for i in range(count)]


def check_names(names: Sequence[str] | None, count: int, argument: str, prefix: str) -> list[str]:
    """Validate user-given input/output names against the model, or make the default ones."""
    if names is None:
        return default_names(prefix, count)
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentError(f"{argument} must be a list of non-empty strings, not {names!r}.")
    names = list(names)
    if len(names) != count:
        raise InvalidArgumentError(f"{argument} has {len(names)} names but the model has {count} {prefix}s.")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"{argument} repeats a name: {names}.")
    return names


def _all_true(x):  # an onnxscript function: traced, its types are the graph's
    from onnxscript import opset18 as op

    return op.Cast(op.ReduceMin(op.Cast(x, to=6), keepdims=0), to=9)  # int32 minimum over all, as bool


def _rsub_scalar(self, other, alpha=1):  # traced: ``self`` is a symbolic tensor with its dtype
    import onnx_ir as ir
    from onnxscript import opset18 as op

    if isinstance(other, float) and not self.dtype.is_floating_point():
        self = op.Cast(self, to=ir.DataType.FLOAT)  # torch promotes an integer tensor to the default float
    if alpha != 1:
        self = op.Mul(self, op.CastLike(alpha, self))
    return op.Sub(op.CastLike(other, self), self)


def check_translations() -> dict[Any, Any]:
    """Translations for the operators a data check leaves behind. transformers writes its checks
    as ``torch._check`` on a tensor (``torch_compilable_check``: RT-DETRv2, D-FINE), which reaches the
    program as ``_is_all_true`` feeding an ``_assert_async``; torch.onnx removes the assertion but
    keeps the ``_is_all_true`` it read, which it has no translation for. Translated (a minimum over
    all elements), it is then unused and the optimizer removes it."""
    return {torch.ops.aten._is_all_true.default: _all_true}


def promotion_translations() -> dict[Any, Any]:
    """``number - tensor`` (``aten.rsub.Scalar``): torch.onnx decomposes it into ``sub(number,
    tensor)``, an overload that does not exist, so an integer mask subtracted from a float
    (XLNet's ``1.0 - attention_mask``) failed the export. Translated directly, with torch's
    promotion of an integer tensor to float."""
    return {torch.ops.aten.rsub.Scalar: _rsub_scalar}


def torch_program(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    opset_version: int,
    input_names: list[str],
    output_names: list[str],
    axes: Axes,
    custom_translation_table: dict | None = None,
    ranges: dict[str, tuple[int | None, int | None]] | None = None,
    optimize: bool = True,
) -> torch.onnx.ONNXProgram:
    """Export with the dynamo exporter at ``max(opset_version, 18)``, with the symbolic ``axes``
    (checked by :func:`onnxport._core.axes.resolve_axes`) named as their labels in the file.

    The program's ``model`` is an ``onnx_ir`` model whose weights still live in torch (nothing is
    copied until it is saved); ``model_proto`` is the same graph as a protobuf. ``ranges`` bounds
    labels from the start (``{'total_sequence': (4, None)}``), saving the capture torch would
    otherwise refuse once and suggest them from. ``optimize=False`` leaves torch.onnx's optimizer
    to the caller (``program.optimize()``), for a graph it changes first.
    """
    inputs = tracing_inputs(inputs, input_names, axes)
    chatter = io.StringIO()

    def export(dynamic_shapes: tuple | None) -> torch.onnx.ONNXProgram:
        # The math backend during capture: with the default choice, the stride the tracer gives an
        # SDPA output makes a later reshape a view that the ONNX decomposition then cannot apply
        # (transformers' Swin: "Cannot view a tensor …"); the ONNX translation of SDPA is the same.
        with quiet_registry(), warnings.catch_warnings(), contextlib.redirect_stdout(chatter), \
                sdpa_kernel(SDPBackend.MATH), without_kv_cache(model):
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*The axis name")
            return torch.onnx.export(
                model,
                inputs,
                None,
                dynamo=True,
                opset_version=max(opset_version, EXPORTER_MIN_OPSET),
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=dynamic_shapes,
                verbose=False,
                report=False,
                optimize=optimize,
                custom_translation_table={**check_translations(), **promotion_translations(),
                                          **(custom_translation_table or {})},
            )

    try:
        program, guards = capture_with_axes(export, axes, input_names, inputs, model, ranges)
    except InvalidArgumentError:
        raise
    except Exception as error:  # the exporter raises many types; the cause is kept as __cause__
        raise ExportRefusedError(_capture_failure(model, error)) from error
    if program is None:
        raise ExportRefusedError("torch.onnx.export returned no program.")
    fixed = fixed_in_program(program.model.graph, axes)
    if fixed:  # the exporter fell back to a capture that specialised the size
        raise specialized_error(model, axes, fixed, guards)
    return program


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MODEL_CODE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _capture_failure(model: torch.nn.Module, error: BaseException) -> str:
    """A sentence naming the model, the construct torch failed on and where, and what to try.

    The exporter wraps the real failure in several layers; the innermost one says what went
    wrong, and its "Original traceback" names the line of model code.
    """
    root = error
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = _ANSI.sub("", str(root)).strip()
    what = next((line.strip() for line in text.splitlines() if line.strip()), type(root).__name__)
    places = _MODEL_CODE.findall(text) or _MODEL_CODE.findall(_ANSI.sub("", str(error)))
    where = f" (at {Path(places[-1][0]).name}:{places[-1][1]}, in {places[-1][2]})" if places else ""
    hint = ("Make the model traceable by torch.export (no data-dependent Python control flow), or check the "
            "sample's shapes (dynamic_batch=False if the failure involves the batch size).")
    return (f"torch.onnx.export (torch.export) could not capture {type(model).__name__}: "
            f"{type(root).__name__}: {what[:300]}{where}. {hint}")
