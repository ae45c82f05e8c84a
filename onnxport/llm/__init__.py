"""LLM decoders with a key/value cache: :func:`export_decoder` writes one, :func:`generate`
decodes with it in ONNX Runtime."""

from .export import FLAVOURS, PRECISIONS, DecoderFile, export_decoder, genai_config
from .generate import generate

__all__ = ["FLAVOURS", "PRECISIONS", "DecoderFile", "export_decoder", "genai_config", "generate"]
