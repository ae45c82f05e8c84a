"""Small pure graph rewrites: each does one thing, is idempotent, and returns a new model."""

from .lower_opset import lower_opset

__all__ = ["lower_opset"]
