"""The built-in demo: a small ResNet-style CNN, trained for seconds on procedurally drawn images,
taken down every path onnxport has, with one summary table and a JSON report.

Nothing is downloaded: the data set is drawn at run time from a fixed seed.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._core.io import write_text_atomic
from ._core.ir import opset_of

CLASSES = ("disc", "square", "cross", "stripes", "ring")


# -- data ---------------------------------------------------------------------------------------------
def draw_images(n: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` RGB images of five procedurally drawn shapes at random places, sizes and colours."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
    cy = size / 2 + (torch.rand(n, 1, 1, generator=g) - 0.5) * size * 0.4
    cx = size / 2 + (torch.rand(n, 1, 1, generator=g) - 0.5) * size * 0.4
    r = size * (0.15 + 0.15 * torch.rand(n, 1, 1, generator=g))
    dy, dx = yy - cy, xx - cx
    dist = torch.sqrt(dy**2 + dx**2)
    masks = torch.stack([
        (dist < r).float(),                                                       # disc
        ((dy.abs() < r) & (dx.abs() < r)).float(),                                # square
        (((dy.abs() < r / 4) & (dx.abs() < r)) | ((dx.abs() < r / 4) & (dy.abs() < r))).float(),  # cross
        (torch.sin(yy * 6.28 / (r / 1.5)) > 0).float() * (dist < r * 1.4).float(),  # stripes
        ((dist < r) & (dist > r * 0.6)).float(),                                  # ring
    ], 1)[torch.arange(n), labels]
    colour = 0.4 + 0.6 * torch.rand(n, 3, 1, 1, generator=g)
    background = 0.3 * torch.rand(n, 3, 1, 1, generator=g)
    images = background + masks.unsqueeze(1) * colour + 0.45 * torch.randn(n, 3, size, size, generator=g)
    return (images - 0.5) / 0.5, labels


# -- model --------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class DemoNet(nn.Module):
    """A small ResNet-style classifier: a stem, three residual stages, global pooling, a linear head."""

    def __init__(self, classes: int = len(CLASSES), width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = _Block(width, width, 1)
        self.layer2 = _Block(width, width * 2, 2)
        self.layer3 = _Block(width * 2, width * 4, 2)
        self.head = nn.Linear(width * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, progress: bool) -> list[float]:
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    losses = []
    model.train()
    g = torch.Generator().manual_seed(1)
    for _ in tqdm(range(steps), desc="training", unit="step", leave=False, disable=not progress):
        idx = torch.randint(0, len(x), (64,), generator=g)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


# -- measuring ----------------------------------------------------------------------------------------
# -- the demo -----------------------------------------------------------------------------------------
def run_demo(out: str | Path = "onnxport-demo", quick: bool = False, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """Run every onnxport path on the built-in model and data; write files and ``report.json`` to ``out``.

    Returns the report (also printed as a table by the CLI).
    """
    import onnx

    from . import (
        Quantizer,
        compare_onnx,
        encodings_to_onnx_qdq,
        export_onnx,
        export_qdq,
        onnx_qdq_to_encodings,
        qdq_report,
        qdq_stats,
        save_model,
        strip_qdq,
        verify_qdq,
    )
    from .runtime import ONNXModel, interleaved_ms, make_session

    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # --quick is a look at every path, not a measurement: two latency rounds (of 8 files) instead
    # of 24 (four took 19 of its 101 s on a 2-core EPYC; 24 took most of the test suite's time)
    n_train, steps, rounds = (1536, 120, 2) if quick else (4096, 400, 24)
    x_train, y_train = draw_images(n_train, seed)
    x_test, y_test = draw_images(512, seed + 1)
    model = DemoNet()
    t0 = time.perf_counter()
    losses = train(model, x_train, y_train, steps, progress)
    with torch.no_grad():
        float_logits = model(x_test)
    accuracy = float((float_logits.argmax(1) == y_test).float().mean())
    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__},
        "training": {"images": n_train, "steps": steps, "seconds": time.perf_counter() - t0,
                     "final_loss": statistics.mean(losses[-10:]), "test_accuracy": accuracy},
        "files": {},
    }
    sample = x_test[:8]
    paths: dict[str, Path] = {}
    calibration = [(x_train[i : i + 64], y_train[i : i + 64]) for i in range(0, 512, 64)]
    rows: dict[str, dict[str, Any]] = report["files"]

    def record(name: str, path: Path, reference: torch.Tensor, **extra: Any) -> None:
        stats = qdq_stats(path)
        runner = ONNXModel(path)
        rows[name] = {
            "file": path.name, "kib": path.stat().st_size / 1024, "n_quantize": stats.n_quantize,
            "n_dequantize": stats.n_dequantize,
            "top1_agreement": float((runner(x_test).argmax(1) == reference.argmax(1)).float().mean()), **extra,
        }
        paths[name] = path

    fp32 = export_onnx(model, sample, out / "fp32.onnx")
    comparison = compare_onnx(model, fp32, x_test[:64], rounding_floor=True)
    record("fp32", fp32, float_logits, verified=comparison.passed, max_abs_error=comparison.outputs[0].max_abs_error)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ConvInteger PerformanceWarning is the point of this row
        dyn = export_onnx(model, sample, out / "ort_dynamic_int8.onnx", quantize=True)
    record("ort_dynamic_int8", dyn, float_logits)
    static = export_onnx(model, sample, out / "ort_static_int8.onnx", quantize=True, quantize_mode="static",
                         calibration_data=calibration)
    record("ort_static_int8", static, float_logits)

    quantized = Quantizer().quantize(model, calibration)
    with torch.no_grad():
        q_logits = quantized(x_test)
    report["pt2e"] = {"top1_vs_float": float((q_logits.argmax(1) == float_logits.argmax(1)).float().mean()),
                      "test_accuracy": float((q_logits.argmax(1) == y_test).float().mean())}
    for name, kwargs in [("qdq_int8", {}), ("qdq_uint8", {"activation_dtype": "uint8"}), ("qdq_opset17", {"opset_version": 17})]:
        path = export_qdq(quantized, sample, out / f"{name}.onnx", dynamic_batch=True, **kwargs)
        record(name, path, q_logits, verify_qdq=verify_qdq(quantized, path, x_test, n_batches=8),
               opset=opset_of(onnx.load(str(path), load_external_data=False)))
    fast = Quantizer(target="onnxruntime").quantize(model, calibration)
    with torch.no_grad():
        fast_logits = fast(x_test)
    path = export_qdq(fast, sample, out / "qdq_onnxruntime.onnx", dynamic_batch=True)
    ort_counts = qdq_report(path).extra["ort_int8"]
    record("qdq_onnxruntime", path, fast_logits, verify_qdq=verify_qdq(fast, path, x_test, n_batches=8),
           ort_int8_convs=f"{ort_counts['Conv']['int8']}/{ort_counts['Conv']['int8'] + ort_counts['Conv']['float']}")

    # AIMET round trip: the Q/DQ file's encodings, written as a 2.0.0 file, rebuild the same file.
    qdq = onnx.load(str(out / "qdq_int8.onnx"))
    encodings = onnx_qdq_to_encodings(qdq)
    write_text_atomic(out / "qdq_int8.encodings", json.dumps(encodings, indent=1))
    save_model(strip_qdq(qdq), out / "float_from_qdq.onnx")
    rebuilt = encodings_to_onnx_qdq(out / "float_from_qdq.onnx", out / "qdq_int8.encodings", prequantize_constants=True,
                                    force_activation_as=None, derive_data_movement=False)
    save_model(rebuilt, out / "qdq_from_encodings.onnx")
    feeds = {"input": x_test[:32].numpy()}
    a = make_session(str(out / "qdq_int8.onnx"), optimized=False).run(None, feeds)[0]
    b = make_session(str(out / "qdq_from_encodings.onnx"), optimized=False).run(None, feeds)[0]
    report["encodings_round_trip"] = {"entries": len(encodings["encodings"]), "byte_identical": a.tobytes() == b.tobytes(),
                                      "max_abs_difference": float(np.max(np.abs(a - b)))}
    record("qdq_from_encodings", out / "qdq_from_encodings.onnx", q_logits)

    timed = {name: per_feed[0] for name, per_feed in interleaved_ms(
        paths, [{"input": x_test[:LATENCY_BATCH].numpy()}], rounds=rounds, runs=_RUNS).items()}
    for name, row in rows.items():
        row["latency_ms"] = statistics.median(timed[name])
        row["speedup_vs_fp32"] = statistics.median(f / t for f, t in zip(timed["fp32"], timed[name]))
    report["latency"] = {"batch": LATENCY_BATCH, "rounds": rounds, "runs_per_round": _RUNS}
    report["seconds"] = time.perf_counter() - started
    write_text_atomic(out / "report.json", json.dumps(report, indent=2, default=str))
    return report


#: the demo's latency batch: at batch 1 its 24x24 CNN runs in a fraction of a millisecond, where
#: session overheads, not INT8 kernels, decide the figure
LATENCY_BATCH = 32
_RUNS = 10


def summary_table(report: dict[str, Any]) -> str:
    t = report["training"]
    lines = [
        (f"trained DemoNet on {t['images']} drawn images, {t['steps']} steps in {t['seconds']:.1f} s: "
        f"test accuracy {t['test_accuracy']:.1%} (pt2e INT8: {report['pt2e']['test_accuracy']:.1%}, "
        f"top-1 agreement with float {report['pt2e']['top1_vs_float']:.1%})"),
        "",
        f"{'file':<26} {'KiB':>7} {'Q':>4} {'DQ':>4} {'top-1 vs torch':>15} {'ORT ms':>8} {'× FP32':>7}  notes",
    ]
    for r in report["files"].values():
        notes = []
        if "verified" in r:
            notes.append(f"verify_onnx {'ok' if r['verified'] else 'FAILED'}")
        if "verify_qdq" in r:
            notes.append(f"verify_qdq {r['verify_qdq']:.1%}")
        if "opset" in r:
            notes.append(f"opset {r['opset']}")
        if "ort_int8_convs" in r:
            notes.append(f"INT8 convs in ORT {r['ort_int8_convs']}")
        lines.append(
            f"{r['file']:<26} {r['kib']:>7.1f} {r['n_quantize']:>4} {r['n_dequantize']:>4} {r['top1_agreement']:>14.1%} "
            f"{r['latency_ms']:>8.3f} {r['speedup_vs_fp32']:>6.2f}×  {', '.join(notes)}"
        )
    rt = report["encodings_round_trip"]
    outcome = "byte-identical outputs" if rt["byte_identical"] else f"max difference {rt['max_abs_difference']:.3g}"
    lines += [
        "",
        f"AIMET encodings round trip: {rt['entries']} entries written to qdq_int8.encodings and converted back: {outcome}",
        "(top-1 vs torch: float rows against the float model, Q/DQ rows against the pt2e model they came from)",
        (f"(ORT ms: batch {report['latency']['batch']}, the median over {report['latency']['rounds']} interleaved rounds of "
         f"{report['latency']['runs_per_round']} runs, each file alone in a fresh session; x FP32: the median of the "
         f"rounds' own ratios)"),
        f"total {report['seconds']:.0f} s",
    ]
    return "\n".join(lines)
