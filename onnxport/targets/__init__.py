"""Deployment targets, one module per consumer.

Each module holds one :class:`Target`: how ``Quantizer`` annotates for the consumer
(:class:`Annotation`), the rules ``check_target`` holds its files to (:class:`FileRules`) and what
``export_qdq`` writes when not told (:class:`ExportDefaults`). This package imports nothing of
onnxport above ``errors``, so every layer may read it. Adding a consumer is adding a module and
naming it in ``_MODULES``.
"""

from __future__ import annotations

from ..errors import check_choice
from . import default, onnxruntime, openvino, qnn, tensorrt
from ._base import I8, U8, U16, Annotation, ExportDefaults, FileRules, Target

_MODULES = (tensorrt, onnxruntime, qnn, openvino)

#: The presets, by name.
REGISTRY: dict[str, Target] = {m.TARGET.name: m.TARGET for m in _MODULES}
#: What a model quantized without a target gets.
DEFAULT_TARGET: Target = default.TARGET
#: The names ``target=`` accepts.
TARGETS: tuple[str, ...] = tuple(REGISTRY)


def get_target(name: str | None) -> Target:
    """The :class:`Target` of a preset name (``None``: the default, the seed's file)."""
    if name is None:
        return DEFAULT_TARGET
    check_choice(name, TARGETS, "target")
    return REGISTRY[name]


__all__ = ["DEFAULT_TARGET", "I8", "REGISTRY", "TARGETS", "U8", "U16", "Annotation", "ExportDefaults", "FileRules", "Target",
           "get_target"]
