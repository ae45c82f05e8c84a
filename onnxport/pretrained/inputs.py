"""Example inputs, their symbolic axes and the output names for a transformers model and a task,
from the model's own config (vocabulary, type vocabulary, image size, channels, sampling rate) and
its forward's parameters: the file's inputs are named as forward names them."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.inputs import speech_feature_width
from ..errors import InvalidArgumentError
from .tasks import Task

#: The sample's sizes: two rows of text (the first one padded; a second size is one longer), one
#: image or clip (its second size is two: a batch of one and of two prove the symbolic batch at
#: half the cost of two and three, which for a large vision model is most of the export), a short
#: sequence, one second of audio.
BATCH, MEDIA_BATCH, SEQUENCE, CHOICES, TEXTS = 2, 1, 16, 2, 3
AUDIO_SECONDS = 1.0
#: one second of feature frames at the usual 10 ms hop
FEATURE_FRAMES = 100
DEFAULT_SAMPLING_RATE = 16000


@dataclass
class Signature:
    """What the file takes and gives.

    Attributes:
        names: the inputs, in the order the file takes them (forward's parameter names).
        sample: one example of each, batch first.
        axes: the symbolic axes, ``{input: {axis: label}}``.
        outputs: the outputs' names (the transformers output fields).
    """

    names: list[str]
    sample: list[torch.Tensor]
    axes: dict[str, dict[int, str]]
    outputs: list[str] = field(default_factory=list)

    def as_dict(self, sample: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.sample if sample is None else sample))


def _sub(config: Any, name: str) -> Any:
    """A composite model's text or vision config (CLIP), or the config itself."""
    return getattr(config, name, None) or config


def _accepts(model: torch.nn.Module, name: str) -> bool:
    parameters = inspect.signature(model.forward).parameters
    return name in parameters


def modality_of(model: torch.nn.Module, task: Task) -> str:
    main = getattr(model, "main_input_name", "input_ids")
    config = getattr(model, "config", None)
    if main == "input_ids" and _accepts(model, "pixel_values") and getattr(config, "text_config", None) \
            and getattr(config, "vision_config", None):
        return "text-vision"  # a text and image model's features (GroupViT), as zero-shot's inputs
    if task.modality == "vision" and main == "input_ids":
        return "text"  # images read as token ids (ImageGPT's colour clusters)
    if task.modality is not None and task.name not in ("feature-extraction", "image-feature-extraction"):
        return task.modality
    return {"pixel_values": "vision", "input_values": "audio", "input_features": "audio"}.get(main, "text")


def _ids_of(config: Any, name: str) -> list[int]:
    """The token ids a config sets under ``name`` (one, a list, or none)."""
    value = getattr(config, name, None)
    return [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int) and v >= 0]


def _token_id(config: Any, *names: str) -> int | None:
    """The first of the config's special token ids ``names`` it sets (a list's first entry)."""
    return next((ids[0] for ids in (_ids_of(config, name) for name in names) if ids), None)


def _special_ids(config: Any) -> set[int]:
    names = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
             "unk_token_id", "decoder_start_token_id")
    return {i for name in names for i in _ids_of(config, name)}


def _tokens(config: Any, mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Token ids laid out as a tokenizer lays them out, so a model that reads its special tokens
    (pooling at the last end-of-sequence token, or at the last token that is not padding) finds
    them: the start token first, the end token at each row's last unmasked position, the padding
    id where the mask is 0, and no special id among the words."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise InvalidArgumentError("The model's config gives no vocab_size, so no token ids can be made for it.")
    # ids above the special tokens most vocabularies start with; the same ids in every run
    low = min(5, vocab - 1)
    ids = torch.randint(low, vocab, tuple(mask.shape), generator=generator)
    special = _special_ids(config)
    words = [i for i in range(low, min(vocab, low + len(special) + 1)) if i not in special]
    for value in special & set(range(low, vocab)):
        if words:
            ids[ids == value] = words[0]
    start, end = _token_id(config, "cls_token_id", "bos_token_id"), _token_id(config, "sep_token_id", "eos_token_id")
    pad = _token_id(config, "pad_token_id")
    if start is not None and start < vocab:
        ids[..., 0] = start
    if end is not None and end < vocab:
        last = (mask * torch.arange(mask.shape[-1])).argmax(-1, keepdim=True)
        ids.scatter_(-1, last, end)
    if pad is not None and pad < vocab:
        ids[mask == 0] = pad
    return ids


def _sequence(config: Any) -> int:
    longest = getattr(config, "max_position_embeddings", None)
    # one longer is the second size the proofs run at; learned positions must hold it
    return max(2, min(SEQUENCE, longest - 3)) if isinstance(longest, int) and longest > 4 else SEQUENCE


def _text(model: torch.nn.Module, config: Any, shape: tuple[int, ...], generator: torch.Generator,
          batch: str, axes_of_text: dict[int, str]) -> Signature:
    mask = torch.ones(shape, dtype=torch.long)
    # the first row padded: the mask is part of what the file computes; every row's last position
    # too, so the second size (the last position repeated) adds padding, not a second end token
    mask[0, ..., -3:] = 0
    mask[..., -1] = 0
    ids = _tokens(config, mask, generator)
    names, sample = ["input_ids"], [ids]
    if _accepts(model, "attention_mask"):
        names.append("attention_mask")
        sample.append(mask)
    if _accepts(model, "token_type_ids") and getattr(config, "type_vocab_size", 0) and config.type_vocab_size > 1:
        names.append("token_type_ids")
        sample.append(torch.zeros(shape, dtype=torch.long))
    grid = getattr(config, "max_2d_position_embeddings", None)
    if _accepts(model, "bbox") and isinstance(grid, int) and grid > 1:
        names.append("bbox")  # a document model's word boxes (LayoutLM, LiLT): x0 <= x1, y0 <= y1
        sample.append(_boxes(shape, min(grid, 1001), generator))
    depth = getattr(config, "max_depth", None)
    if isinstance(depth, int) and depth > 0:
        # a markup model's XPath of each token (MarkupLM): tag and subscript ids per level
        for name, limit in (("xpath_tags_seq", "max_xpath_tag_unit_embeddings"),
                            ("xpath_subs_seq", "max_xpath_subs_unit_embeddings")):
            size = getattr(config, limit, None)
            if _accepts(model, name) and isinstance(size, int) and size > 0:
                names.append(name)
                sample.append(torch.randint(0, size, (*shape, depth), generator=generator))
    return Signature(names, sample, {name: dict(axes_of_text) for name in names})


def _boxes(shape: tuple[int, ...], grid: int, generator: torch.Generator) -> torch.Tensor:
    """Word boxes ``[..., 4]`` (x0, y0, x1, y1) on a ``grid`` of positions (transformers' document
    models take coordinates normalised to 0-1000)."""
    half = max(grid // 2, 1)
    corner = torch.randint(0, half, (*shape, 2), generator=generator)
    size = torch.randint(0, grid - half, (*shape, 2), generator=generator)
    return torch.cat([corner, corner + size], dim=-1)


def _image_size(config: Any) -> tuple[int, int, int]:
    size = getattr(config, "image_size", None)
    if isinstance(size, dict):
        size = (size.get("height"), size.get("width"))
    if isinstance(size, int):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
        size = (224, 224)  # the configs without an image_size are convolutional: any size runs
    channels = getattr(config, "num_channels", 3)
    return int(channels), int(size[0]), int(size[1])


def _pixels(config: Any, batch: int, generator: torch.Generator) -> torch.Tensor:
    channels, height, width = _image_size(config)
    return torch.randn(batch, channels, height, width, generator=generator)


def _spectrogram(model: torch.nn.Module, config: Any, generator: torch.Generator) -> Signature | None:
    """Audio models that read features rather than the waveform, at the fixed length their position
    embeddings hold: Whisper-style ``input_features`` ``[batch, mel bins, frames]`` (two frames per
    encoder position), AST-style ``input_values`` ``[batch, frames, mel bins]``; ``None`` for a
    waveform model."""
    mel = getattr(config, "num_mel_bins", None)
    if not isinstance(mel, int):
        return None
    if getattr(model, "main_input_name", None) == "input_features":
        positions = getattr(config, "max_source_positions", 1500)
        features = torch.randn(MEDIA_BATCH, mel, 2 * positions, generator=generator)
        return Signature(["input_features"], [features], {"input_features": {0: "batch"}})
    frames = getattr(config, "max_length", None)
    if isinstance(frames, int):
        return Signature(["input_values"], [torch.randn(MEDIA_BATCH, frames, mel, generator=generator)],
                         {"input_values": {0: "batch"}})
    return None


def _frame_features(model: torch.nn.Module, config: Any, generator: torch.Generator) -> Signature | None:
    """Audio models that read features of any length ``[batch, frames, features]`` (Wav2Vec2-BERT's
    stacked filter banks, Parakeet's mel bins): one second of frames, batch and frames symbolic;
    ``None`` for a waveform model."""
    if getattr(model, "main_input_name", None) != "input_features":
        return None
    width = speech_feature_width(config)
    if width is None:
        raise InvalidArgumentError(
            f"{type(model).__name__} reads input_features, but its config names neither their width "
            f"(feature_projection_input_dim, num_mel_bins); export it with export_onnx and example inputs.")
    features = torch.randn(MEDIA_BATCH, FEATURE_FRAMES, width, generator=generator)
    return Signature(["input_features"], [features], {"input_features": {0: "batch", 1: "frames"}})


def build_signature(model: torch.nn.Module, task: Task, preprocessor: Mapping[str, Any] | None = None, *,
                    image_size: tuple[int, int, int] | None = None) -> Signature:
    """The example inputs and symbolic axes of ``model`` for ``task`` (no output names yet).

    ``image_size``: (channels, height, width) of a model without a transformers config (timm),
    which then takes ``pixel_values`` alone.
    """
    generator = torch.Generator().manual_seed(0)
    if image_size is not None:
        pixels = torch.randn(MEDIA_BATCH, *image_size, generator=generator)
        return Signature(["pixel_values"], [pixels], {"pixel_values": {0: "batch"}})
    config = model.config
    modality = modality_of(model, task)
    if modality == "text":
        return _text(model, config, (BATCH, _sequence(config)), generator, "batch", {0: "batch", 1: "sequence"})
    if modality == "choices":
        return _text(model, config, (BATCH, CHOICES, _sequence(config)), generator, "batch",
                     {0: "batch", 1: "choices", 2: "sequence"})
    if modality == "vision":
        return Signature(["pixel_values"], [_pixels(_sub(config, "vision_config"), MEDIA_BATCH, generator)],
                         {"pixel_values": {0: "batch"}})
    if modality == "audio":
        spectrogram = _spectrogram(model, config, generator)
        if spectrogram is not None:
            return spectrogram
        frames = _frame_features(model, config, generator)
        if frames is not None:
            return frames
        rate = (preprocessor or {}).get("sampling_rate", DEFAULT_SAMPLING_RATE)
        samples = int(rate * AUDIO_SECONDS)
        return Signature(["input_values"], [torch.randn(MEDIA_BATCH, samples, generator=generator) * 0.1],
                         {"input_values": {0: "batch", 1: "samples"}})
    # text and images, each batch its own: one image against many labels
    text_config, vision_config = _sub(config, "text_config"), _sub(config, "vision_config")
    text = _text(model, text_config, (TEXTS, _sequence(text_config)), generator, "text_batch",
                 {0: "text_batch", 1: "sequence"})
    text.names.append("pixel_values")
    text.sample.append(_pixels(vision_config, MEDIA_BATCH, generator))
    text.axes["pixel_values"] = {0: "image_batch"}
    return text
