"""Latency measurement shared by the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from bench._framework import option
from onnxport.runtime import ONNXModel


@dataclass(frozen=True)
class LatencyConfig:
    """What a run of a file-latency benchmark measures (each benchmark subclasses it as its Config).

    Attributes:
        repeat: ONNX Runtime runs behind each median latency.
        out_dir: where the files are written and kept (None: a temporary folder, removed).
    """

    repeat: int = option(30, "ONNX Runtime runs behind each median latency")
    out_dir: str | None = option(None, "keep the files in this folder (default: a temporary one, removed)")

    def check(self) -> None:
        if self.repeat < 1:
            raise ValueError("--repeat must be at least 1")


def ort_latency_ms(path: str, feeds: dict, *, repeat: int = 30, warmup: int = 5) -> float:
    """Median wall time of one ONNX Runtime run, default optimisation level, in milliseconds."""
    return ONNXModel(path).latency_ms(repeat=repeat, warmup=warmup, **feeds)


def latencies(files: dict, batches: tuple[int, ...] = (1, 8), side: int = 224, repeat: int = 30) -> dict[str, dict[str, float]]:
    """``{name: {"batch1_ms": …, "batch8_ms": …}}`` for image models, every file fed the same input."""
    import torch

    table: dict[str, dict[str, float]] = {name: {} for name in files}
    for batch in batches:
        feeds = {"input": torch.randn(batch, 3, side, side).numpy()}
        for name, path in files.items():
            table[name][f"batch{batch}_ms"] = ort_latency_ms(str(path), feeds, repeat=repeat)
    return table


def speedup(entry: dict, baseline: dict, batch: int) -> float:
    """How many times faster ``entry`` ran than ``baseline`` at ``batch``."""
    return baseline[f"batch{batch}_ms"] / entry[f"batch{batch}_ms"]
