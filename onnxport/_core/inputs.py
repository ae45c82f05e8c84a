"""Normalising what users pass as model inputs: samples and calibration batches."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidArgumentError

#: Where a model quantized from keyword inputs keeps their names, in the order it takes them.
INPUT_NAMES_KEY = "onnxport_input_names"


def recorded_input_names(model: Any) -> tuple[str, ...] | None:
    """The keyword names a quantized model was captured with (it takes them positionally)."""
    meta = getattr(model, "meta", None)
    names = meta.get(INPUT_NAMES_KEY) if isinstance(meta, dict) else None
    return tuple(names) if names else None


def keyword_inputs(sample: Mapping, argument: str = "sample") -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """A dict of keyword inputs (``{'input_ids': …, 'attention_mask': …}``) → (names, tensors)."""
    if not sample:
        raise InvalidArgumentError(f"{argument} is an empty dict; give at least one input tensor by name.")
    for name, value in sample.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgumentError(f"{argument} has the key {name!r}; keys must be forward's parameter names.")
        if not isinstance(value, torch.Tensor):
            hint = " (leave the key out instead)" if value is None else ""
            raise InvalidArgumentError(
                f"{argument}[{name!r}] is {_describe(value)}, not a torch.Tensor{hint}: every keyword input must be a "
                f"tensor, batch dimension first."
            )
    return tuple(sample), tuple(sample.values())


class _ByName:
    """Calls ``model`` with positional inputs as the keyword inputs ``names``."""

    def __init__(self, model: Any, names: tuple[str, ...]) -> None:
        self.model, self.names = model, names

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, inputs)))


class _Uncached:
    """Calls ``model`` as it is captured: without a transformers key/value cache, whose outputs
    (tensors in older model code) the exported graph does not have."""

    def __init__(self, model: Any, call: Callable) -> None:
        self.model, self.call = model, call

    def __call__(self, *inputs: torch.Tensor) -> Any:
        from .torch_helpers import without_kv_cache

        with without_kv_cache(self.model):
            return self.call(*inputs)


def bind_sample(model: Any, sample: Any, argument: str = "sample") -> tuple[Callable, tuple[torch.Tensor, ...], tuple[str, ...] | None]:
    """What to call, with which positional inputs, for a sample given as a tensor, a tuple or a dict.

    A dict gives keyword inputs (a Hugging Face model called with ``input_ids`` and
    ``attention_mask``). Returns ``(call, inputs, names)``: ``call(*inputs)`` runs the model,
    ``names`` are the keywords in the order of ``inputs`` (``None`` for positional samples). A
    model quantized from keyword inputs takes them positionally in its recorded order, and a dict
    for it must hold exactly those names.
    """
    recorded = recorded_input_names(model)
    if isinstance(sample, Mapping):
        names, inputs = keyword_inputs(sample, argument)
        if recorded is None:
            return _Uncached(model, _ByName(model, names)), inputs, names
        if set(names) != set(recorded):
            raise InvalidArgumentError(
                f"{argument} names the inputs {sorted(names)}, but this model was quantized with {list(recorded)}; "
                f"give the same keyword inputs."
            )
        return model, tuple(sample[n] for n in recorded), recorded
    return _Uncached(model, model), as_input_tuple(sample, argument), recorded


def file_batch(onnx_path: Any) -> int | None:
    """The batch an ONNX file was exported with when it is fixed (the first dimension every graph
    input shares), ``None`` when it is symbolic or the inputs disagree. Reads no weights."""
    import onnx

    model = onnx_path if isinstance(onnx_path, onnx.ModelProto) else onnx.load_model(str(onnx_path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    firsts = set()
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if not dims or not dims[0].HasField("dim_value"):
            return None
        firsts.add(dims[0].dim_value)
    return firsts.pop() if len(firsts) == 1 else None


def split_batches(inputs: Sequence[torch.Tensor], n_batches: Any, fixed_batch: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """``inputs`` (batch first) cut into ``n_batches`` equal batches of positional inputs.

    With the default ``n_batches=1`` and a file of a fixed batch (``fixed_batch``) that the sample's
    size is a multiple of, the sample is cut into batches of the file's size: the file says its
    batch, so the caller need not.
    """
    if isinstance(n_batches, bool) or not isinstance(n_batches, int) or n_batches < 1:
        raise InvalidArgumentError(f"n_batches must be a positive integer, not {n_batches!r}.")
    total = inputs[0].shape[0] if inputs[0].dim() else 0
    if total == 0:
        raise InvalidArgumentError("sample is empty: there is nothing to compare.")
    if n_batches == 1 and (not fixed_batch or all(t.dim() and t.shape[0] == fixed_batch for t in inputs)):
        # one run of the sample as it is: inputs may have batches of their own (CLIP's texts and images)
        return [tuple(t.detach().cpu() for t in inputs)]
    if any(t.dim() == 0 or t.shape[0] != total for t in inputs):
        raise InvalidArgumentError("Every input in sample must have the same batch size (its first dimension).")
    if n_batches == 1 and fixed_batch and total != fixed_batch:
        if total % fixed_batch:
            raise InvalidArgumentError(
                f"sample holds {total} inputs, but the file was exported with a fixed batch of {fixed_batch}, which "
                f"does not divide {total}; give a sample of a multiple of {fixed_batch}."
            )
        n_batches = total // fixed_batch
    if total % n_batches:
        raise InvalidArgumentError(
            f"sample holds {total} inputs, which does not split into {n_batches} equal batches; "
            f"pass an n_batches that divides {total}."
        )
    size = total // n_batches
    return list(zip(*(torch.split(t.detach().cpu(), size) for t in inputs)))


def forward_aliases(model: Any, names: Sequence[str], keywords: Sequence[str] | None) -> dict[str, str]:
    """For a positional sample: the model's ``forward`` parameter names, in order, mapped to the
    file's input names (``{'input_features': 'input'}``), so ``dynamic_axes`` may name an input
    as the model does."""
    if keywords:
        return {}
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = [p.name for p in parameters
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return {alias: name for alias, name in zip(positional, names) if alias != name}


@contextlib.contextmanager
def positional_forward(model: torch.nn.Module, names: Sequence[str] | None) -> Iterator[torch.nn.Module]:
    """``model`` taking the keyword inputs ``names`` positionally, for as long as the block runs.

    ``torch.export`` and ``torch.onnx.export`` capture positional inputs; a forward whose
    signature is exactly ``names`` lets them capture keyword inputs (GPT-2's ``attention_mask`` is
    its third parameter, after ``past_key_values``) with their names and module paths intact.
    The model is left as it was.
    """
    if not names or recorded_input_names(model):
        yield model
        return
    names = tuple(names)
    original = model.forward

    def forward(*inputs: torch.Tensor) -> Any:
        return original(**dict(zip(names, inputs)))

    with forward_replaced(model, forward, names):
        yield model


@contextlib.contextmanager
def forward_replaced(model: torch.nn.Module, forward: Callable[..., Any], names: Sequence[str]) -> Iterator[None]:
    """``model.forward`` is ``forward``, taking ``names`` positionally, for as long as the block
    runs (what torch.export captures); the model's own forward is back afterwards, as it was."""
    had = "forward" in vars(model)
    saved = vars(model).get("forward")
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = saved
        else:
            del model.forward


def as_input_tuple(sample: Any, argument: str = "sample") -> tuple[torch.Tensor, ...]:
    """A tensor or a tuple/list of tensors → a tuple of tensors (one per model input)."""
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, (tuple, list)) and sample and all(isinstance(t, torch.Tensor) for t in sample):
        return tuple(sample)
    raise InvalidArgumentError(
        f"{argument} must be a torch.Tensor, a non-empty tuple of torch.Tensors (one per model "
        f"input, batch dimension first) or a dict of them by forward's parameter names, not {_describe(sample)}."
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


def _matches(candidate: Any, reference: Sequence[torch.Tensor],
             free: Sequence[set[int]] | None = None) -> tuple[torch.Tensor, ...] | None:
    if isinstance(candidate, torch.Tensor):
        candidate = (candidate,)
    if not isinstance(candidate, (tuple, list)) or len(candidate) != len(reference):
        return None
    for index, (got, ref) in enumerate(zip(candidate, reference)):
        if not isinstance(got, torch.Tensor) or got.dim() != ref.dim() or not _same_kind(got, ref):
            return None
        loose = {0} | (set(free[index]) if free else set())
        if any(a != b for axis, (a, b) in enumerate(zip(got.shape, ref.shape)) if axis not in loose):
            return None
    return tuple(candidate)


def _by_names(batch: Any, names: Sequence[str] | None) -> Any:
    if names is not None and isinstance(batch, Mapping):
        return tuple(batch[n] for n in names) if set(batch) == set(names) else None
    return batch


def split_batch(batch: Any, reference: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                free: Sequence[set[int]] | None = None) -> tuple[torch.Tensor, ...] | None:
    """The model inputs held by one calibration batch, or ``None`` when it does not fit.

    A batch may be the inputs themselves (a tensor, or a tuple with one tensor per input), or an
    ``(inputs, target…)`` pair as a DataLoader of a labelled data set yields; with ``names``,
    the inputs may be a dict of exactly those keyword inputs. The inputs must match
    ``reference`` (the sample) in count, rank, dtype kind and every dimension but the batch and
    the ``free`` axes of each input (its symbolic ones: a sequence length).
    """
    direct = _matches(_by_names(batch, names), reference, free)
    if direct is not None:
        return direct
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return _matches(_by_names(batch[0], names), reference, free)
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
    names: Sequence[str] | None = None,
    free: Sequence[set[int]] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Read calibration data into a list of input tuples, checking every batch's structure.

    Args:
        data: an iterable of batches (a DataLoader works): tensors, tuples of inputs, or
            ``(inputs, target)`` pairs.
        reference: the sample inputs the batches must match.
        argument: the argument name used in error messages.
        names: the keyword names of ``reference``: a batch may then be a dict of them.
        limit: stop after this many samples (counted along the batch dimension), never
            overshooting: the last batch is trimmed, and no batch past it is read from ``data``
            (at most ``ceil(limit / batch_size)`` batches are pulled).
        free: per input, the axes besides the batch whose size may differ between batches (the
            symbolic axes of a capture with ``dynamic_axes``).
    """
    require_batches(data, argument)
    labels = [f"{n}=" for n in names] if names else [""] * len(reference)
    expected = ", ".join(
        f"{label}Tensor(N, " + ", ".join("*" if free and axis in free[i] else str(n) for axis, n in enumerate(t.shape) if axis) + ")"
        for i, (label, t) in enumerate(zip(labels, reference)))
    batches: list[tuple[torch.Tensor, ...]] = []
    seen = 0
    for index, batch in enumerate(data):
        inputs = split_batch(batch, reference, names, free)
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


def speech_feature_width(config: Any) -> int | None:
    """How many features a speech model reads per frame, as its config names them (Speech2Text's
    ``input_feat_per_channel`` × channels, Whisper's ``num_mel_bins``, ``feature_size``, Wav2Vec2-BERT's
    ``feature_projection_input_dim``, or a composite's ``encoder_config``'s); ``None`` where none is named."""
    per_channel = getattr(config, "input_feat_per_channel", None)
    if isinstance(per_channel, int):
        return per_channel * int(getattr(config, "input_channels", 1) or 1)
    for name in ("feature_projection_input_dim", "num_mel_bins", "feature_size"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    encoder = getattr(config, "encoder_config", None)
    return speech_feature_width(encoder) if encoder is not None and encoder is not config else None
