"""``target='openvino'`` against NNCF's ``quantize`` of the same model, both run by OpenVINO's CPU
plugin, side by side in one run.

For each model: the FP32 export, our ``'openvino'`` file (pt2e, faithful Q/DQ) and NNCF's
default post-training quantization of the FP32 file (``nncf.quantize`` on the OpenVINO model
converted from it, the same calibration batches; ``model_type=TRANSFORMER`` for text models),
compiled by the CPU plugin at f32 inference precision and timed the way the zoo bench times
ONNX Runtime (each file alone per round, the order rotating, the median of the rounds' ratios).
It also reports what each file's INT8 layers are (the plugin's runtime graph) and how close each
comes, as OpenVINO runs it, to the model it was made from (ours: the pt2e model; NNCF's: the
float model, which is all NNCF promises), and to the float model.

NNCF is installed in an environment of its own (its pins differ from this project's); point
``--nncf-python`` at its interpreter:

    python3 -m venv /tmp/nncf && /tmp/nncf/bin/pip install nncf openvino onnx
    python -m bench openvino --nncf-python /tmp/nncf/bin/python
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._framework import cell, option, scratch, table
from bench.zoo import each_model

MODELS = ("ResNet-50", "MobileNetV2", "BERT 4x256")
WARMUP, RUNS = 3, 6


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: zoo models quantized both ways.
        rounds: latency rounds (each file once per round, the order rotating).
        nncf_python: a Python with NNCF and OpenVINO, for NNCF's column (None: skipped).
        out_dir: keep the files in this folder (None: a temporary one, removed).
    """

    models: tuple[str, ...] = option(MODELS, "zoo models, comma-separated", choices=MODELS)
    rounds: int = option(8, "latency rounds (each file once per round, the order rotating)")
    nncf_python: str | None = option(None, "a Python with nncf and openvino installed (NNCF's column; default: skipped)")
    out_dir: str | None = option(None, "keep the files in this folder (default: a temporary one, removed)")

    def check(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")

#: run by NNCF's interpreter: the float file → OpenVINO model → nncf.quantize → IR
_NNCF = r"""
import json, sys
import numpy as np, nncf, openvino as ov
fp32, data, out, transformer = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
batches = [np.load(data)[k] for k in sorted(np.load(data).files)]
model = ov.convert_model(fp32)
kwargs = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
quantized = nncf.quantize(model, nncf.Dataset(batches), subset_size=sum(len(b) for b in batches), **kwargs)
ov.save_model(quantized, out, compress_to_fp16=False)
print(json.dumps({"nncf": nncf.__version__, "openvino": ov.__version__}))
"""


def _compile(path: Path):
    import openvino as ov

    return ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"})


def _int8_layers(compiled) -> dict[str, str]:
    counts: Counter = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer, precision = info["layerType"].astype(str), info["runtimePrecision"].astype(str)
        if layer in ("Convolution", "GroupConvolution", "FullyConnected", "MatMul"):
            counts[layer, precision.lower() in ("i8", "u8")] += 1
    return {layer: f"{counts[layer, True]}/{counts[layer, True] + counts[layer, False]}"
            for layer in sorted({key[0] for key in counts})}


def _latencies(files: dict[str, Path], data: np.ndarray, rounds_wanted: int) -> dict[str, list[float]]:
    import gc

    rounds: dict[str, list[float]] = {name: [] for name in files}
    names = list(files)
    for turn in range(rounds_wanted):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            compiled = _compile(files[name])
            request = compiled.create_infer_request()
            for _ in range(WARMUP):
                request.infer([data])
            times = []
            for _ in range(RUNS):
                start = time.perf_counter()
                request.infer([data])
                times.append((time.perf_counter() - start) * 1000)
            rounds[name].append(statistics.median(times))
            del request, compiled
            gc.collect()
    return rounds


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _one(entry, out: Path, config: Config) -> dict:
    import torch

    from onnxport import Quantizer, export_onnx, export_qdq

    model = entry.model()
    calibration = [entry.sample(batch=4, seed=10 + i) for i in range(4)]
    sample, check = entry.sample(batch=1), entry.sample(batch=8, seed=3)
    files = {"fp32": export_onnx(model, sample, out / "fp32.onnx")}
    quantized = Quantizer(target="openvino").quantize(model, calibration)
    files["ours"] = export_qdq(quantized, sample, out / "openvino.onnx", dynamic_batch=True)
    result: dict = {}
    nncf_python = config.nncf_python
    if nncf_python:
        np.savez(out / "calibration.npz", **{f"b{i}": b.numpy() for i, b in enumerate(calibration)})
        done = subprocess.run([nncf_python, "-c", _NNCF, str(files["fp32"]), str(out / "calibration.npz"),
                               str(out / "nncf.xml"), "1" if entry.kind == "tokens" else "0"],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            files["nncf"] = out / "nncf.xml"
            result["versions"] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            result["nncf_error"] = done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else "failed"
    with torch.no_grad():
        float_out = torch.utils._pytree.tree_leaves(model(check))[0].numpy()
        pt2e_out = torch.utils._pytree.tree_leaves(quantized(check))[0].numpy()
    result["int8_layers"], result["cosine"] = {}, {}
    for name, path in files.items():
        compiled = _compile(path)
        got = np.asarray(compiled([check.numpy()])[compiled.outputs[0]])
        result["int8_layers"][name] = _int8_layers(compiled)
        result["cosine"][name] = {"vs_float": _cosine(got, float_out)}
        if name == "ours":
            result["cosine"][name]["vs_pt2e"] = _cosine(got, pt2e_out)
            result["cosine"][name]["top1_vs_pt2e"] = float((got.argmax(-1) == pt2e_out.argmax(-1)).mean())
    rounds = _latencies(files, sample.numpy(), config.rounds)
    result["latency_ms"] = {name: statistics.median(ms) for name, ms in rounds.items()}
    result["speedup"] = {name: statistics.median(f / t for f, t in zip(rounds["fp32"], ms)) for name, ms in rounds.items()}
    if "nncf" in rounds:
        result["ours_vs_nncf"] = statistics.median(n / o for n, o in zip(rounds["nncf"], rounds["ours"]))
    return result


def run(config: Config = Config()) -> dict:
    import logging

    from onnxport import cpu_int8

    logging.getLogger("torch").setLevel(logging.ERROR)
    results: dict = {"_isa": cpu_int8().describe(), "_nncf": config.nncf_python or "not given (--nncf-python)",
                     "_rounds": config.rounds}
    with scratch(config.out_dir, "onnxport-bench-openvino-") as out:
        results.update(each_model(config.models, out, lambda entry, folder: _one(entry, folder, config)))
    return results


def report(results: dict) -> str:
    rows = []
    for name, e in results.items():
        if name.startswith("_"):
            continue
        s, c, layers = e["speedup"], e["cosine"], e["int8_layers"]
        rows.append([name, f"{s['ours']:.2f}x", f"{s['nncf']:.2f}x" if "nncf" in s else e.get("nncf_error", "-"),
                     cell(e.get("ours_vs_nncf"), ".2f"), f"{c['ours']['vs_pt2e']:.6f}, {c['ours']['top1_vs_pt2e']:.2f}",
                     cell(c["ours"]["vs_float"], ".4f"), cell(c.get("nncf", {}).get("vs_float"), ".4f"),
                     ", ".join(f"{k} {v}" for k, v in layers["ours"].items()),
                     ", ".join(f"{k} {v}" for k, v in layers.get("nncf", {}).items()) or "-"])
    return table(["model", "ours", "NNCF", "ours / NNCF", "ours vs pt2e (cos, top-1)", "ours vs float", "NNCF vs float",
                  "INT8 layers (ours)", "INT8 layers (NNCF)"], rows, title=[
        "target='openvino' against NNCF's quantize of the same model, in OpenVINO's CPU plugin (x = FP32 latency /",
        "file latency, median of the rounds' ratios; ours/NNCF = NNCF latency / ours), batch 1.",
        f"CPU: {results.get('_isa', 'see the run results file')}; NNCF: {results.get('_nncf')}"])



if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["openvino", *sys.argv[1:]]))
