"""AIMET encodings (0.6.1, 1.0.0, 2.0.0, 2.1.0) to ONNX Q/DQ, and back. Never imports torch."""

from .convert import encodings_to_onnx_qdq
from .reverse import onnx_qdq_to_encodings, strip_qdq

__all__ = ["encodings_to_onnx_qdq", "onnx_qdq_to_encodings", "strip_qdq"]
