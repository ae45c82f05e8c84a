"""A family's quirks, registered by ``model_type`` (as Optimum keeps one config per architecture):
how to load it and what to change before it exports. The exporters' code never names a model.

Shared by the front door (``export_pretrained``) and the generation exporters (``export_decoder``,
``export_seq2seq``), so it sits in the core both stand on.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ExportRefusedError


def _nothing(model: torch.nn.Module) -> None:
    return None


def _as_it_is(model: torch.nn.Module) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Adapter:
    """What one family needs to export.

    Attributes:
        load_kwargs: given to ``from_pretrained`` (an attention implementation that exports).
        prepare_half: changes a float16 copy in place before it exports (never the caller's model:
            the exporters call it on the copy they made). It must leave every output as it was, so
            the copy stays the ``model.half()`` the file is held to.
        capturing: a context the exporters capture and prove the model in, loaded or given (a
            model given is theirs only for that while): a data-dependent branch off, a length
            cache set aside. What it changes is undone when it ends, and every output is as it was.
    """

    load_kwargs: dict[str, Any] = field(default_factory=dict)
    prepare_half: Callable[[torch.nn.Module], None] = _nothing
    capturing: Callable[[torch.nn.Module], AbstractContextManager[None]] = _as_it_is


#: transformers' eager attention: SDPA's export carries a NaN guard per attention (IsNaN and Where
#: after its softmax) that ONNX Runtime runs on every call; the eager form is the plain three ops
DEFAULT = Adapter(load_kwargs={"attn_implementation": "eager"})
ADAPTERS: dict[str, Adapter] = {}


def register(*model_types: str) -> Callable[[Adapter], Adapter]:
    def add(adapter: Adapter) -> Adapter:
        for model_type in model_types:
            ADAPTERS[model_type] = adapter
        return adapter

    return add


def adapter_for(model_type: str) -> Adapter:
    return ADAPTERS.get(model_type, DEFAULT)


class _AllFiniteAnswered(TorchFunctionMode):
    """Answers ``torch.isfinite(x).all()`` with ``True`` in Python, so a layer's
    ``if not torch.isfinite(x).all():`` branch is not taken and leaves no data-dependent guard
    for torch.export; counts how often it answered."""

    def __init__(self) -> None:
        super().__init__()
        # the results themselves are kept, not only their ids: a freed tensor's id can be reused
        self._finite: list[torch.Tensor] = []
        self.answered = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.all and len(args) == 1 and not kwargs \
                and any(args[0] is seen for seen in self._finite):
            self.answered += 1
            return True
        result = func(*args, **kwargs)
        if func is torch.isfinite:
            self._finite.append(result)
        return result


def _clamp_unless_finite(output: torch.Tensor) -> torch.Tensor:
    """The float16 layer's guard as data flow: clamped to the largest float16 less 1000 only when
    some value is not finite, the same values the branch gives."""
    bound = torch.finfo(output.dtype).max - 1000
    return torch.where(torch.isfinite(output).all(), output, output.clamp(-bound, bound))


def _encoder_layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else model
    yield from getattr(encoder, "layers", ())


def _finite_guard_as_data_flow(model: torch.nn.Module) -> None:
    """BART-like encoder layers in float16 end with ``if not torch.isfinite(x).all(): x = clamp(x)``:
    a branch on data, which torch.export cannot capture. Each layer runs with that test answered
    "finite" and then applies the same clamp as a ``Where`` on its output, so the file clamps
    exactly when the model would (a layer whose test is not its last step would be wrong here:
    a layer that does not ask it exactly once in float16 is refused)."""
    for layer in _encoder_layers(model):
        # the class's forward, called on ``self``: a deep copy of the model runs its own weights
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            mode = _AllFiniteAnswered()
            with mode:
                output = type(self).forward(self, *args, **kwargs)
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.dtype != torch.float16:
                return output
            if mode.answered != 1:
                raise ExportRefusedError(
                    f"{type(self).__name__} asked whether its values are finite {mode.answered} times in float16, "
                    f"where the adapter for its family expects once, as its last step; the adapter does not fit "
                    f"this version of the model's code.")
            if isinstance(output, tuple):
                return (_clamp_unless_finite(hidden), *output[1:])
            return _clamp_unless_finite(hidden)

        layer.forward = types.MethodType(forward, layer)


register("bart", "marian", "plbart", "mvp", "blenderbot-small", "bigbird_pegasus")(
    Adapter(load_kwargs=dict(DEFAULT.load_kwargs), prepare_half=_finite_guard_as_data_flow))


@contextlib.contextmanager
def _without_length_cache(model: torch.nn.Module) -> Iterator[None]:
    """Rotary position tables kept between calls with the length they were made for
    (``cached_sequence_length``): comparing a traced length with the last eager run's length fixes
    that axis in the file, and a capture would leave a traced table in the module. While
    capturing, each such module forgets its table before and after every call, so every call
    computes it from the input's own length (the values are the same)."""
    changed = []
    for module in model.modules():
        if not hasattr(module, "cached_sequence_length") or "forward" in vars(module):
            continue
        cached = [name for name in vars(module) if name.startswith("cached_")]

        # the class's forward, called on ``self``: a deep copy of the model (pt2e's capture makes
        # one) sets aside its own table, not the original's
        def forward(self: torch.nn.Module, *args: Any, _cached: list = cached, **kwargs: Any) -> Any:
            for name in _cached:
                setattr(self, name, None)
            try:
                return type(self).forward(self, *args, **kwargs)
            finally:
                for name in _cached:
                    setattr(self, name, None)

        module.forward = types.MethodType(forward, module)
        changed.append(module)
    try:
        yield
    finally:
        for module in changed:
            del module.forward


register("wav2vec2-conformer", "wav2vec2-bert")(
    Adapter(load_kwargs=dict(DEFAULT.load_kwargs), capturing=_without_length_cache))


def _conv_output_length(convolutions: list[torch.nn.Conv1d], length: Any) -> Any:
    """The length a stack of 1-D convolutions gives, in integer arithmetic (a traced length stays
    symbolic), from each layer's own kernel, stride, padding and dilation."""
    for conv in convolutions:
        padding = conv.padding[0] if isinstance(conv.padding, tuple) else 0  # 'same'/'valid' strings hold no int
        length = (length + 2 * padding - conv.dilation[0] * (conv.kernel_size[0] - 1) - 1) // conv.stride[0] + 1
    return length


@contextlib.contextmanager
def _integer_output_lengths(model: torch.nn.Module) -> Iterator[None]:
    """A speech encoder that computes its output length from its input's with float division and
    ``int()`` (Moonshine's ``_get_feat_extract_output_lengths``): torch.export fixes the traced
    length at ``int()``, so the file's mask would keep the example's length. While capturing, each
    such encoder computes it from its own convolutions in integer division: the same value for
    every input its first convolution takes."""
    changed = []
    for module in model.modules():
        if not callable(getattr(type(module), "_get_feat_extract_output_lengths", None)):
            continue
        convolutions = [m for m in module.modules() if isinstance(m, torch.nn.Conv1d)]
        if not convolutions or "_get_feat_extract_output_lengths" in vars(module):
            continue

        def lengths(self: torch.nn.Module, input_lengths: Any, _convs: list = convolutions) -> Any:
            return _conv_output_length(_convs, input_lengths)

        vars(module)["_get_feat_extract_output_lengths"] = types.MethodType(lengths, module)
        changed.append(module)
    try:
        yield
    finally:
        for module in changed:
            del module._get_feat_extract_output_lengths


register("moonshine")(Adapter(load_kwargs=dict(DEFAULT.load_kwargs), capturing=_integer_output_lengths))


def _blocks(x: torch.Tensor, block_len: int, dim: int) -> torch.Tensor:
    """``x`` split on ``dim`` into blocks of ``block_len``, the last one padded with zeros, for
    every non-empty ``x`` by the same operations (the padding is zero long where ``dim`` is a
    multiple of ``block_len`` already)."""
    dim %= x.ndim
    padding = [0] * (2 * x.ndim)
    padding[2 * (x.ndim - 1 - dim) + 1] = -x.shape[dim] % block_len  # F.pad lists the last axis first
    x = torch.nn.functional.pad(x, padding)
    return x.reshape(x.shape[:dim] + (x.shape[dim] // block_len, block_len) + x.shape[dim + 1:])


@contextlib.contextmanager
def _blocks_without_branches(model: torch.nn.Module) -> Iterator[None]:
    """LongT5's local attention splits the sequence into blocks with a module function that pads
    only where the length is not a multiple of the block already — a Python ``if`` on the traced
    length, so torch.export proves the length fixed — and returns an empty tensor for an empty
    input. While capturing, the model's modeling module splits by :func:`_blocks`: the same tensor
    for every non-empty input, by operations that hold at any length."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    changed = [(module, module._split_into_blocks) for module in modules
               if callable(getattr(module, "_split_into_blocks", None))]
    for module, _ in changed:
        vars(module)["_split_into_blocks"] = _blocks
    try:
        yield
    finally:
        for module, original in changed:
            vars(module)["_split_into_blocks"] = original


register("longt5")(Adapter(load_kwargs=dict(DEFAULT.load_kwargs), capturing=_blocks_without_branches))
