"""The encoder–decoder an ``export_seq2seq`` folder is exported from: loading it, the shape of its
caches, and the two forwards the exporter captures.

The encoder file computes, beside the encoder's output, every decoder layer's cross-attention keys
and values (they depend on the source alone, so they are computed once per source, not once per
new token). The decoder file takes them as inputs next to its own growing self-attention cache,
so one decoder graph serves the first step and every later one. Both forwards are the model's
own: the cross-attention keys and values come from running its decoder once with an empty
``EncoderDecoderCache`` (the unused rest of that run is dead code the exporter drops), and the
decoder step runs the model with that cache filled, so no family's layers are re-implemented here.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ExportRefusedError, InvalidArgumentError
from .model import returned_cache
from .names import (
    ATTENTION_MASK,
    ENCODER_ATTENTION_MASK,
    INPUT_FEATURES,
    INPUT_IDS,
    LAST_HIDDEN_STATE,
    LOGITS,
)


@dataclass(frozen=True)
class Seq2SeqShape:
    """What an encoder–decoder's files look like: read from one real run of the model."""

    model_type: str
    #: the encoder takes log-mel ``input_features`` (speech) instead of ``input_ids``
    audio: bool
    layers: int
    heads: int
    head_dim: int
    vocab: int
    hidden: int
    #: speech: the feature bins and the fixed number of frames the encoder takes (Whisper: 30 s)
    mel_bins: int | None = None
    frames: int | None = None
    #: the longest decoder sequence its position table holds (None: no limit)
    max_target_positions: int | None = None
    cache_dtype: str = "float32"

    @property
    def encoder_inputs(self) -> list[str]:
        return [INPUT_FEATURES] if self.audio else [INPUT_IDS, ATTENTION_MASK]

    @property
    def encoder_outputs(self) -> list[str]:
        return [LAST_HIDDEN_STATE, *(f"present.{i}.encoder.{k}" for i in range(self.layers) for k in ("key", "value"))]

    @property
    def past_names(self) -> list[str]:
        """The decoder's cache inputs, per layer: its own keys and values, then the cross ones."""
        return [f"past_key_values.{i}.{side}.{k}" for i in range(self.layers)
                for side in ("decoder", "encoder") for k in ("key", "value")]

    @property
    def decoder_inputs(self) -> list[str]:
        return [INPUT_IDS, *([] if self.audio else [ENCODER_ATTENTION_MASK]), *self.past_names]

    @property
    def decoder_outputs(self) -> list[str]:
        return [LOGITS, *(f"present.{i}.decoder.{k}" for i in range(self.layers) for k in ("key", "value"))]


#: Speech encoders that take a fixed number of frames, by ``model_type``: Whisper's position table
#: holds ``max_source_positions`` after two convolutions, the second of stride 2 (30 s at 100 frames/s).
FIXED_FRAMES: dict[str, Callable[[Any], int]] = {
    "whisper": lambda config: 2 * int(config.max_source_positions),
}


def load_seq2seq(model_or_folder: Any, argument: str = "source") -> torch.nn.Module:
    """A transformers encoder–decoder as given, or loaded in float32 from a ``save_pretrained``
    folder (nothing is downloaded); anything else is refused, naming what it is."""
    if isinstance(model_or_folder, (str, os.PathLike)):
        from .model import load_folder

        return load_folder(Path(model_or_folder), argument, _check_seq2seq_config, "encoder-decoder")
    if not isinstance(model_or_folder, torch.nn.Module) or getattr(model_or_folder, "config", None) is None:
        raise InvalidArgumentError(
            f"{argument} must be a transformers encoder-decoder (AutoModelForSeq2SeqLM, "
            f"AutoModelForSpeechSeq2Seq) or its save_pretrained folder, not {type(model_or_folder).__name__}."
        )
    _check_seq2seq_config(model_or_folder.config, type(model_or_folder).__name__)
    if model_or_folder.get_output_embeddings() is None:  # type: ignore[operator]  # transformers' models are untyped here
        raise InvalidArgumentError(
            f"{type(model_or_folder).__name__} has no language-model head (get_output_embeddings() is None), so it "
            f"gives no logits to generate from; load it with AutoModelForSeq2SeqLM or AutoModelForSpeechSeq2Seq."
        )
    return model_or_folder


def _check_seq2seq_config(config: Any, what: str) -> Any:
    """The Auto class that loads ``config``'s generating encoder-decoder, or a refusal that says
    what the model is and which exporter takes it."""
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )

    kind = getattr(config, "model_type", type(config).__name__)
    if type(config) in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        return AutoModelForSeq2SeqLM
    if type(config) in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING:
        if kind not in FIXED_FRAMES:
            raise InvalidArgumentError(
                f"{what} is a {kind} speech encoder-decoder; export_seq2seq exports speech models of these "
                f"families: {', '.join(sorted(FIXED_FRAMES))}."
            )
        return AutoModelForSpeechSeq2Seq
    if not getattr(config, "is_encoder_decoder", False) and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise InvalidArgumentError(
            f"{what} is a decoder-only causal LM ({kind}), not an encoder-decoder; export it with "
            f"export_decoder (onnxport llm FOLDER -o OUT)."
        )
    raise InvalidArgumentError(
        f"{what} ({kind}) is not an encoder-decoder that generates (neither AutoModelForSeq2SeqLM nor "
        f"AutoModelForSpeechSeq2Seq knows its config); export an encoder-only model with export_pretrained."
    )


def _cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes its cache by (transformers renames ``past_key_values``)."""
    own = model._own if isinstance(model, _Forwarding) else type(model).forward
    parameters = inspect.signature(own).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _pairs(cache: Any) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for layer in getattr(cache, "layers", ()):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ExportRefusedError(f"its cache layer {type(layer).__name__} keeps no key and value tensors")
        flat += [keys, values]
    return flat


def encoder_call(model: Any, source: torch.Tensor, attention_mask: torch.Tensor | None, audio: bool,
                 start_token: int) -> tuple[torch.Tensor, ...]:
    """``(last_hidden_state, *cross keys and values)`` of one source batch, by the model's own
    layers: the encoder, then one decoder run with an empty cache, which fills the cross-attention
    half of it (the rest of that run computes nothing the outputs use)."""
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    encoder = model.get_encoder()
    hidden = encoder(input_features=source).last_hidden_state if audio else \
        encoder(input_ids=source, attention_mask=attention_mask).last_hidden_state
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    start = torch.full((source.shape[0], 1), start_token, dtype=torch.int64)
    masks = {} if audio else {"attention_mask": attention_mask}
    model(encoder_outputs=BaseModelOutput(last_hidden_state=hidden), decoder_input_ids=start, use_cache=True,
          **{_cache_argument(model): cache}, **masks)
    return (hidden, *_pairs(cache.cross_attention_cache))


def decoder_call(model: Any, layers: int, hidden_size: int, input_ids: torch.Tensor,
                 encoder_attention_mask: torch.Tensor | None, past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``(logits, *present self-attention keys and values)`` of one decoder step, the cross
    keys and values given (``past``: per layer, own key, own value, cross key, cross value)."""
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    own, cross = DynamicCache(), DynamicCache()
    for i in range(layers):
        own.update(past[4 * i], past[4 * i + 1], i)
        cross.update(past[4 * i + 2], past[4 * i + 3], i)
    cache = EncoderDecoderCache(own, cross)
    for i in range(layers):
        cache.is_updated[i] = True  # the cross keys and values are given: never recomputed
    # the decoder's cross-attention reads the encoder output only to know it is there (its keys
    # and values are the cache's); a zero stand-in of the right shape is dead code in the file
    key = past[2]
    stand_in = key.new_zeros(key.shape[0], key.shape[2], hidden_size)
    masks = {} if encoder_attention_mask is None else {"attention_mask": encoder_attention_mask}
    output = model(encoder_outputs=BaseModelOutput(last_hidden_state=stand_in), decoder_input_ids=input_ids,
                   use_cache=True, **{_cache_argument(model): cache}, **masks)
    return (output.logits, *_pairs(returned_cache(output).self_attention_cache))


def start_token(model: Any) -> int:
    generation = getattr(model, "generation_config", None)
    for holder in (generation, model.config):
        value = getattr(holder, "decoder_start_token_id", None)
        if value is not None:
            return int(value)
    raise ExportRefusedError(
        f"{type(model).__name__} names no decoder_start_token_id (in its config or generation_config), so a "
        f"decoder cannot start; set one and export again."
    )


def encoder_hidden_size(model: Any) -> int:
    config = model.config
    for name in ("d_model", "hidden_size"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ExportRefusedError(f"{type(model).__name__}'s config names no d_model or hidden_size.")


def sample_source(model: Any, batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An encoder input batch: token ids with a left-padded second row, or speech features."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    kind = str(getattr(config, "model_type", ""))
    if model.main_input_name == INPUT_FEATURES:
        frames = FIXED_FRAMES[kind](config) if kind in FIXED_FRAMES else length
        features = torch.randn(batch, int(config.num_mel_bins), frames, generator=generator)
        return features.to(next(model.parameters()).dtype), None
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.int64)
    if batch > 1:
        mask[1, :2] = 0
        pad = getattr(config, "pad_token_id", None)
        ids[1, :2] = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    return ids, mask


def seq2seq_shape(model: Any) -> Seq2SeqShape:
    """The files' shape, from one run of the encoder forward (its cross keys and values give the
    decoder's layers, heads and head size as the model computes them, whatever its config calls them)."""
    audio = model.main_input_name == INPUT_FEATURES
    source, mask = sample_source(model, 1, 4)
    try:
        with torch.no_grad():
            outputs = encoder_call(model, source, mask, audio, start_token(model))
    except ExportRefusedError:
        raise
    except Exception as error:
        raise ExportRefusedError(
            f"{type(model).__name__} does not run with a cache of plain key/value tensors "
            f"({type(error).__name__}: {str(error).strip()[:200]}); its decoder cannot be exported with a cache."
        ) from error
    cross = outputs[1:]
    if not cross or any(t.dim() != 4 for t in cross):
        raise ExportRefusedError(
            f"{type(model).__name__}'s cross-attention cache is not per-layer [batch, heads, source, head_dim] "
            f"keys and values; neither flavour can express it."
        )
    config = model.config
    kind = str(getattr(config, "model_type", type(model).__name__))
    return Seq2SeqShape(
        model_type=kind,
        audio=audio,
        layers=len(cross) // 2,
        heads=int(cross[0].shape[1]),
        head_dim=int(cross[0].shape[3]),
        vocab=int(model.get_output_embeddings().weight.shape[0]),
        hidden=encoder_hidden_size(model),
        mel_bins=int(config.num_mel_bins) if audio else None,
        frames=int(source.shape[-1]) if audio else None,
        max_target_positions=getattr(config, "max_target_positions", None)
        or (getattr(config, "max_position_embeddings", None) if kind != "t5" else None),
    )


@contextlib.contextmanager
def encoder_forward(model: torch.nn.Module, shape: Seq2SeqShape, start: int) -> Iterator[torch.nn.Module]:
    """``model`` whose forward is the encoder file's (see :func:`encoder_call`) for the block."""
    from .._core.inputs import forward_replaced

    own = type(model).forward.__get__(model)
    proxy = _Forwarding(model, own)

    if shape.audio:
        def forward(input_features: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return encoder_call(proxy, input_features, None, True, start)
    else:
        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[misc]
            return encoder_call(proxy, input_ids, attention_mask, False, start)

    with forward_replaced(model, forward, shape.encoder_inputs):
        yield model


@contextlib.contextmanager
def decoder_forward(model: torch.nn.Module, shape: Seq2SeqShape) -> Iterator[torch.nn.Module]:
    """``model`` whose forward is the decoder file's (see :func:`decoder_call`) for the block."""
    from .._core.inputs import forward_replaced

    proxy = _Forwarding(model, type(model).forward.__get__(model))
    layers, hidden, audio = shape.layers, shape.hidden, shape.audio

    def forward(input_ids: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask, past = (None, rest) if audio else (rest[0], rest[1:])
        return decoder_call(proxy, layers, hidden, input_ids, mask, tuple(past))

    with forward_replaced(model, forward, [n.replace(".", "_") for n in shape.decoder_inputs]):
        yield model


class _Forwarding:
    """The model with its own forward as ``__call__`` while ``forward`` is replaced for capture."""

    def __init__(self, model: Any, own: Callable[..., Any]) -> None:
        self._model, self._own = model, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._own(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
