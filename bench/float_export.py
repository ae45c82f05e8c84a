"""export_onnx on ResNet-18 (224×224): ONNX Runtime latency of FP32, static INT8 and dynamic INT8.

    python -m bench.float_export

Prints a table of median latencies at batch 1 and 8 with the speed-up over FP32 measured in the
same run, and returns the figures as a dict (``python -m bench`` collects them).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench._framework import cell, scratch, table
from bench._timing import LatencyConfig, latencies, speedup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models import ResNet18


@dataclass(frozen=True)
class Config(LatencyConfig):
    """What one run measures: the repeat count and where the files go (see :class:`LatencyConfig`)."""


def run(config: Config = Config()) -> dict:
    with scratch(config.out_dir, "onnxport-bench-") as out:
        return _measure(config, out)


def _measure(config: Config, out: Path) -> dict:
    from onnxport import export_onnx
    from onnxport.inspection.stats import ort_optimised_ops

    torch.manual_seed(0)
    model = ResNet18().eval()
    sample = torch.randn(1, 3, 224, 224)
    calibration = [torch.randn(8, 3, 224, 224) for _ in range(4)]
    files = {}
    export_s = {}
    for name, kwargs in [
        ("fp32", {}),
        ("int8_static", {"quantize": True, "quantize_mode": "static", "calibration_data": calibration}),
        ("int8_dynamic", {"quantize": True}),
    ]:
        start = time.perf_counter()
        files[name] = export_onnx(model, sample, out / f"resnet18_{name}.onnx", **kwargs)
        export_s[name] = time.perf_counter() - start
    results: dict = {"repeat": config.repeat, "model": "ResNet-18 224x224", "files": latencies(files, repeat=config.repeat)}
    for name, path in files.items():
        entry = results["files"][name]
        entry["export_s"] = export_s[name]
        entry["size_mb"] = path.stat().st_size / 1e6
        entry["ort_qlinearconv"] = ort_optimised_ops(path)["QLinearConv"]
        for batch in (1, 8):
            entry[f"batch{batch}_speedup"] = speedup(entry, results["files"]["fp32"], batch)
    return results


def report(results: dict) -> str:
    rows = [[name, cell(e["size_mb"], ".1f"), cell(e["export_s"], ".1f"), cell(e["batch1_ms"], ".2f"),
             cell(e["batch1_speedup"], ".2f"), cell(e["batch8_ms"], ".2f"), cell(e["batch8_speedup"], ".2f"),
             e["ort_qlinearconv"]] for name, e in results["files"].items()]
    return table(["file", "MB", "export s", "b1 ms", "b1 x FP32", "b8 ms", "b8 x FP32", "QLinearConv"], rows,
                 title=f"export_onnx — {results['model']}, ONNX Runtime CPU, median of {results.get('repeat', 30)} runs")


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["float_export", *sys.argv[1:]]))
