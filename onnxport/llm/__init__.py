"""LLM decoders with a key/value cache: :func:`export_decoder` writes one, :func:`generate`
decodes with it in ONNX Runtime; :func:`export_seq2seq` writes an encoder–decoder's encoder and
decoder files, and :func:`generate` generates with those too.

The names load lazily: generating with a written folder imports ONNX Runtime and NumPy, not torch
(which the exporters need, and which costs a process about 0.3 GB of memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core.lazy import lazy_names

# bound now, not lazily: the submodule of the same name would otherwise shadow the function
# whenever it is imported first (it needs NumPy only)
from .generate import generate

_EXPORTS = {
    "FLAVOURS": ".export", "PRECISIONS": ".export", "DecoderFile": ".export", "export_decoder": ".export",
    "genai_config": ".export", "Seq2SeqFiles": ".seq2seq", "export_seq2seq": ".seq2seq",
    "Seq2SeqGenerator": ".seq2seq_generate",
}

__all__ = ["FLAVOURS", "PRECISIONS", "DecoderFile", "Seq2SeqFiles", "Seq2SeqGenerator", "export_decoder", "export_seq2seq",
           "genai_config", "generate"]

if TYPE_CHECKING:
    from .export import FLAVOURS, PRECISIONS, DecoderFile, export_decoder, genai_config
    from .seq2seq import Seq2SeqFiles, export_seq2seq
    from .seq2seq_generate import Seq2SeqGenerator


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
