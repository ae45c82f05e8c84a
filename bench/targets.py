"""Deployment presets on ONNX Runtime: ResNet-18 and a MobileNetV2-style net at 224×224, batch 1
and 8 — each preset's Q/DQ file vs the FP32 export and vs ONNX Runtime's own quantize_static file.

    python -m bench.targets
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bench._framework import cell, scratch, table
from bench._timing import LatencyConfig, latencies, speedup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models import MobileNetV2Small, ResNet18


@dataclass(frozen=True)
class Config(LatencyConfig):
    """What one run measures: the repeat count and where the files go (see :class:`LatencyConfig`)."""


def run(config: Config = Config()) -> dict:
    with scratch(config.out_dir, "onnxport-bench-targets-") as out:
        return _measure(config, out)


def _measure(config: Config, out: Path) -> dict:
    from onnxport import Quantizer, export_onnx, export_qdq
    from onnxport.inspection.stats import ort_int8_counts

    results: dict = {"_repeat": config.repeat}
    for name, model in (("ResNet-18", ResNet18()), ("MobileNetV2-style", MobileNetV2Small(num_classes=1000))):
        torch.manual_seed(0)
        model.eval()
        calib = [torch.randn(8, 3, 224, 224) for _ in range(4)]
        sample = torch.randn(8, 3, 224, 224)
        files = {
            "fp32": export_onnx(model, sample, out / f"{name}_fp32.onnx"),
            "ort_quantize_static": export_onnx(model, sample, out / f"{name}_ort.onnx", quantize=True,
                                               quantize_mode="static", calibration_data=calib),
        }
        for target in ("tensorrt", "onnxruntime", "qnn"):
            q = Quantizer(target=target).quantize(model, calib)
            files[target] = export_qdq(q, sample, out / f"{name}_{target}.onnx", dynamic_batch=True)
        entry = latencies(files, repeat=config.repeat)
        for file, path in files.items():
            e = entry[file]
            counts = ort_int8_counts(path)["Conv"]
            e["int8_convs"] = f"{counts['int8']}/{counts['int8'] + counts['float']}"
            for batch in (1, 8):
                e[f"batch{batch}_vs_fp32"] = speedup(e, entry["fp32"], batch)
                e[f"batch{batch}_vs_ort"] = speedup(e, entry["ort_quantize_static"], batch)
        results[name] = entry
    return results


def report(results: dict) -> str:
    repeat = results.get("_repeat", 30)
    rows = [[name, file, cell(e["batch1_ms"], ".2f"), cell(e["batch1_vs_fp32"], ".2f"), cell(e["batch1_vs_ort"], ".2f"),
             cell(e["batch8_ms"], ".2f"), cell(e["batch8_vs_fp32"], ".2f"), cell(e["batch8_vs_ort"], ".2f"), e["int8_convs"]]
            for name, entry in results.items() if not name.startswith("_") for file, e in entry.items()]
    return table(["model", "file", "b1 ms", "b1 x FP32", "b1 x ORT", "b8 ms", "b8 x FP32", "b8 x ORT", "INT8 convs"], rows,
                 title=f"Deployment presets on ONNX Runtime (CPU), 224x224, median of {repeat} runs; x = speed-up")


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["targets", *sys.argv[1:]]))
