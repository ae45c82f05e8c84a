"""LLM decoders with a key/value cache: :func:`export_decoder` writes one, :func:`generate`
decodes with it in ONNX Runtime; :func:`export_seq2seq` writes an encoder–decoder's encoder and
decoder files, and :func:`generate` generates with those too."""

from .export import FLAVOURS, PRECISIONS, DecoderFile, export_decoder, genai_config
from .generate import generate
from .seq2seq import Seq2SeqFiles, export_seq2seq
from .seq2seq_generate import Seq2SeqGenerator

__all__ = ["FLAVOURS", "PRECISIONS", "DecoderFile", "Seq2SeqFiles", "Seq2SeqGenerator", "export_decoder", "export_seq2seq", "genai_config", "generate"]
