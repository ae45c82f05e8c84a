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

from .._core.adapters import adapter_for
from .._core.inputs import speech_feature_width
from ..errors import ExportRefusedError, InvalidArgumentError
from .model import returned_cache
from .names import (
    ATTENTION_MASK,
    ENCODER_ATTENTION_MASK,
    INPUT_FEATURES,
    INPUT_IDS,
    INPUT_VALUES,
    LAST_HIDDEN_STATE,
    LOGITS,
    split_encoded,
)


@dataclass(frozen=True)
class Seq2SeqShape:
    """What an encoder–decoder's files look like: read from one real run of the model."""

    model_type: str
    #: the encoder takes speech (``input_features`` or ``input_values``) instead of ``input_ids``
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
    #: the encoder's source input (``input_ids``, ``input_features``, ``input_values``)
    source: str = INPUT_IDS
    #: the encoder takes an ``attention_mask`` over its source (text; speech of any length)
    source_mask: bool = True
    #: one source's dimensions after the batch, ``None`` where its length is free (Whisper:
    #: ``[mel bins, frames]``; Speech2Text: ``[None, features]``; Moonshine: ``[None]`` samples)
    source_dims: tuple[int | None, ...] = (None,)

    @property
    def speech_mask(self) -> bool:
        """A speech encoder of any length: it gives the decoder the mask of its output positions,
        computed from the source's mask by its own downsampling."""
        return self.audio and self.source_mask

    @property
    def encoder_inputs(self) -> list[str]:
        return [self.source, *([ATTENTION_MASK] if self.source_mask else [])]

    @property
    def encoder_outputs(self) -> list[str]:
        return [LAST_HIDDEN_STATE, *(f"present.{i}.encoder.{k}" for i in range(self.layers) for k in ("key", "value")),
                *([ENCODER_ATTENTION_MASK] if self.speech_mask else [])]

    def cross(self, encoded: list[Any]) -> list[Any]:
        """The cross-attention keys and values among the encoder's outputs."""
        return split_encoded(encoded, self.layers, self.speech_mask, None)[0]

    def decoder_mask(self, encoded: list[Any], mask: Any) -> Any:
        """The decoder's ``encoder_attention_mask``: the source's own (text), the encoder's
        downsampled one (speech of any length), or none (Whisper)."""
        return split_encoded(encoded, self.layers, self.speech_mask, mask if self.source_mask else None)[1]

    @property
    def past_names(self) -> list[str]:
        """The decoder's cache inputs, per layer: its own keys and values, then the cross ones."""
        return [f"past_key_values.{i}.{side}.{k}" for i in range(self.layers)
                for side in ("decoder", "encoder") for k in ("key", "value")]

    @property
    def decoder_inputs(self) -> list[str]:
        return [INPUT_IDS, *([ENCODER_ATTENTION_MASK] if self.source_mask else []), *self.past_names]

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


def _cache_argument(module: torch.nn.Module) -> str:
    """The name a model's (or its decoder's) forward takes its cache by (transformers renames
    ``past_key_values``)."""
    own = module._own if isinstance(module, _Forwarding) else type(module).forward
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
    half of it (the rest of that run computes nothing the outputs use). A speech encoder given a
    mask adds the mask of its output positions (see :func:`speech_output_mask`)."""
    from transformers import DynamicCache, EncoderDecoderCache
    from transformers.modeling_outputs import BaseModelOutput

    encoder = model.get_encoder()
    if audio:
        encoded = encoder(source) if attention_mask is None else encoder(source, attention_mask=attention_mask)
    else:
        encoded = encoder(input_ids=source, attention_mask=attention_mask)
    hidden = encoded.last_hidden_state
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    start = torch.full((source.shape[0], 1), start_token, dtype=torch.int64)
    masks = {} if audio else {"attention_mask": attention_mask}
    # the encoder's own output object: a family may read more than the hidden states from it
    # (Moonshine its downsampled mask); the cross keys and values read the hidden states alone
    given = encoded if audio else BaseModelOutput(last_hidden_state=hidden)
    model(encoder_outputs=given, decoder_input_ids=start, use_cache=True, **{_cache_argument(model): cache}, **masks)
    cross = _pairs(cache.cross_attention_cache)
    if audio and attention_mask is not None:
        return (hidden, *cross, speech_output_mask(model, encoded, attention_mask))
    return (hidden, *cross)


def speech_output_mask(model: Any, encoded: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """Which of a speech encoder's output positions hold audio, from the mask of its input frames
    or samples, as the model's own forward computes it for its decoder: the mask its encoder
    returns (Moonshine), or its ``_get_feature_vector_attention_mask`` (Speech2Text); int64."""
    given = getattr(encoded, "attention_mask", None)
    if isinstance(given, torch.Tensor):
        return given.to(torch.int64)
    length = encoded.last_hidden_state.shape[1]
    # where the family keeps it: on the model (Speech2Text), its encoder (a SpeechEncoderDecoder's
    # Wav2Vec2) or a module of the encoder (SpeechT5's prenet)
    for holder in (model, getattr(model, "model", None), *model.get_encoder().modules()):
        downsample = getattr(holder, "_get_feature_vector_attention_mask", None)
        if callable(downsample):
            return downsample(length, attention_mask).to(torch.int64)
    raise ExportRefusedError(
        f"{type(model).__name__}'s encoder takes an attention_mask but gives no mask of its output positions "
        f"(neither an attention_mask in its output nor a _get_feature_vector_attention_mask), so its decoder "
        f"cannot be told which of them are padding."
    )


def decoder_call(model: Any, layers: int, hidden_size: int, input_ids: torch.Tensor,
                 encoder_attention_mask: torch.Tensor | None, past: tuple[torch.Tensor, ...],
                 *, speech_mask: bool = False) -> tuple[torch.Tensor, ...]:
    """``(logits, *present self-attention keys and values)`` of one decoder step, the cross
    keys and values given (``past``: per layer, own key, own value, cross key, cross value).

    A speech model of any length (``speech_mask``) runs its decoder and head directly: its own
    forward would compute the decoder's mask again from the input frames' mask, which the
    decoder file does not take; :func:`check_split` proves the two paths agree."""
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
    if speech_mask:
        decoder = model.get_decoder()
        # the ids positionally: a decoder may call them otherwise (SpeechT5's text decoder: input_values)
        output = decoder(input_ids, encoder_hidden_states=stand_in, encoder_attention_mask=encoder_attention_mask,
                         use_cache=True, **{_cache_argument(decoder): cache})
        # a decoder that is a causal LM of its own (a SpeechEncoderDecoder's) gives logits itself
        logits = output.logits if getattr(output, "logits", None) is not None else \
            model.get_output_embeddings()(output.last_hidden_state)
        return (logits, *_pairs(returned_cache(output).self_attention_cache))
    masks = {} if encoder_attention_mask is None else {"attention_mask": encoder_attention_mask}
    output = model(encoder_outputs=BaseModelOutput(last_hidden_state=stand_in), decoder_input_ids=input_ids,
                   use_cache=True, **{_cache_argument(model): cache}, **masks)
    return (output.logits, *_pairs(returned_cache(output).self_attention_cache))


def check_split(model: Any, shape: Seq2SeqShape, start: int) -> None:
    """Refuse a model whose encoder and decoder forwards (:func:`encoder_call`,
    :func:`decoder_call`) do not compute its own forward's logits: on a padded batch of two
    sources, two decoder tokens at once, within float32 rounding."""
    from ..compare import relative_distance

    source, mask = sample_source(model, 2, 6, seed=3)
    ids = torch.full((2, 2), start, dtype=torch.int64)
    ids[:, 1] = torch.arange(2) + 3
    with torch.no_grad():
        masks = {} if mask is None else {"attention_mask": mask}
        whole = model(source, decoder_input_ids=ids, use_cache=False, **masks).logits
        encoded = list(encoder_call(model, source, mask, shape.audio, start))
        cross = shape.cross(encoded)
        empty = [cross[0].new_zeros(2, shape.heads, 0, shape.head_dim)] * 2
        past = tuple(t for i in range(shape.layers) for t in (*empty, *cross[2 * i:2 * i + 2]))
        split = decoder_call(model, shape.layers, shape.hidden, ids, shape.decoder_mask(encoded, mask), past,
                             speech_mask=shape.speech_mask)[0]
    distance = relative_distance(split.double().numpy(), whole.double().numpy())
    if not distance <= SPLIT_TOLERANCE:
        raise ExportRefusedError(
            f"{type(model).__name__}'s encoder and decoder, run apart as the two files run them, do not compute what "
            f"its own forward computes (relative distance {distance:.3g} over {SPLIT_TOLERANCE:g}), so its files "
            f"could not generate what it generates."
        )


#: :func:`check_split`'s bound: float32 rounding of the same arithmetic in another order.
SPLIT_TOLERANCE = 1e-4


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


#: A speech source's length per unit of ``sample_source``'s ``length``: 10 ms frames (100 per
#: second) or 100 ms of samples, so that a few units reach past every speech encoder's downsampling.
FRAMES_PER_UNIT = 10
SECONDS_PER_UNIT = 0.1
DEFAULT_SAMPLING_RATE = 16000


def _feature_width(config: Any) -> int:
    width = speech_feature_width(config)
    if width is None:
        raise ExportRefusedError(
            f"{type(config).__name__} names neither how many features its encoder reads per frame "
            f"(input_feat_per_channel, num_mel_bins, feature_size) nor a fixed number of frames."
        )
    return width


def source_input(model: Any) -> str:
    """What the encoder reads: ``input_ids``, ``input_features`` or ``input_values`` (its own
    ``main_input_name``: a composite model's may name neither, SpeechEncoderDecoder's ``inputs``)."""
    encoder = model.get_encoder()
    return str(getattr(encoder, "main_input_name", None) or model.main_input_name)


def speech_source_dims(model: Any) -> tuple[int | None, ...]:
    """One speech source's dimensions after the batch, ``None`` where the length is free: Whisper's
    ``[mel bins, fixed frames]``, log-mel frames of any length ``[None, features]``, a waveform ``[None]``."""
    config = model.config
    kind = str(getattr(config, "model_type", ""))
    if source_input(model) == INPUT_VALUES:
        return (None,)
    if kind in FIXED_FRAMES:
        return (int(config.num_mel_bins), FIXED_FRAMES[kind](config))
    return (None, _feature_width(config))


def sample_source(model: Any, batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An encoder input batch: token ids with a left-padded second row, or speech (a speech
    encoder of any length: ``length`` tenths of a second, the second row's last quarter padding
    as its feature extractor pads it, zeros its mask marks)."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if source_input(model) in (INPUT_FEATURES, INPUT_VALUES):
        dims = speech_source_dims(model)
        dtype = next(model.parameters()).dtype
        if None not in dims:
            return torch.randn(batch, *dims, generator=generator).to(dtype), None
        rate = getattr(config, "sampling_rate", None) or DEFAULT_SAMPLING_RATE
        steps = int(length * SECONDS_PER_UNIT * rate) if dims == (None,) else length * FRAMES_PER_UNIT
        scale = 0.1 if dims == (None,) else 1.0  # a waveform's amplitude, unit-variance features
        speech = torch.randn(batch, steps, *dims[1:], generator=generator) * scale
        mask = torch.ones(batch, steps, dtype=torch.int64)
        if batch > 1:
            mask[1, steps - steps // 4:] = 0
            speech[1, steps - steps // 4:] = 0
        return speech.to(dtype), mask
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
    source_name = source_input(model)
    audio = source_name in (INPUT_FEATURES, INPUT_VALUES)
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
    cross = outputs[1:-1] if audio and mask is not None else outputs[1:]
    if not cross or any(t.dim() != 4 for t in cross):
        raise ExportRefusedError(
            f"{type(model).__name__}'s cross-attention cache is not per-layer [batch, heads, source, head_dim] "
            f"keys and values; neither flavour can express it."
        )
    config = model.config
    kind = str(getattr(config, "model_type", type(model).__name__))
    dims = speech_source_dims(model) if audio else (None,)
    fixed = audio and None not in dims
    return Seq2SeqShape(
        model_type=kind,
        audio=audio,
        layers=len(cross) // 2,
        heads=int(cross[0].shape[1]),
        head_dim=int(cross[0].shape[3]),
        vocab=int(model.get_output_embeddings().weight.shape[0]),
        hidden=int(outputs[0].shape[-1]),  # the encoder's output width, whatever its config calls it
        mel_bins=dims[0] if fixed else dims[1] if audio and len(dims) > 1 else None,
        frames=dims[1] if fixed else None,
        max_target_positions=getattr(config, "max_target_positions", None)
        or (getattr(config, "max_position_embeddings", None) if kind != "t5" else None),
        source=source_name if audio else INPUT_IDS,
        source_mask=mask is not None,
        source_dims=dims,
    )


@contextlib.contextmanager
def encoder_forward(model: torch.nn.Module, shape: Seq2SeqShape, start: int) -> Iterator[torch.nn.Module]:
    """``model`` whose forward is the encoder file's (see :func:`encoder_call`) for the block."""
    from .._core.inputs import forward_replaced

    own = type(model).forward.__get__(model)
    proxy = _Forwarding(model, own)

    if shape.audio and not shape.source_mask:
        def forward(input_features: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return encoder_call(proxy, input_features, None, True, start)
    else:
        # the source's name is the file's (forward_replaced names the inputs), not this parameter's
        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[misc]
            return encoder_call(proxy, input_ids, attention_mask, shape.audio, start)

    with forward_replaced(model, forward, shape.encoder_inputs), adapter_for(shape.model_type).capturing(model):
        yield model


@contextlib.contextmanager
def decoder_forward(model: torch.nn.Module, shape: Seq2SeqShape) -> Iterator[torch.nn.Module]:
    """``model`` whose forward is the decoder file's (see :func:`decoder_call`) for the block."""
    from .._core.inputs import forward_replaced

    proxy = _Forwarding(model, type(model).forward.__get__(model))
    layers, hidden, masked, speech_mask = shape.layers, shape.hidden, shape.source_mask, shape.speech_mask

    def forward(input_ids: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask, past = (rest[0], rest[1:]) if masked else (None, rest)
        return decoder_call(proxy, layers, hidden, input_ids, mask, tuple(past), speech_mask=speech_mask)

    with forward_replaced(model, forward, [n.replace(".", "_") for n in shape.decoder_inputs]), \
            adapter_for(shape.model_type).capturing(model):
        yield model


class _Forwarding:
    """The model with its own forward as ``__call__`` while ``forward`` is replaced for capture."""

    def __init__(self, model: Any, own: Callable[..., Any]) -> None:
        self._model, self._own = model, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._own(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
