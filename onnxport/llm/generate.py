"""``generate``: token ids from a decoder file, decoded in ONNX Runtime with its key/value cache.

The loop is written once (:func:`decode`) over a step function, so the exporter's proof runs the
same loop on the PyTorch model and on the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .names import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, position_ids_for

#: The file's metadata key holding what generation needs to know about the model (JSON).
METADATA_KEY = "onnxport.decoder"

#: ``step(input_ids, attention_mask, position_ids, past) -> (logits, present)``
Step = Callable[[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]


def _as_ids(values: Any, argument: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{argument} must be integer token ids, [batch, length]: {error}") from error
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] == 0 or not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgumentError(
            f"{argument} must be a non-empty [batch, length] array of integer token ids, "
            f"not {array.dtype} shaped {list(array.shape)}."
        )
    return array.astype(np.int64)


def _pick(do_sample: bool, temperature: float, top_k: int, top_p: float, seed: int | None) -> Callable[[np.ndarray], np.ndarray]:
    """The next token of each row from its last logits: the largest (greedy) or a seeded draw."""
    if not do_sample:
        return lambda logits: logits.argmax(-1)
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> np.ndarray:
        scores = logits.astype(np.float64) / temperature
        if top_k:
            kth = np.sort(scores, axis=-1)[:, -min(top_k, scores.shape[-1])][:, None]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        if top_p < 1.0:
            order = np.argsort(-probs, axis=-1)
            ranked = np.take_along_axis(probs, order, -1)
            # keep the smallest set of tokens whose mass reaches top_p (always the first)
            drop = np.cumsum(ranked, -1) - ranked >= top_p
            mask = np.zeros_like(probs, dtype=bool)
            np.put_along_axis(mask, order, drop, -1)
            probs = np.where(mask, 0.0, probs)
            probs /= probs.sum(-1, keepdims=True)
        return np.array([rng.choice(probs.shape[-1], p=row) for row in probs], dtype=np.int64)

    return sample


def decode(
    step: Step,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    empty_past: list[np.ndarray],
    max_new_tokens: int,
    pick: Callable[[np.ndarray], np.ndarray],
    *,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    on_logits: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """Prefill the prompt, then feed back one token at a time with the cache, as transformers'
    ``generate`` does: positions count the real tokens (left padding skipped), a row that has
    produced an end-of-sequence token continues with padding, and the loop stops when every row
    has. Returns the prompt followed by the new tokens."""
    tokens, mask, past = input_ids, attention_mask, empty_past
    current = input_ids
    unfinished = np.ones(len(input_ids), dtype=bool)
    for _ in range(max_new_tokens):
        logits, past = step(current, mask, position_ids_for(mask, current.shape[1]), past)
        last = logits[:, -1]
        if on_logits is not None:
            on_logits(last)
        chosen = np.where(unfinished, pick(last), pad_token_id).astype(np.int64)
        tokens = np.concatenate([tokens, chosen[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((len(mask), 1), dtype=mask.dtype)], axis=1)
        current = chosen[:, None]
        if eos_token_ids:
            unfinished &= ~np.isin(chosen, list(eos_token_ids))
            if not unfinished.any():
                break
    return tokens


def file_info(session: Any) -> dict[str, Any]:
    """What the exporter recorded about the model in a decoder file (see :data:`METADATA_KEY`)."""
    meta = session.get_modelmeta().custom_metadata_map
    if METADATA_KEY not in meta:
        names = [i.name for i in session.get_inputs()]
        raise InvalidArgumentError(
            f"The file is not a decoder onnxport exported (no '{METADATA_KEY}' metadata; its inputs are "
            f"{names}); export it with export_decoder."
        )
    return json.loads(meta[METADATA_KEY])


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def ort_step(session: Any) -> Step:
    """The step function of a decoder session."""
    inputs = session.get_inputs()
    past_names = [i.name for i in inputs][3:]
    output_names = [o.name for o in session.get_outputs()]

    def step(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: positions, **dict(zip(past_names, past))}
        outputs = session.run(output_names, feeds)
        return outputs[0], outputs[1:]

    return step


def empty_past(session: Any, batch: int) -> list[np.ndarray]:
    """A decoder session's cache inputs for ``batch`` rows with nothing in them yet (the first step's past)."""
    past = []
    for value in session.get_inputs()[3:]:
        _, heads, _, dim = value.shape
        dtype = np.float16 if "float16" in value.type else np.float32
        past.append(np.zeros((batch, heads, 0, dim), dtype=dtype))
    return past


def generate(
    model: str | os.PathLike | Any,
    input_ids: Any = None,
    attention_mask: Any = None,
    max_new_tokens: int | None = None,
    *,
    do_sample: bool | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = -1,
    pad_token_id: int | None = -1,
    session_options: Any = None,
    **seq2seq: Any,
) -> np.ndarray:
    """Generate tokens with a decoder file or an encoder–decoder folder onnxport exported, in ONNX
    Runtime on the CPU.

    An :func:`~onnxport.llm.export_seq2seq` folder (``encoder_model.onnx`` and
    ``decoder_model.onnx``) is generated with as its ``generation_config.json`` says — greedy,
    sampling or beam search, its forced, suppressed and end tokens — and takes ``input_ids`` and
    ``attention_mask`` (text), ``input_features`` (Whisper; Speech2Text with its ``attention_mask``)
    or ``input_values`` and ``attention_mask`` (Moonshine), ``max_new_tokens`` (default: the
    config's ``max_length``) and transformers' names for what to change: ``num_beams``,
    ``length_penalty``, ``early_stopping``, ``num_return_sequences``, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``seed``; Whisper also ``language`` (detected from the
    audio when not given), ``task`` and ``return_timestamps``. It returns the decoder's tokens, its
    start token first (for Whisper, the prompt of start, language, task and no-timestamps tokens
    first), rows that ended filled with padding, as transformers' ``generate`` returns them for
    encoder–decoders. Whisper's features may be of any length: past the encoder's window (30 s)
    they are decoded a window at a time, with timestamps, as transformers' long-form ``generate``
    does (a batch of such audio needs its ``attention_mask``); such a row holds the prompt, then
    every segment's tokens, then the end token.

    Args:
        model: the ``.onnx`` file :func:`export_decoder` wrote (or its result, or the folder it
            wrote), an ``onnxruntime.InferenceSession`` of it, an ``export_seq2seq`` folder, or a
            :class:`~onnxport.llm.Seq2SeqGenerator` of one (its sessions made once, for many calls).
        input_ids: the prompts, ``[batch, length]`` integer ids (a list, NumPy array or tensor);
            rows of different lengths are padded on the left.
        attention_mask: 1 for real tokens, 0 for left padding (default: all ones).
        max_new_tokens: how many tokens to add at most (a decoder file: default 32).
        do_sample: draw each token from the softmax of its logits (with ``temperature``,
            ``top_k``, ``top_p`` and ``seed``) instead of taking the largest (greedy); ``None``
            (the default): greedy for a decoder file, the generation config's choice for an
            encoder–decoder folder.
        eos_token_id, pad_token_id: the model's own (recorded in the file) unless given; ``None``
            never stops early. A row that ends continues with ``pad_token_id``.
        session_options: ``onnxruntime.SessionOptions`` for the session (default: ORT's defaults).

    Returns:
        ``[batch, length + new]`` int64 ids: the prompt, then the new tokens (as transformers'
        ``generate`` returns them for a decoder-only model).
    """
    import onnxruntime as ort

    from ..runtime import make_session
    from .seq2seq_generate import Seq2SeqGenerator, generate_seq2seq

    folder = Path(model) if isinstance(model, (str, os.PathLike)) and Path(model).is_dir() else None
    if isinstance(model, Seq2SeqGenerator) or (folder is not None and (
            (folder / "encoder_model.onnx").is_file() or not (folder / "model.onnx").is_file())):
        sampling = {"do_sample": do_sample, "temperature": temperature if do_sample else None,
                    "top_k": top_k or None, "top_p": top_p if top_p < 1.0 else None, "seed": seed}
        return generate_seq2seq(model, input_ids=input_ids, attention_mask=attention_mask,
                                max_new_tokens=max_new_tokens, session_options=session_options, **sampling, **seq2seq)
    if folder is not None:
        model = folder / "model.onnx"
    if seq2seq:
        raise InvalidArgumentError(
            f"{', '.join(sorted(seq2seq))}: options of an encoder-decoder folder (export_seq2seq); a decoder file "
            f"takes none of them."
        )
    if input_ids is None:
        raise InvalidArgumentError("input_ids is required: the prompts, [batch, length] integer token ids.")
    if max_new_tokens is None:
        max_new_tokens = 32
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be a positive integer, not {max_new_tokens!r}.")
    if do_sample and (not isinstance(temperature, (int, float)) or temperature <= 0):
        raise InvalidArgumentError(f"temperature must be a positive number, not {temperature!r}.")
    if not 0 < top_p <= 1:
        raise InvalidArgumentError(f"top_p must be in (0, 1], not {top_p!r}.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidArgumentError(f"top_k must be a non-negative integer (0: no limit), not {top_k!r}.")
    ids = _as_ids(input_ids, "input_ids")
    mask = np.ones_like(ids) if attention_mask is None else _as_ids(attention_mask, "attention_mask")
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise InvalidArgumentError(
            f"attention_mask must be 0/1 and shaped like input_ids {list(ids.shape)}, not {list(mask.shape)}."
        )
    if not mask[:, -1].all():
        raise InvalidArgumentError(
            "attention_mask ends in padding: pad the prompts on the left (generation continues from each row's last column)."
        )
    if isinstance(model, ort.InferenceSession):
        session = model
    else:
        path = Path(os.fspath(model))
        if not path.is_file():
            raise InvalidArgumentError(f"model '{path}' is not a file; give the .onnx file export_decoder wrote.")
        session = make_session(path, session_options=session_options)
    info = file_info(session)
    if ids.min() < 0 or ids.max() >= info["vocab"]:
        raise InvalidArgumentError(f"input_ids holds ids outside the vocabulary [0, {info['vocab']}): {int(ids.min())}…{int(ids.max())}.")
    limit = info.get("max_positions")
    if limit and ids.shape[1] + max_new_tokens > limit:
        raise InvalidArgumentError(
            f"The prompt ({ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) is longer than the "
            f"model's {limit} positions; shorten the prompt or ask for at most {max(limit - ids.shape[1], 0)} new tokens."
        )
    eos = _eos_list(info.get("eos_token_id") if eos_token_id == -1 else eos_token_id)
    pad = info.get("pad_token_id") if pad_token_id == -1 else pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return decode(ort_step(session), ids, mask, empty_past(session, len(ids)), max_new_tokens,
                  _pick(bool(do_sample), float(temperature), top_k, float(top_p), seed),
                  eos_token_ids=eos, pad_token_id=int(pad))


__all__ = ["METADATA_KEY", "decode", "generate"]
