"""Token search for encoder–decoder files: greedy, seeded sampling and beam search, with the logits
processors a model's ``generation_config.json`` asks for, computed as transformers' ``generate``
computes them (the same order of processors, the same float32 scores, the same beam bookkeeping),
so a file and its model pick the same tokens.

Everything here is NumPy over two callables — one that encodes a source batch and one decoder step
— so the exporter's proof runs the same search on the PyTorch model as :func:`generate` runs on
the files.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, WeakerCheckWarning

#: ``step(input_ids, encoder_attention_mask, own_past, cross) -> (logits, own_present)``
DecoderStep = Callable[[np.ndarray, "np.ndarray | None", list[np.ndarray], list[np.ndarray]],
                       tuple[np.ndarray, list[np.ndarray]]]

#: transformers' stand-in for "never": a finished or impossible beam's score offset
_NEVER = np.float32(-1.0e9)

#: generation_config.json settings that change the tokens and that the search does not implement
_UNSUPPORTED = ("sequence_bias", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty",
                "num_beam_groups", "diversity_penalty", "penalty_alpha", "guidance_scale", "typical_p",
                "epsilon_cutoff", "eta_cutoff", "min_p", "top_h", "constraints", "force_words_ids")


@dataclass
class Settings:
    """How tokens are searched: transformers' ``GenerationConfig`` fields of the same names."""

    decoder_start_token_id: int
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    max_length: int = 20
    max_new_tokens: int | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    do_sample: bool = False
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: list[int] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    seed: int | None = None
    #: Whisper with timestamps: the no-timestamps token (the timestamps are the ids after it), and
    #: how far the first timestamp may go
    no_timestamps_token_id: int | None = None
    timestamps: bool = False
    max_initial_timestamp_index: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], model_config: dict[str, Any] | None = None,
                    **overrides: Any) -> Settings:
        """Settings from a ``generation_config.json`` (the model's ``config.json`` names the
        start, end and pad tokens it leaves out), then ``overrides`` that are not ``None``."""
        # transformers reads the search from the generation config alone; the model's config
        # only names the tokens that config leaves out
        merged = {k: v for k, v in config.items() if v is not None}
        for name in ("decoder_start_token_id", "eos_token_id", "pad_token_id"):
            if merged.get(name) is None and (model_config or {}).get(name) is not None:
                merged[name] = model_config[name]
        for name in _UNSUPPORTED:
            if merged.get(name) not in (None, 0, 0.0, 1, 1.0, False, [], {}):
                warnings.warn(
                    f"The model's generation config sets {name}={merged[name]!r}, which onnxport's search does not "
                    f"apply; its tokens may differ from transformers' generate.",
                    WeakerCheckWarning,
                    stacklevel=3,
                )
        start = overrides.pop("decoder_start_token_id", None)
        if start is None:
            start = merged.get("decoder_start_token_id")
        if start is None:
            raise InvalidArgumentError(
                "The model names no decoder_start_token_id (generation_config.json or config.json); a decoder cannot start."
            )
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in merged.items() if k in known and v is not None}
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["decoder_start_token_id"] = int(start)
        values["eos_token_id"] = _id_list(values.get("eos_token_id"))
        if "forced_eos_token_id" in values:
            values["forced_eos_token_id"] = _id_list(values["forced_eos_token_id"])
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        def positive_int(name: str, value: Any, low: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{name} must be an integer of at least {low}, not {value!r}.")

        positive_int("num_beams", self.num_beams)
        positive_int("num_return_sequences", self.num_return_sequences)
        if self.num_return_sequences > self.num_beams and not self.do_sample:
            raise InvalidArgumentError(
                f"num_return_sequences ({self.num_return_sequences}) cannot exceed num_beams ({self.num_beams}); "
                f"ask for at most num_beams sequences."
            )
        if self.max_new_tokens is not None:
            positive_int("max_new_tokens", self.max_new_tokens)
        if self.do_sample and (not isinstance(self.temperature, (int, float)) or self.temperature <= 0):
            raise InvalidArgumentError(f"temperature must be a positive number, not {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], not {self.top_p!r}.")
        positive_int("top_k", self.top_k, 0)
        if self.early_stopping not in (True, False, "never"):
            raise InvalidArgumentError(f"early_stopping must be True, False or 'never', not {self.early_stopping!r}.")

    @property
    def fill(self) -> int:
        """What a finished row continues with: the pad token, else the first end token."""
        if self.pad_token_id is not None:
            return int(self.pad_token_id)
        return self.eos_token_id[0] if self.eos_token_id else 0

    def limit(self, prompt_length: int) -> int:
        """The longest sequence, the decoder prompt included (``max_new_tokens`` wins)."""
        return prompt_length + self.max_new_tokens if self.max_new_tokens is not None else self.max_length


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def process(settings: Settings, sequences: np.ndarray, scores: np.ndarray, prompt_length: int,
            max_length: int) -> np.ndarray:
    """The model's logits processors on the last step's ``scores`` (float32, [rows, vocab]), in
    transformers' order; ``sequences`` are the decoder tokens so far."""
    scores = scores.astype(np.float32, copy=True)
    length = sequences.shape[1]
    vocab = scores.shape[1]
    if settings.repetition_penalty != 1.0:
        rows = np.arange(len(scores))[:, None]
        seen = np.clip(sequences, 0, vocab - 1)
        picked = scores[rows, seen]
        scores[rows, seen] = np.where(picked < 0, picked * settings.repetition_penalty, picked / settings.repetition_penalty)
    n = settings.no_repeat_ngram_size
    if n and length + 1 >= n:
        for row, tokens in enumerate(sequences.tolist()):
            head = tuple(tokens[length - n + 1:])
            banned = [tokens[i + n - 1] for i in range(length - n + 1) if tuple(tokens[i:i + n - 1]) == head]
            scores[row, banned] = -np.inf
    if settings.bad_words_ids:
        for row, tokens in enumerate(sequences.tolist()):
            for words in settings.bad_words_ids:
                if words == settings.eos_token_id[:1] and len(words) == 1:
                    continue  # transformers never bans the end token this way
                prefix = words[:-1]
                if not prefix or tokens[len(tokens) - len(prefix):] == prefix:
                    scores[row, words[-1]] = -np.inf
    eos = [e for e in settings.eos_token_id if 0 <= e < vocab]
    if eos and settings.min_length > 0 and length < settings.min_length:
        scores[:, eos] = -np.inf
    if eos and settings.min_new_tokens and length - prompt_length < settings.min_new_tokens:
        scores[:, eos] = -np.inf
    if settings.forced_bos_token_id is not None and length == 1:
        scores[:] = -np.inf
        scores[:, settings.forced_bos_token_id] = 0
    if settings.forced_eos_token_id and length == max_length - 1:
        scores[:] = -np.inf
        scores[:, settings.forced_eos_token_id] = 0
    if settings.suppress_tokens:
        scores[:, [t for t in settings.suppress_tokens if 0 <= t < vocab]] = -np.inf
    if settings.begin_suppress_tokens:
        begin = prompt_length if prompt_length > 1 or settings.forced_bos_token_id is None else prompt_length + 1
        if length == begin:
            scores[:, [t for t in settings.begin_suppress_tokens if 0 <= t < vocab]] = -np.inf
    if settings.timestamps and settings.no_timestamps_token_id is not None:
        _timestamp_rules(settings, sequences, scores, prompt_length)
    return scores


def _timestamp_rules(settings: Settings, sequences: np.ndarray, scores: np.ndarray, begin: int) -> None:
    """Whisper's timestamp grammar, in place, as transformers (after OpenAI's decoder) applies it:
    timestamps come in pairs (two in a row are followed by text; one after text by another or the
    end), never go back, the first token is a timestamp (no later than the initial limit), and a
    timestamp is forced when their total probability beats every text token's."""
    first = settings.no_timestamps_token_id + 1  # the caller checked it is set
    end = settings.eos_token_id[0] if settings.eos_token_id else 0
    scores[:, settings.no_timestamps_token_id] = -np.inf
    for row, tokens in enumerate(sequences[:, begin:].tolist()):
        last = len(tokens) >= 1 and tokens[-1] >= first
        penultimate = len(tokens) < 2 or tokens[-2] >= first
        if last:
            if penultimate:
                scores[row, first:] = -np.inf
            else:
                scores[row, :end] = -np.inf
        stamps = [t for t in tokens if t >= first]
        lowest = first
        if stamps:
            lowest = stamps[-1] if last and not penultimate else stamps[-1] + 1
        scores[row, first:lowest] = -np.inf
    if sequences.shape[1] == begin:
        scores[:, :first] = -np.inf
        if settings.max_initial_timestamp_index is not None:
            scores[:, first + settings.max_initial_timestamp_index + 1:] = -np.inf
    log_probs = _log_softmax(scores.astype(np.float32))
    stamps_only = log_probs[:, first:]
    top = stamps_only.max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        stamp_mass = (top + np.log(np.exp(stamps_only - np.where(np.isfinite(top), top, 0)).sum(-1, keepdims=True)))[:, 0]
    text_best = log_probs[:, :first].max(-1)
    scores[stamp_mass > text_best, :first] = -np.inf


def _warp(settings: Settings, scores: np.ndarray) -> np.ndarray:
    """Sampling's warpers: temperature, top-k, top-p (transformers' order)."""
    if settings.temperature != 1.0:
        scores = scores / np.float32(settings.temperature)
    if settings.top_k:
        k = min(settings.top_k, scores.shape[-1])
        kth = np.sort(scores, axis=-1)[:, -k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    if settings.top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")
        ranked = np.take_along_axis(scores, order, -1)
        probs = _softmax(ranked)
        # drop the tokens whose mass, counted from the least likely, stays within 1 - top_p (the
        # most likely always kept)
        drop = np.cumsum(probs, -1) <= 1 - settings.top_p
        drop[:, -1] = False
        mask = np.zeros_like(drop)
        np.put_along_axis(mask, order, drop, -1)
        scores = np.where(mask, -np.inf, scores)
    return scores


def _softmax(scores: np.ndarray) -> np.ndarray:
    wide = scores.astype(np.float64)
    wide = np.exp(wide - wide.max(-1, keepdims=True))
    return wide / wide.sum(-1, keepdims=True)


def _log_softmax(scores: np.ndarray) -> np.ndarray:
    top = scores.max(-1, keepdims=True)
    return (scores - top - np.log(np.exp(scores - top).sum(-1, keepdims=True))).astype(np.float32)


def _empty_past(cross: list[np.ndarray], rows: int) -> list[np.ndarray]:
    """Each layer's own keys and values with no past, shaped like its cross ones."""
    key = cross[0]
    return [np.zeros((rows, key.shape[1], 0, key.shape[3]), key.dtype) for _ in cross]


def interleave(own: list[np.ndarray], cross: list[np.ndarray]) -> list[np.ndarray]:
    """The decoder file's cache inputs, per layer: own key, own value, cross key, cross value."""
    return [t for i in range(0, len(own), 2) for t in (own[i], own[i + 1], cross[i], cross[i + 1])]


def greedy_or_sample(step: DecoderStep, cross: list[np.ndarray], encoder_mask: np.ndarray | None,
                     prompt: np.ndarray, settings: Settings,
                     on_logits: Callable[[np.ndarray], None] | None = None,
                     choose: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """One token per row at a time until every row has ended or the length limit: the largest
    processed score, or a seeded draw; ``choose`` overrides the pick (the proof's teacher forcing)."""
    rng = np.random.default_rng(settings.seed)
    sequences = prompt.astype(np.int64)
    prompt_length, limit = prompt.shape[1], settings.limit(prompt.shape[1])
    unfinished = np.ones(len(prompt), dtype=bool)
    own = _empty_past(cross, len(prompt))
    current = sequences
    while sequences.shape[1] < limit:
        logits, own = step(current, encoder_mask, own, cross)
        last = logits[:, -1]
        # float16 files' logits are searched in float32; a float64 reference run's stay as they are
        last = last if last.dtype == np.float64 else last.astype(np.float32)
        if on_logits is not None:
            on_logits(last)
        scores = process(settings, sequences, last, prompt_length, limit)
        if choose is not None:
            chosen = choose(scores)
        elif settings.do_sample:
            probs = _softmax(_warp(settings, scores))
            chosen = np.array([rng.choice(probs.shape[-1], p=row) for row in probs], dtype=np.int64)
        else:
            chosen = scores.argmax(-1)
        chosen = np.where(unfinished, chosen, settings.fill).astype(np.int64)
        sequences = np.concatenate([sequences, chosen[:, None]], axis=1)
        if settings.eos_token_id:
            unfinished &= ~np.isin(chosen, settings.eos_token_id)
            if not unfinished.any():
                break
        current = chosen[:, None]
    return sequences


def beam_search(step: DecoderStep, cross: list[np.ndarray], encoder_mask: np.ndarray | None,
                prompt: np.ndarray, settings: Settings) -> np.ndarray:
    """Beam search as transformers runs it: per source, the best ``num_beams`` running beams
    continue; a beam that ends (an end token, or the length limit) joins the finished ones with
    its score divided by its new-token count to the power ``length_penalty``; the search stops
    when no running beam can beat the finished ones (``early_stopping``), and the best finished
    beams are returned, shorter ones filled with padding."""
    rng = np.random.default_rng(settings.seed)
    beams, batch = settings.num_beams, len(prompt) // settings.num_beams
    prompt_length = prompt.shape[1]
    limit = settings.limit(prompt_length)
    keep = max(2, 1 + len(settings.eos_token_id)) * beams
    top_beams = np.arange(keep) < beams
    fill = settings.pad_token_id if settings.pad_token_id else (settings.eos_token_id[0] if settings.eos_token_id else -1)

    running = np.full((batch, beams, limit), fill, dtype=np.int64)
    running[:, :, :prompt_length] = prompt.reshape(batch, beams, prompt_length)
    finished_sequences = running.copy()
    running_scores = np.zeros((batch, beams), np.float32)
    running_scores[:, 1:] = _NEVER  # only the first beam's continuations count at the start
    finished_scores = np.full((batch, beams), _NEVER, np.float32)
    is_finished = np.zeros((batch, beams), dtype=bool)
    improvable = np.ones((batch, 1), dtype=bool)
    generated = limit - prompt_length
    running_origins = np.full((batch, beams, generated), -1, dtype=np.int64)
    finished_origins = running_origins.copy()
    offsets = (np.arange(batch) * beams)[:, None]

    own = _empty_past(cross, len(prompt))
    length = prompt_length
    current = prompt.astype(np.int64)
    while True:
        logits, own = step(current, encoder_mask, own, cross)
        flat = running[:, :, :length].reshape(batch * beams, length)
        log_probs = process(settings, flat, _log_softmax(logits[:, -1].astype(np.float32)), prompt_length, limit)
        vocab = log_probs.shape[-1]
        totals = (log_probs.reshape(batch, beams, vocab) + running_scores[:, :, None]).reshape(batch, beams * vocab)
        if settings.do_sample:
            probs = _softmax(totals)
            picks = np.stack([rng.choice(beams * vocab, size=keep, replace=False, p=row) for row in probs])
            picked = np.take_along_axis(totals, picks, 1)
            order = np.argsort(-picked, axis=1, kind="stable")
            top_indices, top_scores = np.take_along_axis(picks, order, 1), np.take_along_axis(picked, order, 1)
        else:
            top_indices = np.argsort(-totals, axis=1, kind="stable")[:, :keep]
            top_scores = np.take_along_axis(totals, top_indices, 1)
        source_beams, tokens = top_indices // vocab, top_indices % vocab
        top_sequences = np.take_along_axis(running, source_beams[:, :, None], 1)
        top_sequences[:, :, length] = tokens
        top_origins = np.take_along_axis(running_origins, source_beams[:, :, None], 1)
        top_origins[:, :, length - prompt_length] = source_beams + offsets

        ended = np.isin(tokens, settings.eos_token_id) | (length + 1 >= limit)

        # the running beams of the next step: the best that did not end
        still = top_scores + ended.astype(np.float32) * _NEVER
        chosen = np.argsort(-still, axis=1, kind="stable")[:, :beams]
        running = np.take_along_axis(top_sequences, chosen[:, :, None], 1)
        running_scores = np.take_along_axis(still, chosen, 1)
        running_origins = np.take_along_axis(top_origins, chosen[:, :, None], 1)

        # the finished beams: the best of those before and the ones that just ended
        just_ended = ended & top_beams[None, :]
        scored = (top_scores / np.float32((length + 1 - prompt_length) ** settings.length_penalty)).astype(np.float32)
        full = is_finished.all(-1, keepdims=True) & (settings.early_stopping is True)
        scored = scored + full.astype(np.float32) * _NEVER
        scored = scored + (~improvable).astype(np.float32) * _NEVER
        scored = scored + (~just_ended).astype(np.float32) * _NEVER
        merged_scores = np.concatenate([finished_scores, scored], axis=1)
        best = np.argsort(-merged_scores, axis=1, kind="stable")[:, :beams]
        finished_sequences = np.take_along_axis(np.concatenate([finished_sequences, top_sequences], 1), best[:, :, None], 1)
        finished_scores = np.take_along_axis(merged_scores, best, 1)
        finished_origins = np.take_along_axis(np.concatenate([finished_origins, top_origins], 1), best[:, :, None], 1)
        is_finished = np.take_along_axis(np.concatenate([is_finished, just_ended], 1), best, 1)

        # every layer's own cache follows its beam
        rows = running_origins[:, :, length - prompt_length].reshape(-1)
        own = [past[rows] for past in own]
        length += 1

        if settings.early_stopping == "never" and settings.length_penalty > 0.0:
            best_length = limit - prompt_length
        else:
            best_length = length - prompt_length
        best_running = running_scores[:, :1] / np.float32(best_length ** settings.length_penalty)
        worst_finished = np.where(is_finished, finished_scores.min(1, keepdims=True), _NEVER)
        improvable = improvable & (best_running > worst_finished).any(-1, keepdims=True)
        open_beam = not (is_finished.all() and settings.early_stopping is True)
        if not (improvable.any() and open_beam and not ended.all()):
            break
        current = running[:, :, length - 1].reshape(-1, 1)

    returned = settings.num_return_sequences
    sequences = finished_sequences[:, :returned].reshape(batch * returned, -1)
    origins = finished_origins[:, :returned].reshape(batch * returned, -1)
    longest = int((origins != -1).sum(1).max())
    return sequences[:, :prompt_length + longest]


def search(step: DecoderStep, cross: list[np.ndarray], encoder_mask: np.ndarray | None, prompt: np.ndarray,
           settings: Settings) -> np.ndarray:
    """The tokens ``settings`` ask for: every source row's prompt continued (beam search expands
    each source to ``num_beams`` rows first, as transformers does)."""
    if settings.num_beams > 1:
        beams = settings.num_beams
        cross = [np.repeat(t, beams, axis=0) for t in cross]
        encoder_mask = None if encoder_mask is None else np.repeat(encoder_mask, beams, axis=0)
        return beam_search(step, cross, encoder_mask, np.repeat(prompt, beams, axis=0), settings)
    if settings.num_return_sequences > 1:
        copies = settings.num_return_sequences
        cross = [np.repeat(t, copies, axis=0) for t in cross]
        encoder_mask = None if encoder_mask is None else np.repeat(encoder_mask, copies, axis=0)
        prompt = np.repeat(prompt, copies, axis=0)
    return greedy_or_sample(step, cross, encoder_mask, prompt, settings)


__all__: Sequence[str] = ["DecoderStep", "Settings", "beam_search", "greedy_or_sample", "interleave", "process", "search"]
