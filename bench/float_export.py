"""export_onnx on ResNet-18 (224×224): ONNX Runtime latency of FP32, static INT8 and dynamic INT8.

    python -m bench.float_export

Prints a table of median latencies at batch 1 and 8 with the speed-up over FP32 measured in the
same run, and returns the figures as a dict (``python -m bench`` collects them).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._timing import latencies, speedup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models import ResNet18


def run(out_dir: Path | None = None) -> dict:
    from onnxport import export_onnx
    from onnxport.inspection.stats import ort_optimised_ops

    torch.manual_seed(0)
    model = ResNet18().eval()
    sample = torch.randn(1, 3, 224, 224)
    calibration = [torch.randn(8, 3, 224, 224) for _ in range(4)]
    out = Path(out_dir or tempfile.mkdtemp(prefix="onnxport-bench-"))
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
    results: dict = {"model": "ResNet-18 224x224", "files": latencies(files)}
    for name, path in files.items():
        entry = results["files"][name]
        entry["export_s"] = export_s[name]
        entry["size_mb"] = path.stat().st_size / 1e6
        entry["ort_qlinearconv"] = ort_optimised_ops(path)["QLinearConv"]
        for batch in (1, 8):
            entry[f"batch{batch}_speedup"] = speedup(entry, results["files"]["fp32"], batch)
    return results


def report(results: dict) -> str:
    lines = [
        f"export_onnx — {results['model']}, ONNX Runtime CPU, median of 30 runs",
        f"{'file':<14} {'MB':>6} {'export s':>9} {'b1 ms':>8} {'b1 ×FP32':>9} {'b8 ms':>8} {'b8 ×FP32':>9} {'QLinearConv':>12}",
    ]
    for name, e in results["files"].items():
        lines.append(
            f"{name:<14} {e['size_mb']:>6.1f} {e['export_s']:>9.1f} {e['batch1_ms']:>8.2f} {e['batch1_speedup']:>8.2f}× "
            f"{e['batch8_ms']:>8.2f} {e['batch8_speedup']:>8.2f}× {e['ort_qlinearconv']:>12}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
