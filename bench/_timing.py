"""Latency measurement shared by the benchmarks."""

from __future__ import annotations

import statistics
import time

import numpy as np
import onnxruntime as ort


def ort_latency_ms(path: str, feeds: dict[str, np.ndarray], *, repeat: int = 30, warmup: int = 5) -> float:
    """Median wall time of one ONNX Runtime run, default optimisation level, in milliseconds."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for _ in range(warmup):
        session.run(None, feeds)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ops_after_ort_optimisation(path: str, out_path: str) -> dict[str, int]:
    """Operator counts of the graph ONNX Runtime actually runs (its optimised graph)."""
    import onnx

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(out_path)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    counts: dict[str, int] = {}
    for node in onnx.load(str(out_path)).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
