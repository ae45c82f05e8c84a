"""``generate`` for an ``export_seq2seq`` folder: the encoder file once per source, then the
decoder file one token at a time with its cache, the tokens searched as the model's
``generation_config.json`` asks (see :mod:`onnxport.llm.search`). Needs ONNX Runtime and NumPy
only: transformers is not imported."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .names import (
    DECODER_FILE,
    ENCODER_ATTENTION_MASK,
    ENCODER_FILE,
    INPUT_FEATURES,
    INPUT_IDS,
    INPUT_VALUES,
    split_encoded,
)
from .names import SEQ2SEQ_METADATA_KEY as METADATA_KEY
from .search import DecoderStep, Settings, interleave, search

#: ``encode(source, attention_mask) -> [last_hidden_state, *cross keys and values]``
Encode = Callable[[np.ndarray, "np.ndarray | None"], list[np.ndarray]]


def ort_encoder(session: Any) -> Encode:
    """The encode function of an encoder file's session."""
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    # an fp16 speech encoder takes its features in float16
    features = np.float16 if session.get_inputs()[0].type == "tensor(float16)" else np.float32

    def encode(source: np.ndarray, mask: np.ndarray | None) -> list[np.ndarray]:
        feeds = {names[0]: source.astype(features, copy=False) if np.issubdtype(source.dtype, np.floating) else source}
        if len(names) > 1:
            feeds[names[1]] = mask if mask is not None else np.ones(source.shape[:2], np.int64)
        return list(session.run(outputs, feeds))

    return encode


def ort_decoder(session: Any) -> DecoderStep:
    """The step function of a decoder file's session."""
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    masked = ENCODER_ATTENTION_MASK in names
    past_names = names[2:] if masked else names[1:]

    def step(ids: np.ndarray, mask: np.ndarray | None, own: list[np.ndarray],
             cross: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {INPUT_IDS: ids, **dict(zip(past_names, interleave(own, cross)))}
        if masked:
            feeds[ENCODER_ATTENTION_MASK] = mask
        result = session.run(outputs, feeds)
        return result[0], list(result[1:])

    return step


def _check_folder(folder: Path) -> None:
    for name in (ENCODER_FILE, DECODER_FILE):
        if not (folder / name).is_file():
            raise InvalidArgumentError(
                f"'{folder}' has no {name}, so it is not a folder export_seq2seq wrote; export the model with "
                f"export_seq2seq (onnxport export FOLDER --task text2text-generation) first."
            )


def _session(path: Path, session_options: Any) -> Any:
    """An ONNX Runtime session on one of the folder's files; a data file it reads that is missing
    or cut short (the decoder reads a shared table from the encoder's) is named."""
    from .._core.io import check_external_data
    from ..runtime import make_session

    try:
        return make_session(path, session_options=session_options)
    except Exception:
        import onnx

        check_external_data(onnx.load(str(path), load_external_data=False), path.parent)
        raise


def _configs(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(generation_config.json, config.json) of an output folder ({} where absent)."""
    configs = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        try:
            configs.append(json.loads(path.read_text()) if path.is_file() else {})
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(f"{path} cannot be read as JSON: {error}") from error
    return configs[0], configs[1]


def _ids(values: Any, argument: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] == 0 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgumentError(
            f"{argument} must be a non-empty [batch, length] array of integer ids, not {array.dtype} shaped {list(array.shape)}."
        )
    return array.astype(np.int64)


def _language_token(language: str, generation: dict[str, Any]) -> int:
    table: dict[str, int] = generation.get("lang_to_id") or {}
    for key in (language, f"<|{language}|>"):
        if key in table:
            return int(table[key])
    names = {v.lower(): k for k, v in _WHISPER_LANGUAGES.items()}
    code = names.get(language.lower())
    if code is not None and f"<|{code}|>" in table:
        return int(table[f"<|{code}|>"])
    raise InvalidArgumentError(
        f"language={language!r} is not one the model knows; give one of: "
        f"{', '.join(sorted(k.strip('<|>') for k in table)) or '(the model lists none)'}."
    )


#: The few language names Whisper users type most, to their codes (the model's table has codes).
_WHISPER_LANGUAGES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
                      "pt": "portuguese", "nl": "dutch", "ru": "russian", "zh": "chinese", "ja": "japanese",
                      "ko": "korean", "ar": "arabic", "hi": "hindi", "pl": "polish", "tr": "turkish",
                      "uk": "ukrainian", "sv": "swedish"}


def speech_prompt(generation: dict[str, Any], batch: int, language: str | None, task: str | None,
                  return_timestamps: bool, detect: Callable[[np.ndarray, list[int]], np.ndarray]) -> np.ndarray:
    """Whisper's decoder prompt: start of transcript, then (multilingual models) the language —
    detected from the audio when not given, as transformers does — and the task, then no-timestamps
    unless timestamps are asked for."""
    start = int(generation["decoder_start_token_id"])
    multilingual = bool(generation.get("is_multilingual")) and bool(generation.get("lang_to_id"))
    if not multilingual and (language is not None or task is not None):
        raise InvalidArgumentError(
            "This Whisper model is English-only (its generation config is not multilingual), so it takes no "
            "language or task; leave them out."
        )
    columns: list[np.ndarray] = [np.full(batch, start, np.int64)]
    if multilingual:
        if language is not None:
            columns.append(np.full(batch, _language_token(language, generation), np.int64))
        else:
            columns.append(detect(np.stack(columns, 1), sorted(int(v) for v in generation["lang_to_id"].values())))
        tasks: dict[str, int] = generation.get("task_to_id") or {}
        chosen = task or "transcribe"
        if chosen not in tasks:
            raise InvalidArgumentError(f"task={chosen!r} is not one the model knows; give one of: {', '.join(sorted(tasks))}.")
        columns.append(np.full(batch, int(tasks[chosen]), np.int64))
    no_timestamps = generation.get("no_timestamps_token_id")
    if return_timestamps and no_timestamps is None:
        raise InvalidArgumentError(
            "return_timestamps=True needs the model's no_timestamps_token_id (its generation config names none)."
        )
    if no_timestamps is not None and not return_timestamps:
        columns.append(np.full(batch, int(no_timestamps), np.int64))
    return np.stack(columns, 1)


class Seq2SeqGenerator:
    """An :func:`export_seq2seq` folder loaded once for generating many times: its two ONNX Runtime
    sessions, the exporter's record and the generation config (as Optimum's ``ORTModelForSeq2SeqLM``
    holds its sessions). ``generate(folder, ...)`` builds one per call; hold one to skip that.

    Args:
        folder: the folder export_seq2seq wrote.
        session_options: ``onnxruntime.SessionOptions`` for both sessions (default: ORT's).
    """

    def __init__(self, folder: str | os.PathLike, session_options: Any = None) -> None:
        self.folder = Path(os.fspath(folder))
        _check_folder(self.folder)
        self.generation, self.config = _configs(self.folder)
        self.encoder = _session(self.folder / ENCODER_FILE, session_options)
        self.decoder = _session(self.folder / DECODER_FILE, session_options)
        meta = self.decoder.get_modelmeta().custom_metadata_map
        if METADATA_KEY not in meta:
            raise InvalidArgumentError(
                f"{self.folder / DECODER_FILE} carries no '{METADATA_KEY}' record, so it is not a decoder "
                f"export_seq2seq wrote; export the model again with export_seq2seq."
            )
        self.info: dict[str, Any] = json.loads(meta[METADATA_KEY])
        audio = bool(self.info["audio"])
        # a folder written before speech of any length records neither (Whisper's or text's)
        self.info.setdefault("source", INPUT_FEATURES if audio else INPUT_IDS)
        self.info.setdefault("source_mask", not audio)
        if not self.info.get("source_dims"):
            self.info["source_dims"] = [self.info["mel_bins"], self.info["frames"]] if audio else [None]
        self._encode = ort_encoder(self.encoder)
        self._step = ort_decoder(self.decoder)

    def generate(
        self,
        input_ids: Any = None,
        attention_mask: Any = None,
        *,
        input_features: Any = None,
        input_values: Any = None,
        max_new_tokens: int | None = None,
        num_beams: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        length_penalty: float | None = None,
        early_stopping: bool | str | None = None,
        num_return_sequences: int | None = None,
        language: str | None = None,
        task: str | None = None,
        return_timestamps: bool | None = None,
    ) -> np.ndarray:
        """The decoder's tokens for a source batch (see :func:`onnxport.llm.generate`)."""
        info, generation, config = self.info, self.generation, self.config
        whisper = info["model_type"] == "whisper"
        if not whisper and (language is not None or task is not None or return_timestamps):
            raise InvalidArgumentError(
                f"language, task and return_timestamps are Whisper's (its prompt of language and task tokens); this "
                f"{info['model_type']} folder takes none of them: leave them out."
            )
        source, mask = self._source(input_ids, attention_mask, input_features, input_values)
        settings = Settings.from_config(
            generation, config, max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=do_sample,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, length_penalty=length_penalty,
            early_stopping=early_stopping, num_return_sequences=num_return_sequences,
        )
        if whisper:
            return self._transcribe(source, mask, settings, language, task, return_timestamps)
        # the decoder reads which encoder positions hold the source: the source's own mask, or
        # the mask a speech encoder of any length computes for its output positions
        cross, mask = split_encoded(self._encode(source, mask), int(info["layers"]),
                                    bool(info["audio"] and info["source_mask"]), mask)
        prompt = np.full((len(source), 1), settings.decoder_start_token_id, np.int64)
        self._check_limit(prompt.shape[1], settings)
        return search(self._step, cross, mask, prompt, settings)

    def _check_limit(self, prompt_length: int, settings: Settings) -> None:
        limit = self.info.get("max_target_positions")
        if limit and settings.limit(prompt_length) > limit:
            raise InvalidArgumentError(
                f"The decoder prompt ({prompt_length} tokens) plus max_new_tokens is longer than the decoder's {limit} "
                f"positions; ask for at most {limit - prompt_length} new tokens."
            )

    def _transcribe(self, features: np.ndarray, mask: np.ndarray | None, settings: Settings, language: str | None,
                    task: str | None, return_timestamps: bool | None) -> np.ndarray:
        """Whisper as transformers' ``WhisperForConditionalGeneration.generate`` runs it: the
        encoder's window of frames at a time (the last one zero-padded), each window decoded from
        the same prompt, and with timestamps the next window starting where the model's last
        complete segment ended (a window whose tokens end in a lone timestamp, or hold no pair of
        them, was spoken to its end). Without timestamps, one window."""
        info, generation, config = self.info, self.generation, self.config
        window, batch, total = int(info["frames"]), len(features), features.shape[2]
        seconds = window * _SECONDS_PER_FRAME
        long_form = total > window
        if return_timestamps is None:
            return_timestamps = bool(generation.get("return_timestamps")) or long_form
        elif long_form and not return_timestamps:
            raise InvalidArgumentError(
                f"input_features holds {total} frames, more than the encoder's window of {window} ({seconds:g} s): such "
                f"audio is decoded a window at a time, each starting where the model's timestamps say the last one's "
                f"speech ended, so it needs return_timestamps=True (or leave return_timestamps out)."
            )
        if long_form and batch > 1 and mask is None:
            raise InvalidArgumentError(
                f"input_features holds {batch} rows of more than the encoder's {window} frames: give attention_mask "
                f"(the feature extractor's return_attention_mask=True, with padding='longest' and truncation=False) "
                f"so that each row's own length is decoded."
            )
        if return_timestamps and settings.num_return_sequences > 1:
            raise InvalidArgumentError(
                "num_return_sequences above 1 goes with one window of audio and no timestamps; with timestamps (or "
                "audio longer than the encoder's window) each row gives one sequence: leave num_return_sequences out."
            )
        # transformers counts a row's frames from its mask only for batches of long audio
        frames = mask.sum(-1).astype(np.int64) if long_form and batch > 1 and mask is not None else np.full(batch, total)
        first = self._encode_windows(features, np.zeros(batch, np.int64), np.minimum(frames, window), window,
                                     range(batch), whole=True)

        def detect(prompt: np.ndarray, languages: list[int]) -> np.ndarray:
            from .search import _empty_past

            logits, _ = self._step(prompt, None, _empty_past(first, batch), first)
            return np.asarray(languages, np.int64)[logits[:, -1][:, languages].argmax(-1)]

        prompt = speech_prompt({**config, **generation}, batch, language, task, return_timestamps, detect)
        settings.timestamps = return_timestamps
        self._check_limit(prompt.shape[1], settings)
        positions = int(info.get("max_target_positions") or settings.max_length + prompt.shape[1])
        if not return_timestamps:
            # one window, its frames past the audio zero
            return search(self._step, first, None, prompt,
                          dataclasses.replace(settings, max_length=min(settings.max_length + prompt.shape[1], positions)))
        return self._seek(features, frames, window, prompt, settings, positions, first)

    def _seek(self, features: np.ndarray, frames: np.ndarray, window: int, prompt: np.ndarray, settings: Settings,
              positions: int, first: list[np.ndarray]) -> np.ndarray:
        """Windows with timestamps, row by row until every row's frames are decoded; the rows'
        prompts, then the tokens of every segment kept, then the end token where the last window
        ended with it."""
        from tqdm.auto import tqdm

        batch, length = len(features), prompt.shape[1]
        first_stamp = int(settings.no_timestamps_token_id) + 1
        seek = np.zeros(batch, np.int64)
        kept: list[list[int]] = [[] for _ in range(batch)]
        ended = [False] * batch
        max_length, decoded = settings.max_length, 0
        with tqdm(total=int(frames.sum()), desc="generate (Whisper, window by window)", unit="frame", leave=False,
                  disable=None) as bar:
            while (active := [i for i in range(batch) if seek[i] < frames[i]]):
                spans = np.minimum(frames - seek, window)
                if decoded == 0 and len(active) == batch and (spans == window).all():
                    cross = first  # the first window, whole in every row: encoded already
                else:
                    cross = self._encode_windows(features, seek, spans, window, active)
                stride = window // cross[0].shape[2]
                # transformers lengthens max_length by the prompt at every window (up to the positions)
                max_length = min(max_length + length, positions)
                tokens = search(self._step, cross, None, prompt[active], dataclasses.replace(
                    settings, max_length=max_length,
                    seed=None if settings.seed is None else settings.seed + decoded))
                decoded += 1
                for row, i in zip(tokens, active):
                    text, ended[i] = _window_text(row[length:].tolist(), settings)
                    segment, advance = _segments(text, first_stamp, int(spans[i]), stride)
                    kept[i] += segment
                    seek[i] += advance
                bar.update(int(np.minimum(seek, frames).sum()) - bar.n)
        rows = [np.concatenate([prompt[i], kept[i], settings.eos_token_id[:1] if ended[i] else []]).astype(np.int64)
                for i in range(batch)]
        out = np.full((batch, max(map(len, rows))), settings.fill, np.int64)
        for i, row in enumerate(rows):
            out[i, :len(row)] = row
        return out

    def _encode_windows(self, features: np.ndarray, seek: np.ndarray, spans: np.ndarray, window: int, rows: Any,
                        whole: bool = False) -> list[np.ndarray]:
        """The cross-attention keys and values of each row's window of frames from ``seek``, the
        frames past its span zero (as transformers pads the last window); ``whole``: the first
        window as given (transformers detects the language from it, padding included)."""
        rows = list(rows)
        windows = np.zeros((len(rows), features.shape[1], window), np.float32)
        for k, i in enumerate(rows):
            end = window if whole else int(spans[i])
            part = features[i, :, int(seek[i]):int(seek[i]) + end]
            windows[k, :, :part.shape[1]] = part
        cross, _ = split_encoded(self._encode(windows, None), int(self.info["layers"]), False, None)
        return cross

    def _source(self, input_ids: Any, attention_mask: Any, input_features: Any,
                input_values: Any) -> tuple[np.ndarray, np.ndarray | None]:
        info = self.info
        if info["audio"]:
            return self._speech(input_ids, attention_mask, input_features, input_values)
        if input_ids is None or input_features is not None or input_values is not None:
            raise InvalidArgumentError(
                f"This {info['model_type']} folder takes text: give input_ids (and attention_mask for padded rows), "
                f"not {'input_features' if input_features is not None else 'input_values'}."
            )
        ids = _ids(input_ids, "input_ids")
        mask = np.ones_like(ids) if attention_mask is None else _ids(attention_mask, "attention_mask")
        if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
            raise InvalidArgumentError(
                f"attention_mask must be 0/1 and shaped like input_ids {list(ids.shape)}, not {list(mask.shape)}."
            )
        if ids.min() < 0 or ids.max() >= info["vocab"]:
            raise InvalidArgumentError(
                f"input_ids holds ids outside the vocabulary [0, {info['vocab']}): {int(ids.min())}…{int(ids.max())}."
            )
        return ids, mask

    def _speech(self, input_ids: Any, attention_mask: Any, input_features: Any,
                input_values: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """The speech source (and its mask, for an encoder of any length) in the layout the
        encoder file takes: Whisper's fixed frames, frames of any length, or a waveform."""
        info = self.info
        name, dims = info["source"], list(info["source_dims"])
        given = input_features if name == INPUT_FEATURES else input_values
        other = input_values if name == INPUT_FEATURES else input_features
        layout = "[batch, " + ", ".join("frames" if d is None and len(dims) > 1 else "samples" if d is None else str(d)
                                        for d in dims) + "]"
        what = "log-mel features" if name == INPUT_FEATURES else "the waveform"
        if given is None or input_ids is not None or other is not None:
            raise InvalidArgumentError(
                f"This {info['model_type']} folder transcribes speech: give {name} ({what} {layout}, from its feature "
                f"extractor{', with attention_mask for padded rows' if info['source_mask'] else ''}), not "
                f"{'input_ids' if input_ids is not None else INPUT_VALUES if name == INPUT_FEATURES else INPUT_FEATURES}."
            )
        if hasattr(given, "detach"):
            given = given.detach().cpu().float().numpy()
        source = np.asarray(given, dtype=np.float32)
        if source.ndim == len(dims):
            source = source[None]
        # Whisper's encoder takes a fixed window of frames; generate decodes audio of any length
        # a window at a time, as transformers does
        windowed = None not in dims
        fits = source.ndim == len(dims) + 1 and all(
            d is None or d == n or (windowed and k == len(dims) - 1 and n > 0)
            for k, (d, n) in enumerate(zip(dims, source.shape[1:])))
        if not fits or source.shape[0] == 0:
            if windowed:
                layout = f"[batch, {dims[0]}, frames]"
            raise InvalidArgumentError(f"{name} must be {what} {layout}, not {list(source.shape)}.")
        if windowed:
            # read only for a batch of audio longer than the window (each row's own length), as
            # transformers' Whisper reads it
            if attention_mask is None:
                return source, None
            mask = _ids(attention_mask, "attention_mask")
            if mask.shape != (source.shape[0], source.shape[2]) or not np.isin(mask, (0, 1)).all():
                raise InvalidArgumentError(
                    f"attention_mask must be 0/1 and shaped [batch, frames] = {[source.shape[0], source.shape[2]]} "
                    f"like {name}'s rows and frames, not {list(mask.shape)}."
                )
            return source, mask
        length = source.shape[1]
        mask = np.ones(source.shape[:2], np.int64) if attention_mask is None else _ids(attention_mask, "attention_mask")
        if mask.shape != source.shape[:2] or not np.isin(mask, (0, 1)).all():
            raise InvalidArgumentError(
                f"attention_mask must be 0/1 and shaped [batch, {length}] like {name}'s first two axes, not "
                f"{list(mask.shape)}."
            )
        return source, mask


#: Whisper's feature frames: a hop of 160 samples at 16 kHz
_SECONDS_PER_FRAME = 0.01


def _window_text(tokens: list[int], settings: Settings) -> tuple[list[int], bool]:
    """A window's new tokens as transformers keeps them: the padding after a finished row taken
    off (as many tokens from the end as the row holds pad tokens, the end token kept where it is
    the pad token too), then the end token; and whether the window ended with it."""
    pad = settings.pad_token_id
    if tokens and pad is not None and tokens[-1] == pad:
        count = tokens.count(pad) - (1 if pad in settings.eos_token_id else 0)
        if count > 0:
            tokens = tokens[:-count]
    if tokens and tokens[-1] in settings.eos_token_id:
        return tokens[:-1], True
    return tokens, False


def _segments(tokens: list[int], first_stamp: int, span: int, stride: int) -> tuple[list[int], int]:
    """The tokens of a window's complete segments and the frames to seek past (Whisper's
    sequential decoding, as transformers does it). A segment closes at two timestamps in a row;
    tokens that end in a lone timestamp, or hold no such pair, were spoken to the window's end
    (``span`` frames) and are kept whole; otherwise what follows the last pair is an unfinished
    segment, dropped, and the next window starts at the pair's first timestamp (a timestamp
    counts ``stride`` frames: the encoder's positions are ``stride`` frames apart)."""
    stamps = [t >= first_stamp for t in tokens]
    pairs = [i + 1 for i in range(len(tokens) - 1) if stamps[i] and stamps[i + 1]]
    if not pairs or stamps[-2:] == [False, True]:
        return tokens, span
    end = pairs[-1] + 1
    advance = (tokens[end - 2] - first_stamp) * stride
    # a last pair at time zero would decode the same window again forever: take the whole window
    return tokens[:end], advance if advance > 0 else span


def generate_seq2seq(folder: str | os.PathLike, *, session_options: Any = None, **options: Any) -> np.ndarray:
    """Generate with the encoder and decoder files of an :func:`export_seq2seq` folder, in ONNX
    Runtime on the CPU (see :func:`onnxport.llm.generate`, which calls this for such a folder)."""
    generator = folder if isinstance(folder, Seq2SeqGenerator) else Seq2SeqGenerator(folder, session_options)
    return generator.generate(**options)
