"""Calibration batches for the Quantizer: structure, limits and progress."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._core.inputs import calibration_batches, forward_aliases, keyword_inputs, require_batches
from ..errors import InvalidArgumentError


def positional_input_range(model: torch.nn.Module) -> tuple[int, int | None]:
    """(required, maximum) positional inputs of ``model.forward``; maximum None for ``*args``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return 1, None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    return max(required, 1), None if variadic else max(len(positional), 1)


def _fits(candidate: Any, low: int, high: int | None) -> tuple[torch.Tensor, ...] | None:
    if isinstance(candidate, torch.Tensor):
        candidate = (candidate,)
    if not isinstance(candidate, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in candidate):
        return None
    if len(candidate) < low or (high is not None and len(candidate) > high):
        return None
    return tuple(candidate)


def first_inputs(batch: Any, model: torch.nn.Module, argument: str) -> tuple[torch.Tensor, ...]:
    """The model inputs in the first calibration batch, decided by ``forward``'s signature.

    A batch is the inputs themselves or an ``(inputs, target)`` pair; the number of positional
    parameters of ``forward`` tells which.
    """
    low, high = positional_input_range(model)
    direct = _fits(batch, low, high)
    if direct is not None:
        return direct
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        paired = _fits(batch[0], low, high)
        if paired is not None:
            return paired
    want = f"{low}" if high == low else f"{low} to {high if high is not None else 'any number of'}"
    raise InvalidArgumentError(
        f"{argument}'s first batch is {type(batch).__name__}, which does not give the {want} tensor "
        f"input(s) {type(model).__name__}.forward takes; give each batch as the inputs (a tensor or a "
        f"tuple of tensors) or as an (inputs, target) pair."
    )


def read_calibration(
    data: Iterable[Any] | None, model: torch.nn.Module, limit: int | None, argument: str = "calibration_dl",
    dynamic_axes: Any = None,
) -> tuple[list[tuple[torch.Tensor, ...]], tuple[str, ...] | None]:
    """Every calibration batch as a tuple of CPU tensors, checked against the first batch, and the
    keyword names of those inputs when the batches are dicts (``None`` when positional). With
    ``dynamic_axes`` (checked here, against the first batch), batches may differ along them."""
    require_batches(data, argument)
    iterator = iter(data)
    first = next(iterator, None)
    if first is None:
        raise InvalidArgumentError(f"{argument} yielded no batches; give it at least one batch.")
    inputs = first[0] if isinstance(first, (tuple, list)) and first and isinstance(first[0], Mapping) else first
    if isinstance(inputs, Mapping):
        names, reference = keyword_inputs(inputs, f"{argument}'s first batch")
    else:
        names, reference = None, first_inputs(first, model, argument)
    free = None
    if dynamic_axes is not None:
        from .._core.axes import resolve_axes
        from .._core.capture import default_names

        labels = names or tuple(default_names("input", len(reference)))
        axes = resolve_axes(dynamic_axes, dynamic_batch=False, names=labels, inputs=reference,
                            aliases=forward_aliases(model, labels, names))
        free = [set(axes.get(name, {})) for name in labels]
    batches = calibration_batches(itertools.chain([first], iterator), reference, argument, limit=limit, names=names,
                                  free=free)
    return batches, names
