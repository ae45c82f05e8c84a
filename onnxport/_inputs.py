"""Normalising what users pass as model inputs: samples and calibration batches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .errors import InvalidArgumentError


def as_input_tuple(sample: Any, argument: str = "sample") -> tuple[torch.Tensor, ...]:
    """A tensor or a tuple/list of tensors → a tuple of tensors (one per model input)."""
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)) and sample and all(isinstance(t, torch.Tensor) for t in sample):
        return tuple(sample)
    raise InvalidArgumentError(
        f"{argument} must be a torch.Tensor or a non-empty tuple of torch.Tensors (one per model "
        f"input, batch dimension first), not {_describe(sample)}."
    )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value[:4])
        more = ", …" if len(value) > 4 else ""
        return f"{type(value).__name__}({inner}{more})"
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}:{str(value.dtype).replace('torch.', '')}"
    return type(value).__name__


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype.is_floating_point == b.dtype.is_floating_point and a.dtype.is_complex == b.dtype.is_complex


def _matches(candidate: Any, reference: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    if isinstance(candidate, torch.Tensor):
        candidate = (candidate,)
    if not isinstance(candidate, (tuple, list)) or len(candidate) != len(reference):
        return None
    for got, ref in zip(candidate, reference):
        if not isinstance(got, torch.Tensor) or got.dim() != ref.dim() or not _same_kind(got, ref):
            return None
        if tuple(got.shape[1:]) != tuple(ref.shape[1:]):
            return None
    return tuple(candidate)


def split_batch(batch: Any, reference: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """The model inputs held by one calibration batch, or ``None`` when it does not fit.

    A batch may be the inputs themselves (a tensor, or a tuple with one tensor per input), or an
    ``(inputs, target…)`` pair as a DataLoader of a labelled data set yields. The inputs must
    match ``reference`` (the sample) in count, rank, dtype kind and every dimension but the batch.
    """
    direct = _matches(batch, reference)
    if direct is not None:
        return direct
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return _matches(batch[0], reference)
    return None


def require_batches(data: Any, argument: str) -> None:
    """``data`` must be an iterable of batches (a DataLoader, a list…), not a tensor or nothing."""
    if data is None:
        raise InvalidArgumentError(
            f"{argument} is required: pass an iterable of input batches (a DataLoader works)."
        )
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise InvalidArgumentError(
            f"{argument} must be an iterable of batches (a DataLoader, or a list of tensors, of "
            f"tuples of inputs or of (inputs, target) pairs), not {_describe(data)}."
        )


def calibration_batches(
    data: Iterable[Any] | None,
    reference: Sequence[torch.Tensor],
    argument: str = "calibration_data",
    limit: int | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Read calibration data into a list of input tuples, checking every batch's structure.

    Args:
        data: an iterable of batches (a DataLoader works): tensors, tuples of inputs, or
            ``(inputs, target)`` pairs.
        reference: the sample inputs the batches must match.
        argument: the argument name used in error messages.
        limit: stop after this many samples (counted along the batch dimension), never
            overshooting: the last batch is trimmed, and no batch past it is read from ``data``
            (at most ``ceil(limit / batch_size)`` batches are pulled).
    """
    require_batches(data, argument)
    expected = ", ".join(f"Tensor(N, {', '.join(map(str, t.shape[1:]))})" for t in reference)
    batches: list[tuple[torch.Tensor, ...]] = []
    seen = 0
    for index, batch in enumerate(data):
        inputs = split_batch(batch, reference)
        if inputs is None:
            raise InvalidArgumentError(
                f"{argument} batch {index} is {_describe(batch)}, which does not match the model's "
                f"inputs ({expected}); give each batch as the inputs or as an (inputs, target) pair."
            )
        inputs = tuple(t.detach().cpu() for t in inputs)
        if limit is not None and inputs[0].dim() and inputs[0].shape[0] > limit - seen:
            inputs = tuple(t[: limit - seen] for t in inputs)
        batches.append(inputs)
        seen += int(inputs[0].shape[0]) if inputs[0].dim() else 1
        if limit is not None and seen >= limit:
            break  # before the next batch is pulled: a loader may be costly or stream from a service
    if not batches:
        raise InvalidArgumentError(f"{argument} yielded no batches; give it at least one batch.")
    return batches


def flatten_outputs(outputs: Any) -> list[torch.Tensor]:
    """A model's outputs (a tensor, or any nesting of tuples/lists/dicts) as a flat list."""
    leaves = torch.utils._pytree.tree_leaves(outputs)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
