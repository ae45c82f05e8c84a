"""export_qdq on ResNet-18 (224×224): export time vs bare torch.onnx.export, and ORT latency of
our int8/uint8 Q/DQ files vs the FP32 export and ONNX Runtime's own quantize_static file.

    python -m bench.qdq_export
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
    with scratch(config.out_dir, "onnxport-bench-qdq-") as out:
        return _measure(config, out)


def _measure(config: Config, out: Path) -> dict:
    from onnxport import Quantizer, export_onnx, export_qdq
    from onnxport.inspection.stats import ort_optimised_ops

    torch.manual_seed(0)
    model = ResNet18().eval()
    calib = [torch.randn(8, 3, 224, 224) for _ in range(4)]
    sample = torch.randn(8, 3, 224, 224)
    quantized = Quantizer().quantize(model, calib)

    # Same settings on both sides (dynamic batch, opset 18); median of three runs each.
    bare, ours = [], []
    for _ in range(3):
        start = time.perf_counter()
        torch.onnx.export(quantized, (sample,), str(out / "bare.onnx"), dynamo=True, opset_version=18, verbose=False,
                          dynamic_shapes=({0: torch.export.Dim("batch")},))
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        files = {"qdq_int8": export_qdq(quantized, sample, out / "qdq_int8.onnx", dynamic_batch=True)}
        ours.append(time.perf_counter() - start)
    bare_s, ours_s = sorted(bare)[1], sorted(ours)[1]
    files["qdq_uint8"] = export_qdq(quantized, sample, out / "qdq_uint8.onnx", activation_dtype="uint8", dynamic_batch=True)
    files["fp32"] = export_onnx(model, sample, out / "fp32.onnx")
    files["ort_quantize_static"] = export_onnx(
        model, sample, out / "ort_static.onnx", quantize=True, quantize_mode="static", calibration_data=calib
    )
    results: dict = {"repeat": config.repeat, "export_s": {"torch.onnx.export": bare_s, "export_qdq": ours_s, "ratio": ours_s / bare_s},
                     "files": latencies(files, repeat=config.repeat)}
    for name, path in files.items():
        entry = results["files"][name]
        entry["ort_qlinearconv"] = ort_optimised_ops(path)["QLinearConv"]
        for batch in (1, 8):
            entry[f"batch{batch}_speedup"] = speedup(entry, results["files"]["fp32"], batch)
    return results


def report(results: dict) -> str:
    e = results["export_s"]
    rows = [[name, cell(r["batch1_ms"], ".2f"), cell(r["batch1_speedup"], ".2f"), cell(r["batch8_ms"], ".2f"),
             cell(r["batch8_speedup"], ".2f"), r["ort_qlinearconv"]] for name, r in results["files"].items()]
    return table(["file", "b1 ms", "b1 x FP32", "b8 ms", "b8 x FP32", "QLinearConv (of 20)"], rows,
                 title=[(f"export_qdq — ResNet-18 224x224 (pt2e defaults), ONNX Runtime CPU, median of "
                        f"{results.get('repeat', 30)} runs"),
                        (f"export time: export_qdq {e['export_qdq']:.1f} s vs bare torch.onnx.export "
                        f"{e['torch.onnx.export']:.1f} s = {e['ratio']:.2f}x")])


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["qdq_export", *sys.argv[1:]]))
