"""Calibration data from what users have: a text file (one sample a line, tokenized with the
folder's tokenizer), a folder of images (the folder's image processor), a folder of .wav/.flac
files (the folder's feature extractor, with ``soundfile``), a ``.npz`` (one array per input), or
in Python a list of dicts of arrays. Every source gives batches of keyword inputs named as the
file's inputs."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DependencyError, InvalidArgumentError
from .inputs import Signature

BATCH = 8
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
AUDIO_SUFFIXES = (".wav", ".flac")
#: a calibration file read as text, one sample a line (tokenized with the folder's tokenizer)
TEXT_SUFFIXES = (".txt", ".text", "")
#: A folder holds a tokenizer when it has one of these (a vocabulary, a merges table or a whole tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


def _batches(columns: Mapping[str, torch.Tensor], samples: int) -> list[dict[str, torch.Tensor]]:
    total = min(samples, min(len(v) for v in columns.values()))
    return [{k: v[i:i + BATCH] for k, v in columns.items()} for i in range(0, total, BATCH)]


def _checked(columns: Mapping[str, Any], signature: Signature, where: str) -> dict[str, torch.Tensor]:
    missing = [n for n in signature.names if n not in columns]
    if missing:
        raise InvalidArgumentError(f"{where} has no {missing} (the file's inputs are {signature.names}).")
    out = {}
    for name, example in zip(signature.names, signature.sample):
        value = torch.as_tensor(np.asarray(columns[name]))
        if value.dim() != example.dim() or value.is_floating_point() != example.is_floating_point():
            raise InvalidArgumentError(
                f"{where}: '{name}' is {tuple(value.shape)} {value.dtype}, but the file takes {example.dim()}-D "
                f"{example.dtype} (like {tuple(example.shape)})."
            )
        fixed = [axis for axis in range(example.dim()) if axis not in signature.axes.get(name, {})
                 and value.shape[axis] != example.shape[axis]]
        if fixed:
            raise InvalidArgumentError(
                f"{where}: '{name}' is {tuple(value.shape)}, but the file fixes axis {fixed[0]} at "
                f"{example.shape[fixed[0]]} (like {tuple(example.shape)}); give samples of that size."
            )
        out[name] = value.to(example.dtype)
    return out


def _tokenizer(folder: Path | None, what: str) -> Any:
    if folder is None:
        raise InvalidArgumentError(f"{what} needs the folder's tokenizer, and this model came from no folder; "
                                   f"give calibration as a .npz or a list of dicts.")
    # transformers builds a tokenizer of special tokens alone for a folder without one, which would
    # calibrate on [UNK]s: a vocabulary file must be there
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidArgumentError(
            f"{what} is text, which needs a tokenizer, and '{folder}' holds none ({', '.join(TOKENIZER_FILES)}); save "
            f"the tokenizer into the folder (tokenizer.save_pretrained) or give calibration as a .npz."
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, TypeError alike
        raise InvalidArgumentError(
            f"{what} is text, which needs a tokenizer, and '{folder}' has none transformers can load "
            f"({type(error).__name__}); save the tokenizer into the folder (tokenizer.save_pretrained) or give "
            f"calibration as a .npz."
        ) from error


def _text_file(path: Path, signature: Signature, folder: Path | None, samples: int, length: int | None) -> list:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        raise InvalidArgumentError(f"calibration '{path}' holds no text; give one sample a line.")
    tokenizer = _tokenizer(folder, f"calibration '{path}'")
    width = length or signature.sample[0].shape[-1]
    longest = getattr(tokenizer, "model_max_length", None)
    # transformers gives a tokenizer without a limit a sentinel of about 1e30
    if length is not None and isinstance(longest, int) and longest < 10**9 and length > longest:
        raise InvalidArgumentError(
            f"calibration_length={length} is longer than the {longest} tokens the folder's tokenizer allows "
            f"(model_max_length: the model's positions); give at most {longest}."
        )
    encoded = tokenizer(lines[:samples], padding="max_length", truncation=True, max_length=width, return_tensors="pt")
    columns = {name: encoded[name] for name in signature.names if name in encoded}
    if "token_type_ids" in signature.names and "token_type_ids" not in columns:
        columns["token_type_ids"] = torch.zeros_like(encoded["input_ids"])
    return _batches(_checked(columns, signature, f"calibration '{path}' (tokenized)"), samples)


def _image_folder(path: Path, signature: Signature, folder: Path | None, samples: int,
                  preprocess: Callable[[list[Any]], torch.Tensor] | None = None) -> list:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:samples]
    if not files:
        raise InvalidArgumentError(f"calibration folder '{path}' holds no images ({', '.join(IMAGE_SUFFIXES)}).")
    if signature.names != ["pixel_values"]:
        raise InvalidArgumentError(f"calibration folder '{path}' holds images, but the file takes {signature.names}.")
    if preprocess is None:
        if folder is None or not (folder / "preprocessor_config.json").is_file():
            raise InvalidArgumentError("calibration images need the folder's preprocessor_config.json to be resized "
                                       "and normalised as the model expects; give calibration as a .npz.")
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)

        def preprocess(images: list[Any]) -> torch.Tensor:
            return processor(images=images, return_tensors="pt")["pixel_values"]

    from PIL import Image

    pixels = preprocess([Image.open(f).convert("RGB") for f in files])
    return _batches(_checked({"pixel_values": pixels}, signature, f"calibration folder '{path}'"), samples)


def _audio_folder(path: Path, signature: Signature, folder: Path | None, samples: int) -> list:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in AUDIO_SUFFIXES)[:samples]
    try:
        import soundfile
    except ImportError as error:
        raise DependencyError(f"calibration folder '{path}' holds audio, which needs soundfile (pip install "
                              f"soundfile).") from error
    if folder is None:
        raise InvalidArgumentError("calibration audio needs the folder's feature extractor; give a .npz.")
    from transformers import AutoFeatureExtractor

    extractor = AutoFeatureExtractor.from_pretrained(folder, local_files_only=True)
    waves = [soundfile.read(str(f), dtype="float32")[0] for f in files]
    waves = [w if w.ndim == 1 else w.mean(1) for w in waves]  # channels averaged to mono
    name = signature.names[0]
    if signature.sample[0].dim() == 2:  # a waveform: padded or cut to the sample's width
        values = extractor(waves, sampling_rate=extractor.sampling_rate, padding="max_length",
                           max_length=signature.sample[0].shape[-1], truncation=True, return_tensors="pt")[name]
    else:  # features at the extractor's own fixed length (AST's frames, Whisper's 30 seconds)
        values = extractor(waves, sampling_rate=extractor.sampling_rate, return_tensors="pt")[name]
    return _batches(_checked({name: values}, signature, f"calibration folder '{path}'"), samples)


def calibration_batches(calibration: Any, signature: Signature, folder: Path | None, *, samples: int,
                        length: int | None = None,
                        preprocess: Callable[[list[Any]], torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """Batches of keyword inputs for the Quantizer from any supported ``calibration`` source
    (``preprocess``: the source's own image transform, where it has no preprocessor_config.json)."""
    if isinstance(calibration, (str, os.PathLike)):
        path = Path(calibration)
        if not path.exists():
            raise InvalidArgumentError(f"calibration '{path}' does not exist.")
        if path.is_dir():
            suffixes = {p.suffix.lower() for p in path.iterdir()}
            if suffixes & set(AUDIO_SUFFIXES):
                return _audio_folder(path, signature, folder, samples)
            return _image_folder(path, signature, folder, samples, preprocess)
        if path.suffix == ".npz":
            try:
                with np.load(path) as data:
                    columns = {k: data[k] for k in data.files}
            except (OSError, ValueError) as error:
                raise InvalidArgumentError(f"calibration '{path}' is not a readable .npz ({error}).") from error
            return _batches(_checked(columns, signature, f"calibration '{path}'"), samples)
        if path.suffix in TEXT_SUFFIXES:
            return _text_file(path, signature, folder, samples, length)
        raise InvalidArgumentError(
            f"calibration '{path}' is a {path.suffix} file; give a text file (.txt, one sample a line), a .npz, "
            f"or a folder of images or .wav/.flac files."
        )
    if isinstance(calibration, Iterable) and not isinstance(calibration, (bytes, Mapping)):
        rows = list(calibration)
        if not rows or not all(isinstance(r, Mapping) for r in rows):
            raise InvalidArgumentError("calibration given in Python must be a non-empty list of dicts of arrays, "
                                       "one dict a batch, keyed by the file's input names.")
        return [_checked(r, signature, f"calibration batch {i}") for i, r in enumerate(rows)][:max(1, samples)]
    raise InvalidArgumentError(
        f"calibration must be a path (text file, .npz, folder of images or audio) or a list of dicts, not "
        f"{type(calibration).__name__}."
    )
