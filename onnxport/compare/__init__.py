"""One comparison model: a run gives :class:`RunResults` (which can be saved and compared later), a
:class:`Strategy` judges each output, :func:`compare_runs` applies it and gives one :class:`Report`.

``compare_onnx``, ``verify_onnx``, ``compare_qdq``, ``verify_qdq``, the exporters' proofs and the
weight-only agreement check are all this: two runs and a strategy.
"""

from __future__ import annotations

from .report import FAITHFUL_COSINE, OutputResult, Report
from .results import RunResults
from .runners import run_onnx, run_torch
from .strategies import (
    CosineAtLeast,
    Exact,
    Measure,
    ScaledAllclose,
    Strategy,
    TopOneAtLeast,
    WithinFloatFloor,
    WithinFloor,
    compare_runs,
    relative_distance,
)

__all__ = [
    "FAITHFUL_COSINE", "CosineAtLeast", "Exact", "Measure", "OutputResult", "Report", "RunResults",
    "ScaledAllclose", "Strategy", "TopOneAtLeast", "WithinFloatFloor", "WithinFloor", "compare_runs",
    "relative_distance", "run_onnx", "run_torch",
]
