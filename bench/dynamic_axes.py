"""Symbolic sequence and image sizes: what a dynamic file costs against a static one.

For a text model (the zoo's BERT 4x256 at 128 tokens) and an image model (ResNet-50 at
224x224), FP32 and ``target='onnxruntime'`` files are exported twice from the same model — with
every axis fixed at the traced size, and with symbolic batch and sequence (height and width) —
and timed side by side at the traced size the way the zoo bench times (a fresh session per file
and round, the order rotating, the median of the rounds' own ratios). The goal: the dynamic file
at the traced size within 5 % of the static one. The second table is what the dynamic file is
for: a 16-token request run as it is, against the static file it would otherwise be padded for.

    python -m bench dynamic_axes
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._framework import option, scratch, table
from bench.zoo import ROUNDS, _latencies, each_model

MODELS = {"BERT 4x256": ({"input_ids": {0: "batch", 1: "sequence"}}, 16),
          "ResNet-50": ({"pixel_values": {0: "batch", 2: "height", 3: "width"}}, None)}


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: the text model and/or the image model.
        rounds: latency rounds (each file once per round, the order rotating).
        out_dir: keep the files in this folder (None: a temporary one, removed).
    """

    models: tuple[str, ...] = option(tuple(MODELS), "models, comma-separated", choices=tuple(MODELS))
    rounds: int = option(ROUNDS, "latency rounds (each file once per round, the order rotating)")
    out_dir: str | None = option(None, "keep the files in this folder (default: a temporary one, removed)")

    def check(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")


def _one(entry, axes: dict, short: int | None, out: Path, rounds_wanted: int) -> dict:
    import torch

    from onnxport import Quantizer, export_onnx, export_qdq
    from onnxport.inspection.stats import ort_optimised_ops

    model = entry.model()
    sample = entry.sample(batch=1)
    calibration = [entry.sample(batch=4, seed=10 + i) for i in range(4)]
    files = {
        "fp32 static": export_onnx(model, sample, out / "fp32_static.onnx", dynamic_batch=False),
        "fp32 dynamic": export_onnx(model, sample, out / "fp32_dynamic.onnx", dynamic_axes=axes),
    }
    static_q = Quantizer(target="onnxruntime").quantize(model, calibration)
    files["onnxruntime static"] = export_qdq(static_q, sample, out / "ort_static.onnx")
    dynamic_q = Quantizer(target="onnxruntime").quantize(model, calibration, dynamic_axes=axes)
    files["onnxruntime dynamic"] = export_qdq(dynamic_q, sample, out / "ort_dynamic.onnx", dynamic_batch=True)
    fused = {name: dict(sorted(ort_optimised_ops(path).items())) for name, path in files.items()}
    with torch.no_grad():
        rounds = _latencies(files, {1: sample.numpy()}, rounds=rounds_wanted)
    result: dict = {"latency_ms": {name: statistics.median(r[1]) for name, r in rounds.items()},
                    "same_fusions": {kind: fused[f"{kind} static"] == fused[f"{kind} dynamic"]
                                     for kind in ("fp32", "onnxruntime")}}
    result["dynamic_vs_static"] = {
        kind: statistics.median(s / d for s, d in zip(rounds[f"{kind} static"][1], rounds[f"{kind} dynamic"][1]))
        for kind in ("fp32", "onnxruntime")}
    if short:
        # a short request: the dynamic file runs it as it is, the static one padded to the traced length
        short_files = {"onnxruntime dynamic": files["onnxruntime dynamic"]}
        short_rounds = _latencies(short_files, {1: sample[:, :short].numpy()}, rounds=rounds_wanted)
        result["short_ms"] = {"length": short, "dynamic": statistics.median(short_rounds["onnxruntime dynamic"][1]),
                              "static_padded": result["latency_ms"]["onnxruntime static"]}
    return result


def run(config: Config = Config()) -> dict:
    import logging

    from onnxport import cpu_int8

    logging.getLogger("torch").setLevel(logging.ERROR)
    results: dict = {"_isa": cpu_int8().describe(), "_rounds": config.rounds}
    with scratch(config.out_dir, "onnxport-bench-dynamic-") as out:
        results.update(each_model(config.models, out,
                                  lambda entry, folder: _one(entry, *MODELS[entry.name], folder, config.rounds)))
    return results


def report(results: dict) -> str:
    rows, notes = [], []
    for name, e in results.items():
        if name.startswith("_"):
            continue
        ms, ratio = e["latency_ms"], e["dynamic_vs_static"]
        rows.append([name, f"{ms['fp32 static']:.2f}", f"{ms['fp32 dynamic']:.2f}", f"{ratio['fp32']:.3f}",
                     f"{ms['onnxruntime static']:.2f}", f"{ms['onnxruntime dynamic']:.2f}", f"{ratio['onnxruntime']:.3f}",
                     "yes" if all(e["same_fusions"].values()) else str(e["same_fusions"])])
        if "short_ms" in e:
            s = e["short_ms"]
            notes.append(f"{name}, a {s['length']}-token request, INT8: {s['dynamic']:.2f} ms in the dynamic file, "
                         f"{s['static_padded']:.2f} ms padded to the static file's length "
                         f"({s['static_padded'] / s['dynamic']:.1f}x).")
    return table(["model", "FP32 static ms", "FP32 dynamic ms", "FP32 ratio", "INT8 static ms", "INT8 dynamic ms",
                  "INT8 ratio", "same fusions"], rows, notes=notes, title=[
        "Symbolic axes: the dynamic file against the static one at the traced size (static latency / dynamic",
        "latency, median of the rounds' ratios; 1.00 = the same), and whether ORT fuses both alike.",
        f"CPU: {results.get('_isa', 'see the run results file')}"])



if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["dynamic_axes", *sys.argv[1:]]))
