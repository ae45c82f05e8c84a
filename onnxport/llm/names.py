"""What the decoder and encoder–decoder files call their inputs, outputs and files, and the
positions a generator feeds: everything the generators need from the export side, without torch."""

from __future__ import annotations

from typing import Any

import numpy as np

#: A decoder file's input and output names, as Optimum's ``text-generation-with-past`` writes them.
INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"

#: An encoder–decoder's two files, and the names its exports add (as Optimum's seq2seq exports write them).
ENCODER_FILE, DECODER_FILE = "encoder_model.onnx", "decoder_model.onnx"
INPUT_FEATURES, ENCODER_ATTENTION_MASK, LAST_HIDDEN_STATE = "input_features", "encoder_attention_mask", "last_hidden_state"
#: A speech encoder's waveform input (Moonshine), beside ``input_features`` (log-mel frames).
INPUT_VALUES = "input_values"
#: The metadata key both encoder–decoder files carry (JSON): what generation needs to know about the model.
SEQ2SEQ_METADATA_KEY = "onnxport.seq2seq"


def split_encoded(encoded: list[Any], layers: int, speech_mask: bool, mask: Any) -> tuple[list[Any], Any]:
    """An encoder file's outputs as the decoder reads them: the cross-attention keys and values
    (after ``last_hidden_state``), and its ``encoder_attention_mask``: a speech encoder's own (its
    last output, ``speech_mask``), else the source's ``mask`` as given (None for Whisper)."""
    return list(encoded[1:1 + 2 * layers]), encoded[-1] if speech_mask else mask


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def position_ids_for(attention_mask: Any, length: int) -> Any:
    """Positions of the last ``length`` tokens as transformers' ``generate`` gives them: the
    count of real tokens before each one (left padding skipped), 1 on padding."""
    positions = np.cumsum(attention_mask, axis=-1) - 1
    positions[attention_mask == 0] = 1
    return positions[:, -length:].astype(np.int64)
