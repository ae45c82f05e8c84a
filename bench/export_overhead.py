"""What export_qdq costs over a bare ``torch.onnx.export`` of the same pt2e model: wall time,
peak memory, ONNX Runtime sessions and whole-model proto copies, on ResNet-50 (224x224) and a
4-layer BERT (sequence 128).

Time: the model is built and quantized once in a process; after one warm-up export of each
kind, bare and ours alternate five times (median reported), so both sides see the same machine.
Peak memory: one export in a fresh process each, counted from the quantized model in memory.
``--against /path/to/other/checkout`` adds rows for another onnxport (an older commit) measured in
the same run.

    python -m bench export_overhead [--models BERT] [--repeats 9] [--against ../older-checkout]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench._framework import option, table

HERE = Path(__file__).resolve().parent
MODELS = ("ResNet-50", "BERT")
REPEATS = 5


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: ResNet-50 and/or the 4-layer BERT.
        repeats: alternating bare / export_qdq exports behind each median.
        against: another onnxport checkout measured in the same run (None: none).
    """

    models: tuple[str, ...] = option(MODELS, "models, comma-separated", choices=MODELS)
    repeats: int = option(REPEATS, "alternating bare / export_qdq exports behind each median")
    against: str | None = option(None, "another onnxport checkout, measured in the same run")

    def check(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")

_CHILD = r"""
import json, statistics, sys, tempfile, time, warnings
from pathlib import Path
sys.path.append(sys.argv[2])  # the bench's checkout, for the test models (onnxport comes from before it)
import torch
warnings.filterwarnings("ignore")
which, repeats, mode = sys.argv[1], int(sys.argv[3]), sys.argv[4]

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
# the exporter's own share of export_qdq, so that what onnxport adds is measured apart from its noise:
# the engine logs the capture's start and end on the 'onnxport' logger
import logging
class CaptureClock(logging.Handler):
    def emit(self, record):
        message = record.getMessage()
        if message.endswith(": capturing the graph"):
            self.start = record.created
        elif ": captured " in message:
            counts["exporter_s"] = counts.get("exporter_s", 0.0) + record.created - self.start
logging.getLogger("onnxport").addHandler(CaptureClock())
logging.getLogger("onnxport").setLevel(logging.INFO)

def bare(out):
    torch.onnx.export(quantized, (sample,), str(out / "bare.onnx"), dynamo=True, opset_version=18, verbose=False,
                      dynamic_shapes=({0: torch.export.Dim("batch")},))

def ours(out):
    export_qdq(quantized, sample, out / "ours.onnx", dynamic_batch=True)

if mode != "time":  # one export in a fresh process: its peak memory above the quantized model
    with tempfile.TemporaryDirectory() as folder:
        open("/proc/self/clear_refs", "w").write("5")  # peak memory counts from here
        before = rss("VmRSS:")
        (bare if mode == "bare" else ours)(Path(folder))
        print(json.dumps({"peak_above_start": rss("VmHWM:") - before}))
    sys.exit(0)
figures = {"bare": [], "export_qdq": []}
with tempfile.TemporaryDirectory() as folder:
    out = Path(folder)
    bare(out), ours(out)  # warm both: imports, registries, caches
    for _ in range(repeats):
        for name, export in (("bare", bare), ("export_qdq", ours)):
            counts.update(sessions=0, proto_copies=0, exporter_s=0.0)
            start = time.perf_counter()
            export(out)
            figures[name].append({"seconds": time.perf_counter() - start, **counts})
result = {}
for name, runs in figures.items():
    result[name] = {"seconds": statistics.median(r["seconds"] for r in runs),
                    "all_seconds": [round(r["seconds"], 2) for r in runs],
                    "sessions": runs[0]["sessions"], "proto_copies": runs[0]["proto_copies"],
                    "onnxport_s": statistics.median(r["seconds"] - r["exporter_s"] for r in runs) if name != "bare" else 0.0}
print(json.dumps(result))
"""


def _child(model: str, checkout: Path | None, mode: str = "time", repeats: int = REPEATS) -> dict:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = f"{checkout}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with tempfile.TemporaryDirectory() as cwd:  # so that the current folder does not decide which onnxport loads
        done = subprocess.run([sys.executable, "-c", _CHILD, model, str(HERE.parent), str(repeats), mode],
                              capture_output=True, text=True, env=env, cwd=cwd, check=False)
    if done.returncode:
        raise RuntimeError(f"{model}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(config: Config = Config()) -> dict:
    results: dict = {"_repeats": config.repeats}
    for model in config.models:
        entry = {}
        checkouts = [("", None)] + ([(" (other checkout)", Path(config.against))] if config.against else [])
        for label, checkout in checkouts:
            measured = _child(model, checkout, repeats=config.repeats)
            bare, ours = measured["bare"], measured["export_qdq"]
            bare["peak_above_start"] = _child(model, checkout, "bare")["peak_above_start"]
            ours["peak_above_start"] = _child(model, checkout, "ours")["peak_above_start"]
            ours["time_vs_bare"] = ours["seconds"] / bare["seconds"]
            ours["checks_vs_bare"] = (bare["seconds"] + ours["onnxport_s"]) / bare["seconds"]
            ours["peak_vs_bare"] = ours["peak_above_start"] / max(1, bare["peak_above_start"])
            entry[f"bare{label}"], entry[f"export_qdq{label}"] = bare, ours
            print(f"    {model}{label}: bare {bare['all_seconds']}, export_qdq {ours['all_seconds']}",
                  file=sys.stderr, flush=True)
        results[model] = entry
    return results


def report(results: dict) -> str:
    rows = [[model, name, f"{f['seconds']:.1f}", f"{f.get('time_vs_bare', 1.0):.2f}", f"{f.get('onnxport_s', 0.0):.2f}",
             f"{f.get('checks_vs_bare', 1.0):.2f}", f"{f['peak_above_start'] / 2**20:.0f}", f"{f.get('peak_vs_bare', 1.0):.2f}",
             f["sessions"], f["proto_copies"]]
            for model, entry in results.items() if not model.startswith("_") for name, f in entry.items()]
    return table(["model", "exporter", "seconds", "x bare", "onnxport s", "x bare*", "peak MB", "x bare (peak)",
                  "ORT sessions", "proto copies"], rows,
                 title=("export_qdq against a bare torch.onnx.export of the same pt2e model (interleaved in one process, "
                        f"median of {results.get('_repeats', REPEATS)})"),
                 notes=[("onnxport s: export_qdq's time outside the torch exporter; x bare*: bare + that, over bare — "
                        "the overhead without the exporter's run-to-run noise")])


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["export_overhead", *sys.argv[1:]]))
