"""onnxport: PyTorch to deployable ONNX, with every claim checked on the file it wrote.

The public API is re-exported here. Imports are lazy, so reading stats or converting encodings
never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

_EXPORTS = {
    "export_onnx": ".export",
    "ONNXModel": ".runtime",
    "compare_onnx": ".compare.exported",
    "verify_onnx": ".compare.exported",
    "Report": ".compare",
    "OutputResult": ".compare",
    "RunResults": ".compare",
    "compare_runs": ".compare",
    "run_onnx": ".compare",
    "run_torch": ".compare",
    "ComparisonReport": ".compare.exported",
    "OutputComparison": ".compare.exported",
    "save_model": ".engine",
    "OnnxportError": ".errors",
    "InvalidArgumentError": ".errors",
    "ExportRefusedError": ".errors",
    "WriteError": ".errors",
    "DependencyError": ".errors",
    "UnsafeExternalDataError": ".errors",
    "VacuousCheckWarning": ".errors",
    "WeakerCheckWarning": ".errors",
    "PerformanceWarning": ".errors",
    "RuntimePrecisionWarning": ".errors",
    "OnnxportWarning": ".errors",
    "Quantizer": ".quantize",
    "QuantSpec": ".quantize",
    "quant_spec": ".quantize",
    "precision_table": ".quantize",
    "sensitivity": ".qdq.sensitivity",
    "quantize_within_budget": ".qdq.sensitivity",
    "BudgetResult": ".qdq.sensitivity",
    "export_qdq": ".qdq.export",
    "qdq_stats": ".qdq.stats",
    "qdq_report": ".qdq.stats",
    "QDQStats": ".qdq.stats",
    "QDQReport": ".qdq.stats",
    "verify_qdq": ".qdq.verify",
    "compare_qdq": ".qdq.verify",
    "QDQComparison": ".qdq.verify",
    "rounding_floor": ".rounding",
    "cpu_int8": "._cpu",
    "CPUInt8": "._cpu",
    "compare_layers": ".qdq.layers",
    "LayerReport": ".qdq.layers",
    "LayerRow": ".qdq.layers",
    "check_target": ".qdq.rules",
    "encodings_to_onnx_qdq": ".encodings",
    "onnx_qdq_to_encodings": ".encodings",
    "strip_qdq": ".encodings",
    "export_pretrained": ".pretrained",
    "PretrainedExport": ".pretrained",
    "export_decoder": ".llm",
    "generate": ".llm",
    "DecoderFile": ".llm",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 -- sorted() is a list; one table holds the names

if TYPE_CHECKING:  # pragma: no cover
    from ._cpu import CPUInt8, cpu_int8
    from .compare import OutputResult, Report, RunResults, compare_runs, run_onnx, run_torch
    from .compare.exported import ComparisonReport, OutputComparison, compare_onnx, verify_onnx
    from .encodings import encodings_to_onnx_qdq, onnx_qdq_to_encodings, strip_qdq
    from .engine import save_model
    from .errors import (
        DependencyError,
        ExportRefusedError,
        InvalidArgumentError,
        OnnxportError,
        OnnxportWarning,
        PerformanceWarning,
        RuntimePrecisionWarning,
        UnsafeExternalDataError,
        VacuousCheckWarning,
        WeakerCheckWarning,
        WriteError,
    )
    from .export import export_onnx
    from .llm import DecoderFile, export_decoder, generate  # type: ignore[no-redef]  # the module, shadowed by name
    from .pretrained import PretrainedExport, export_pretrained
    from .qdq.export import export_qdq
    from .qdq.layers import LayerReport, LayerRow, compare_layers
    from .qdq.rules import check_target
    from .qdq.sensitivity import BudgetResult, quantize_within_budget, sensitivity
    from .qdq.stats import QDQReport, QDQStats, qdq_report, qdq_stats
    from .qdq.verify import QDQComparison, compare_qdq, verify_qdq
    from .quantize import Quantizer, QuantSpec, precision_table, quant_spec
    from .rounding import rounding_floor
    from .runtime import ONNXModel


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxport' has no attribute '{name}'")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
