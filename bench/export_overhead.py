"""What export_qdq costs over a bare ``torch.onnx.export`` of the same pt2e model: wall time,
peak memory, ONNX Runtime sessions and whole-model proto copies, on ResNet-50 (224x224) and a
4-layer BERT (sequence 128).

Each figure comes from a fresh process (the model built and quantized there, then peak memory
reset before the export), interleaved bare / ours and best of two, so both sides see the same
machine. Set ``ONNXPORT_BENCH_AGAINST=/path/to/other/checkout`` to add a column for another
onnxport (an older commit) measured in the same run.

    python -m bench export_overhead
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ("ResNet-50", "BERT")
REPEATS = 2

_CHILD = r"""
import json, sys, tempfile, time, warnings
from pathlib import Path
sys.path.append(sys.argv[3])  # the bench's checkout, for the test models (onnxport comes from before it)
import torch
warnings.filterwarnings("ignore")
which, side = sys.argv[1], sys.argv[2]

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0

torch.manual_seed(0)
if which == "ResNet-50":
    from bench.layers import ResNet50
    model, data = ResNet50().eval(), torch.randn(3, 3, 224, 224)
    calibration, sample = [data[:2]], data[2:3]
else:
    from bench.layers import _bert
    model, tokens = _bert(), torch.randint(0, 2000, (5, 128))
    calibration, sample = [tokens[:4]], tokens[4:5]
from onnxport import Quantizer, export_qdq
quantized = Quantizer().quantize(model, calibration)

import onnxruntime, onnx_ir
counts = {"sessions": 0, "proto_copies": 0}
session_class, to_proto = onnxruntime.InferenceSession, onnx_ir.to_proto
class Counted(session_class):
    def __init__(self, *args, **kwargs):
        counts["sessions"] += 1
        super().__init__(*args, **kwargs)
def counted_to_proto(*args, **kwargs):
    counts["proto_copies"] += 1
    return to_proto(*args, **kwargs)
onnxruntime.InferenceSession, onnx_ir.to_proto = Counted, counted_to_proto

with tempfile.TemporaryDirectory() as out:
    open("/proc/self/clear_refs", "w").write("5")  # peak memory counts from here
    before = rss("VmRSS:")
    start = time.perf_counter()
    if side == "bare":
        torch.onnx.export(quantized, (sample,), str(Path(out) / "bare.onnx"), dynamo=True, opset_version=18,
                          verbose=False, dynamic_shapes=({0: torch.export.Dim("batch")},))
    else:
        export_qdq(quantized, sample, Path(out) / "ours.onnx", dynamic_batch=True)
    seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_above_start": rss("VmHWM:") - before, **counts}))
"""


def _child(model: str, side: str, checkout: Path | None) -> dict:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = f"{checkout}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with tempfile.TemporaryDirectory() as cwd:  # so that the current folder does not decide which onnxport loads
        done = subprocess.run([sys.executable, "-c", _CHILD, model, side, str(HERE.parent)], capture_output=True,
                              text=True, env=env, cwd=cwd, check=False)
    if done.returncode:
        raise RuntimeError(f"{model} / {side}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run() -> dict:
    against = os.environ.get("ONNXPORT_BENCH_AGAINST")
    sides = {"bare": ("bare", None), "export_qdq": ("ours", None)}
    if against:
        sides["export_qdq (other checkout)"] = ("ours", Path(against))
    results: dict = {}
    for model in MODELS:
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for _ in range(REPEATS):
            for name, (side, checkout) in sides.items():
                runs[name].append(_child(model, side, checkout))
                print(f"    {model} {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
        best = {name: min(rs, key=lambda r: r["seconds"]) for name, rs in runs.items()}
        entry = {name: {**figures, "peak_above_start": min(r["peak_above_start"] for r in runs[name])}
                 for name, figures in best.items()}
        for name in sides:
            if name != "bare":
                entry[name]["time_vs_bare"] = entry[name]["seconds"] / entry["bare"]["seconds"]
                entry[name]["peak_vs_bare"] = entry[name]["peak_above_start"] / max(1, entry["bare"]["peak_above_start"])
        results[model] = entry
    return results


def report(results: dict) -> str:
    lines = ["export_qdq against a bare torch.onnx.export of the same pt2e model (fresh process each, best of "
             f"{REPEATS})",
             f"  {'model':<10} {'exporter':<28} {'seconds':>8} {'x bare':>7} {'peak MB':>8} {'x bare':>7} "
             f"{'ORT sessions':>12} {'proto copies':>12}"]
    for model, entry in results.items():
        for name, f in entry.items():
            lines.append(
                f"  {model:<10} {name:<28} {f['seconds']:>8.1f} {f.get('time_vs_bare', 1.0):>7.2f} "
                f"{f['peak_above_start'] / 2**20:>8.0f} {f.get('peak_vs_bare', 1.0):>7.2f} {f['sessions']:>12} "
                f"{f['proto_copies']:>12}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
