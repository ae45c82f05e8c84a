"""encodings_to_onnx_qdq at LLM scale: a generated stack of MatMul blocks with blockwise int4
encodings, at two sizes (the larger with about 4 GB of external weights). Conversion wall time and
peak RSS, with and without prequantize_constants, each measured in a fresh process.

    python -m bench.encodings [--small-only]
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

SIZES = {"small": (8, 4096), "large": (64, 4096)}  # (tensors, square weight side): 0.5 GB and 4.3 GB


def generate(folder: Path, n_tensors: int, side: int) -> tuple[Path, Path, int]:
    """Write the model with its weights streamed straight to disk (never all in memory)."""
    folder.mkdir(parents=True, exist_ok=True)
    data_name = "model.onnx.data"
    nodes, inits, entries = [], [], []
    current = "input"
    offset = 0
    rng = np.random.default_rng(0)
    with open(folder / data_name, "wb") as data:
        for i in range(n_tensors):
            weight = (rng.standard_normal((side, side), dtype=np.float32) * 0.02).tobytes()
            data.write(weight)
            tensor = onnx.TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[side, side])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(weight)))):
                tensor.external_data.add(key=key, value=value)
            offset += len(weight)
            inits.append(tensor)
            nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"h{i}"]))
            nodes.append(helper.make_node("Relu", [f"h{i}"], [f"a{i}"]))
            current = f"a{i}"
            blocks = side // 128
            entries.append({"name": f"w{i}", "output_dtype": "int4", "axis": 0, "block_size": 128,
                            "y_scale": np.full((blocks, side), 0.01, np.float32).tolist()})
            entries.append({"name": f"a{i}", "output_dtype": "uint8", "y_scale": 0.05})
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, side])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, side])], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    (folder / "model.encodings").write_text(json.dumps({"version": "2.0.0", "encodings": entries}))
    return folder / "model.onnx", folder / "model.encodings", offset


def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it starts afresh at exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(model: str, encodings: str, out: str, prequantize: bool) -> None:
    from onnxport import encodings_to_onnx_qdq, save_model

    start = time.perf_counter()
    q = encodings_to_onnx_qdq(model, encodings, prequantize_constants=prequantize, derive_data_movement=False)
    convert_s = time.perf_counter() - start
    convert_rss = _peak_rss()
    start = time.perf_counter()
    save_model(q, out)
    save_s = time.perf_counter() - start
    print(json.dumps({"convert_s": convert_s, "convert_peak_rss": convert_rss, "save_s": save_s,
                      "peak_rss": _peak_rss()}))


def run(sizes: tuple[str, ...] = ("small", "large")) -> dict:
    results = {}
    scratch = Path(tempfile.mkdtemp(prefix="onnxport-bench-enc-"))
    try:
        for size in sizes:
            n, side = SIZES[size]
            model, encodings, weight_bytes = generate(scratch / size, n, side)
            for prequantize in (False, True):
                out = scratch / size / ("pre" if prequantize else "qdq") / "out.onnx"
                out.parent.mkdir()
                proc = subprocess.run([sys.executable, "-m", "bench.encodings", "--child", str(model), str(encodings), str(out),
                                       str(prequantize)], capture_output=True, text=True, check=True,
                                      cwd=Path(__file__).resolve().parents[1])
                figures = json.loads(proc.stdout.strip().splitlines()[-1])
                figures.update(tensors=n, weight_bytes=weight_bytes,
                               rss_fraction=figures["convert_peak_rss"] / weight_bytes,
                               convert_ms_per_tensor=figures["convert_s"] / n * 1e3)
                results[f"{size}{' prequantized' if prequantize else ''}"] = figures
                shutil.rmtree(out.parent)
            shutil.rmtree(scratch / size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def report(results: dict) -> str:
    lines = ["encodings_to_onnx_qdq — stacked MatMul model, blockwise int4 weights (block 128), uint8 activations",
             f"  {'case':<20} {'tensors':>7} {'weights':>9} {'convert s':>9} {'ms/tensor':>9} {'peak RSS':>9} {'RSS/weights':>11} {'save s':>7}"]
    for name, r in results.items():
        lines.append(f"  {name:<20} {r['tensors']:>7} {r['weight_bytes'] / 1e9:>8.2f}G {r['convert_s']:>9.2f} "
                     f"{r['convert_ms_per_tensor']:>9.1f} {r['convert_peak_rss'] / 1e9:>8.2f}G {r['rss_fraction']:>10.1%} {r['save_s']:>7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "True")
    else:
        print(report(run(("small",) if "--small-only" in sys.argv else ("small", "large"))))
