"""The front door: a Hugging Face folder, ``timm:NAME`` or a transformers model of any common task
to a proven ONNX file in one call (:func:`export_pretrained`)."""

from __future__ import annotations

from .export import PretrainedExport, export_pretrained
from .tasks import TASKS, Task

__all__ = ["TASKS", "PretrainedExport", "Task", "export_pretrained"]
