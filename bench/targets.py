"""Deployment presets on ONNX Runtime: ResNet-18 and a MobileNetV2-style net at 224×224, batch 1
and 8 — each preset's Q/DQ file vs the FP32 export and vs ONNX Runtime's own quantize_static file.

    python -m bench.targets
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from bench._timing import latencies, speedup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models import MobileNetV2Small, ResNet18


def run(out_dir: Path | None = None) -> dict:
    from onnxport import Quantizer, export_onnx, export_qdq
    from onnxport.inspection.stats import ort_int8_counts

    out = Path(out_dir or tempfile.mkdtemp(prefix="onnxport-bench-targets-"))
    results: dict = {}
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
        entry = latencies(files)
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
    lines = ["Deployment presets on ONNX Runtime (CPU), 224x224, median of 30 runs; × = speed-up"]
    for name, entry in results.items():
        lines.append(f"  {name}")
        lines.append(f"    {'file':<20} {'b1 ms':>7} {'×FP32':>6} {'×ORT':>5} {'b8 ms':>7} {'×FP32':>6} {'×ORT':>5} {'INT8 convs':>11}")
        for file, e in entry.items():
            lines.append(
                f"    {file:<20} {e['batch1_ms']:>7.2f} {e['batch1_vs_fp32']:>6.2f} {e['batch1_vs_ort']:>5.2f} "
                f"{e['batch8_ms']:>7.2f} {e['batch8_vs_fp32']:>6.2f} {e['batch8_vs_ort']:>5.2f} {e['int8_convs']:>11}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
