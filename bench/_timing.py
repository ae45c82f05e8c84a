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


def latencies(files: dict, batches: tuple[int, ...] = (1, 8), side: int = 224) -> dict[str, dict[str, float]]:
    """``{name: {"batch1_ms": …, "batch8_ms": …}}`` for image models, every file fed the same input."""
    import torch

    table: dict[str, dict[str, float]] = {name: {} for name in files}
    for batch in batches:
        feeds = {"input": torch.randn(batch, 3, side, side).numpy()}
        for name, path in files.items():
            table[name][f"batch{batch}_ms"] = ort_latency_ms(str(path), feeds)
    return table


def speedup(entry: dict, baseline: dict, batch: int) -> float:
    """How many times faster ``entry`` ran than ``baseline`` at ``batch``."""
    return baseline[f"batch{batch}_ms"] / entry[f"batch{batch}_ms"]
