"""Weight-only INT4: our faithful export vs ONNX Runtime's own ``MatMulNBitsQuantizer``.

Llama-style models from ``transformers`` configs (random weights, nothing downloaded), batch 1,
a 128-token prompt and one decode step (a 1-token input without a KV cache: the M=1 product
that dominates generation). For each model, side by side in one process:

- ``fp32``: ``export_onnx`` of the float model (opset 21).
- ``ours``: ``Quantizer(backend='torchao', method='int4_weight_only', group_size=32)`` then
  ``export_qdq`` — torchao's integers as ``DequantizeLinear → MatMul``, fused by ORT.
- ``ort``: ``MatMulNBitsQuantizer(block_size=32, is_symmetric=True)`` applied to the FP32 file —
  a second quantization of the float weights.

ORT's DQ→MatMulNBits fusion gives our file accuracy level 4 (int8 activations inside the
kernel) unless the session says otherwise; ORT's quantizer writes level 0 (float activations)
unless told. Both are measured at both levels, so each comparison is like for like.
Agreement is with the torchao model (the PyTorch model a user validated).

A separate process exports a 1.1B-parameter Llama (TinyLlama's shape, embeddings quantized too)
and reports its peak memory against the float weights' bytes, and the file size against FP32
(``--no-large`` skips it). With ``--before`` naming another checkout of onnxport, that checkout
exports the same model first, in its own process, so a change is measured before and after in one
run (``before``).

    python -m bench weight_only [--models "llama h512 L4 (27M)"] [--no-large] [--before ../other-checkout]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench._framework import option, table

SIZES = {
    "llama h512 L4 (27M)": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
                                "num_key_value_heads": 4, "vocab_size": 8192},
    "llama h1024 L4 (100M)": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
                                  "num_key_value_heads": 4, "vocab_size": 16000},
    "llama h2048 L2 (0.3B)": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2, "num_attention_heads": 32,
                                  "num_key_value_heads": 4, "vocab_size": 32000},
}
SHAPES = {"prompt 128": 128, "decode 1": 1}
BLOCK = 32
LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"
LARGE = "llama 1.1B (TinyLlama shape)"


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: the Llama shapes timed against ORT's quantizer.
        large: also export the 1.1B model in its own process (peak memory, file size).
        before: another onnxport checkout exporting the 1.1B model first (None: none).
    """

    models: tuple[str, ...] = option(tuple(SIZES), "Llama shapes, comma-separated", choices=tuple(SIZES))
    large: bool = option(True, "also export the 1.1B model (peak memory, file size)")
    before: str | None = option(None, "another onnxport checkout exporting the 1.1B model first")


def _session(path: Path, level: str | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if level is not None:
        options.add_session_config_entry(LEVEL_KEY, level)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _interleaved_ms(sessions: dict, feeds: dict, repeat: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median latency of each session, their runs interleaved so drift hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for i in range(warmup + repeat):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _agreement(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    return {"cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))), "max_abs": float(np.max(np.abs(a - b))),
            "top1": float(np.mean(got.argmax(-1) == want.argmax(-1)))}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name))


def _ort_quantized(fp32: Path, out: Path, level: int | None) -> Path:
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # The quantizer logs a line per node, and its import turns the root logger to INFO for everyone.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)

    quantizer = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=4, block_size=BLOCK, is_symmetric=True,
                                     accuracy_level=level)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=False)
    return out


def _one(name: str, config: dict, scratch: Path) -> dict:
    import torch
    import transformers

    from onnxport import Quantizer, export_onnx, export_qdq, qdq_report

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(use_cache=False, **config)).eval()
    quantized = Quantizer(backend="torchao", method="int4_weight_only", group_size=BLOCK).quantize(model)
    result: dict = {"parameters": sum(p.numel() for p in model.parameters())}
    for shape, length in SHAPES.items():
        ids = torch.randint(0, config["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
        base = scratch / f"{len(result)}"
        base.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            ours = export_qdq(quantized, ids, base / "ours.onnx")
            export_s = time.perf_counter() - start
            fp32 = export_onnx(model, ids, base / "fp32.onnx", opset_version=21, dynamic_batch=False)
        ort0 = _ort_quantized(fp32, base / "ort_l0.onnx", None)
        ort4 = _ort_quantized(fp32, base / "ort_l4.onnx", 4)
        sessions = {
            "fp32": _session(fp32, None),
            "ours level 4 (ORT default)": _session(ours, None), "ort level 4": _session(ort4, None),
            "ours level 0": _session(ours, "0"), "ort level 0": _session(ort0, None),
            # A second session of the same file: how far apart two identical files measure here.
            "ours level 4, again": _session(ours, None),
        }
        feeds = {"input": ids.numpy()}
        with torch.no_grad():
            reference = quantized(ids).logits.numpy()
        agreement = {k: _agreement(s.run(None, feeds)[0], reference) for k, s in sessions.items()}
        latency = _interleaved_ms(sessions, feeds, repeat=100 if length == 1 else 30)
        result[shape] = {
            "latency_ms": latency, "agreement_with_torchao": agreement,
            "bytes": {"fp32": _size(fp32), "ours": _size(ours), "ort": _size(ort0)},
            "matmul_nbits": {"ours": qdq_report(ours).extra["ort_matmul_nbits"],
                             "ort": sum(n.op_type == "MatMulNBits" for n in __import__("onnx").load(str(ort0)).graph.node)},
            "export_s": export_s,
        }
        del sessions
    return result


_LARGE = r"""
import json, os, resource, sys, time, warnings
import torch, transformers
from onnxport import Quantizer, export_qdq, qdq_report
out = sys.argv[1]
def peak():
    # VmHWM starts afresh with this process's memory; ru_maxrss would carry the parent's over exec.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                  num_attention_heads=32, num_key_value_heads=4, use_cache=False)
model = transformers.LlamaForCausalLM(config).eval()
float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
after_build = peak()
start = time.perf_counter()
q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32, quantize_embeddings=True).quantize(model)
quantize_s, after_quantize = time.perf_counter() - start, peak()
start = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    path = export_qdq(q, torch.randint(0, 32000, (1, 16)), os.path.join(out, "llama1b.onnx"))
export_s = time.perf_counter() - start
size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.startswith("llama1b.onnx"))
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "float_bytes": float_bytes,
                  "peak_after_build": after_build, "peak_after_quantize": after_quantize, "peak": peak(),
                  "quantize_s": quantize_s, "export_s": export_s, "file_bytes": size,
                  "matmul_nbits": qdq_report(path).extra["ort_matmul_nbits"]}))
"""


def _large(scratch: Path, tree: Path | None = None) -> dict:
    """The 1.1B export in a fresh process, with this checkout's onnxport or ``tree``'s."""
    env = os.environ if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _LARGE, str(scratch)], capture_output=True, text=True, check=False,
                          env=env, cwd=tree)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["peak_vs_float_weights"] = figures["peak"] / figures["float_bytes"]
    figures["file_vs_fp32"] = figures["file_bytes"] / figures["float_bytes"]
    return figures


def run(config: Config = Config()) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in config.models:
            folder = Path(scratch) / str(len(results))
            folder.mkdir()
            results[name] = _one(name, SIZES[name], folder)
    if config.large:
        before = None
        if config.before:
            with tempfile.TemporaryDirectory() as scratch:
                before = _large(Path(scratch), Path(config.before))
        with tempfile.TemporaryDirectory() as scratch:
            results[LARGE] = _large(Path(scratch))
        if before is not None:
            results[LARGE]["before"] = before
    return results


def report(results: dict) -> str:
    rows = []
    for name, entry in results.items():
        if "peak" in entry or "error" in entry:
            continue
        for shape in SHAPES:
            row = entry[shape]
            lat, agree = row["latency_ms"], row["agreement_with_torchao"]
            for level, ours, ort in (("4", "ours level 4 (ORT default)", "ort level 4"), ("0", "ours level 0", "ort level 0")):
                rows.append([name, shape, level, f"{lat[ours]:.2f}", f"{lat[ort]:.2f}", f"{lat[ours] / lat[ort]:.3f}",
                             f"{lat['ours level 4, again'] / lat['ours level 4 (ORT default)']:.3f}", f"{lat['fp32']:.2f}",
                             f"{agree[ours]['cosine']:.7f}", f"{agree[ort]['cosine']:.7f}", f"{agree[ours]['max_abs']:.2e}",
                             f"{agree[ort]['max_abs']:.2e}", f"{row['bytes']['ours'] / row['bytes']['ort']:.4f}"])
    notes = []
    large = results.get(LARGE)
    if large and "peak" in large:
        notes.append(
            f"Llama 1.1B ({large['parameters'] / 1e9:.2f}B parameters, {large['float_bytes'] / 1e9:.2f} GB float): "
            f"peak memory {large['peak'] / 1e9:.2f} GB = {large['peak_vs_float_weights']:.2f}x the float weights "
            f"(the float model itself {large['peak_after_build'] / 1e9:.2f} GB); quantize {large['quantize_s']:.0f} s, "
            f"export+checks {large['export_s']:.0f} s; file {large['file_bytes'] / 1e9:.3f} GB = "
            f"{large['file_vs_fp32']:.3f}x FP32; {large['matmul_nbits']} MatMulNBits.")
        before = large.get("before") or {}
        if "peak" in before:
            notes.append(f"  before (the other checkout, just before): peak {before['peak'] / 1e9:.2f} GB = "
                         f"{before['peak_vs_float_weights']:.2f}x; export+checks {before['export_s']:.0f} s")
    elif large:
        notes.append(f"Llama 1.1B: {large['error']}")
    return table(["model", "input", "level", "ours ms", "ORT ms", "ours/ORT", "same file twice", "fp32 ms", "cosine ours",
                  "cosine ORT", "max err ours", "max err ORT", "size ours/ORT"], rows, notes=notes,
                 title="Weight-only INT4 (block 32, symmetric): ours (torchao's integers) vs ORT's MatMulNBitsQuantizer")


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["weight_only", *sys.argv[1:]]))
