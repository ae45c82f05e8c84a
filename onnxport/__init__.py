"""onnxport: PyTorch to deployable ONNX, with every claim checked on the file it wrote.

The public API is re-exported here. Imports are lazy, so reading stats or converting encodings
never pays for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._core.lazy import lazy_names
from ._version import __version__

_EXPORTS = {
    "export_onnx": ".exporters.float",
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
    "sensitivity": ".debug.sensitivity",
    "quantize_within_budget": ".debug.sensitivity",
    "BudgetResult": ".debug.sensitivity",
    "export_qdq": ".exporters.qdq",
    "qdq_stats": ".inspection.stats",
    "qdq_report": ".inspection.stats",
    "QDQStats": ".inspection.stats",
    "QDQReport": ".inspection.stats",
    "verify_qdq": ".compare.quantized",
    "compare_qdq": ".compare.quantized",
    "QDQComparison": ".compare.quantized",
    "rounding_floor": ".rounding",
    "cpu_int8": "._core.cpu",
    "CPUInt8": "._core.cpu",
    "compare_layers": ".debug.layers",
    "LayerReport": ".debug.layers",
    "LayerRow": ".debug.layers",
    "check_target": ".inspection.rules",
    "encodings_to_onnx_qdq": ".encodings",
    "onnx_qdq_to_encodings": ".encodings",
    "strip_qdq": ".encodings",
    "export_pretrained": ".pretrained",
    "PretrainedExport": ".pretrained",
    "export_decoder": ".llm",
    "generate": ".llm",
    "DecoderFile": ".llm",
    "export_seq2seq": ".llm",
    "Seq2SeqFiles": ".llm",
    "Seq2SeqGenerator": ".llm",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 -- sorted() is a list; one table holds the names

if TYPE_CHECKING:  # pragma: no cover
    from ._core.cpu import CPUInt8, cpu_int8
    from .compare import OutputResult, Report, RunResults, compare_runs, run_onnx, run_torch
    from .compare.exported import ComparisonReport, OutputComparison, compare_onnx, verify_onnx
    from .compare.quantized import QDQComparison, compare_qdq, verify_qdq
    from .debug.layers import LayerReport, LayerRow, compare_layers
    from .debug.sensitivity import BudgetResult, quantize_within_budget, sensitivity
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
    from .exporters.float import export_onnx
    from .exporters.qdq import export_qdq
    from .inspection.rules import check_target
    from .inspection.stats import QDQReport, QDQStats, qdq_report, qdq_stats
    from .llm import DecoderFile, Seq2SeqFiles, Seq2SeqGenerator, export_decoder, export_seq2seq, generate
    from .pretrained import PretrainedExport, export_pretrained
    from .quantize import Quantizer, QuantSpec, precision_table, quant_spec
    from .rounding import rounding_floor
    from .runtime import ONNXModel


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
