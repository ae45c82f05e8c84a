"""One call of ``torch.onnx.export(dynamo=True)``, with onnxport's input/output conventions."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Sequence

import torch

from .errors import ExportRefusedError, InvalidArgumentError

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


def tracing_inputs(inputs: tuple[torch.Tensor, ...], dynamic_batch: bool) -> tuple[torch.Tensor, ...]:
    """torch.export specialises a dimension of size 1, so a dynamic batch is traced at size 2."""
    if dynamic_batch and inputs[0].dim() and inputs[0].shape[0] == 1:
        return tuple(torch.cat([t, t]) if t.dim() else t for t in inputs)
    return inputs


def torch_program(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    opset_version: int,
    input_names: list[str],
    output_names: list[str],
    dynamic_batch: bool,
    custom_translation_table: dict | None = None,
) -> torch.onnx.ONNXProgram:
    """Export with the dynamo exporter at ``max(opset_version, 18)``.

    The program's ``model`` is an ``onnx_ir`` model whose weights still live in torch (nothing is
    copied until it is saved); ``model_proto`` is the same graph as a protobuf.
    """
    dynamic_shapes = None
    if dynamic_batch:
        for name, t in zip(input_names, inputs):
            if t.dim() == 0:
                raise InvalidArgumentError(
                    f"dynamic_batch=True needs a batch dimension on every input, but '{name}' is a scalar; "
                    f"pass dynamic_batch=False."
                )
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({0: batch} for _ in inputs)
    inputs = tracing_inputs(inputs, dynamic_batch)
    chatter = io.StringIO()
    try:
        with quiet_registry(), warnings.catch_warnings(), contextlib.redirect_stdout(chatter):
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*The axis name")
            program = torch.onnx.export(
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
                custom_translation_table=custom_translation_table,
            )
    except Exception as error:  # the exporter raises many types; the cause is kept as __cause__
        cause = str(error).strip().splitlines()
        raise ExportRefusedError(
            f"torch.onnx.export (torch.export) could not capture {type(model).__name__}: "
            f"{type(error).__name__}: {cause[0] if cause else ''}. Make the model traceable by "
            f"torch.export (no data-dependent Python control flow), or check the sample's shapes."
        ) from error
    if program is None:
        raise ExportRefusedError("torch.onnx.export returned no program.")
    return program
