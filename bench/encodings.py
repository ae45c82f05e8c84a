"""encodings_to_onnx_qdq at LLM scale, every case in a fresh process (peak RSS is VmHWM).

1. ``small`` / ``large``: a stack of 4096² MatMul weights (0.5 GB and 4.3 GB of external data),
   blockwise int4 encodings (block 128), with and without ``prequantize_constants``.
2. ``vs aimet``: the same 3.2 GB stack with per-channel int8 weights and uint8 activations, converted
   by onnxport and by aimet-onnx side by side (aimet-onnx is optional and installed separately:
   ``--aimet-python`` names a Python that has it, or install it here; the table says when it is
   absent).
3. ``7B``: a Llama-7B-shaped model (32 layers, hidden 4096, MLP 11008, vocabulary 32000: 27 GB of
   float32 weights), generated on the fly and deleted after, converted and saved end to end for
   2.0.0 int4 blockwise, LPBQ and per-channel int8 encodings, with and without prequantization;
   each output passes ``onnx.checker`` on its path and a sampled read-back of weights against
   integers computed here with NumPy. Skipped, with a message, when the disk has less than 2.5x
   the model's size free (``--no-llama-7b`` skips it too). With ``--before`` naming another
   checkout of onnxport, each 7B case is also converted by that checkout, right before this one's,
   so a change is measured before and after in one run (``before`` in each case).

    python -m bench encodings [--sizes small] [--no-aimet] [--no-llama-7b] [--before ../other-checkout]
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from bench._framework import cell, option, table

SIZES = {"small": (8, 4096), "large": (64, 4096)}  # (tensors, square weight side): 0.5 GB and 4.3 GB
AIMET_STACK = (48, 4096)  # 3.2 GB, per-channel int8
LLAMA_7B = {"layers": 32, "hidden": 4096, "ffn": 11008, "vocab": 32000}
BLOCK = 128
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        sizes: the stacked-MatMul cases (0.5 GB and 4.3 GB of weights).
        aimet: the 3.2 GB per-channel case beside aimet-onnx.
        llama_7b: the 27 GB Llama-7B-shaped case (needs 2.5x its size free on disk).
        aimet_python: a Python with aimet-onnx (None: this one, if it has it).
        before: another checkout of onnxport, measured just before this one in each 7B case.
    """

    sizes: tuple[str, ...] = option(("small", "large"), "stacked-MatMul cases, comma-separated", choices=("small", "large"))
    aimet: bool = option(True, "the per-channel case beside aimet-onnx")
    llama_7b: bool = option(True, "the 27 GB Llama-7B-shaped case")
    aimet_python: str | None = option(None, "a Python with aimet-onnx installed (default: this one, if it has it)")
    before: str | None = option(None, "another onnxport checkout, measured just before this one in each 7B case")


# -- generated models ---------------------------------------------------------------------------------
def _encoding(name: str, w: np.ndarray, kind: str) -> dict:
    """A realistic encoding of a MatMul weight (in, out) from its own values."""
    if kind == "int8":
        return {"name": name, "output_dtype": "int8", "axis": 1,
                "y_scale": (np.abs(w).max(axis=0) / 127 + 1e-12).astype(np.float32).tolist()}
    blocks = np.abs(w.reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1])).max(axis=1) + 1e-12
    if kind == "int4":
        return {"name": name, "output_dtype": "int4", "axis": 0, "block_size": BLOCK,
                "y_scale": (blocks / 7).astype(np.float32).tolist()}
    channel = (blocks.max(axis=0, keepdims=True) / (7 * 16)).astype(np.float32)
    ints = np.clip(np.ceil(blocks / 7 / channel), 1, 16).astype(np.int64)
    return {"name": name, "output_dtype": "int4", "axis": 0, "block_size": BLOCK,
            "per_block_int_scale": ints.tolist(), "per_channel_float_scale": channel.tolist()}


class _Writer:
    """Streams weights to one external-data file and encodings to a JSON file, entry by entry."""

    def __init__(self, folder: Path, kinds: tuple[str, ...]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.kinds, self.offset, self.inits = folder, kinds, 0, []
        # open for the writer's life, closed by its close(): one entry is written at a time
        self.data = open(folder / "model.onnx.data", "wb")  # noqa: SIM115
        self.encodings = {k: open(folder / f"{k}.encodings", "w") for k in kinds}  # noqa: SIM115
        for handle in self.encodings.values():
            handle.write('{"version": "2.0.0", "encodings": [')
        self.first = True

    def weight(self, name: str, w: np.ndarray) -> None:
        w = np.ascontiguousarray(w, np.float32)
        w.tofile(self.data)
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(w.shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "model.onnx.data"), ("offset", str(self.offset)), ("length", str(w.nbytes))):
            tensor.external_data.add(key=key, value=value)
        self.offset += w.nbytes
        self.inits.append(tensor)
        for kind, handle in self.encodings.items():
            handle.write(("" if self.first else ", ") + json.dumps(_encoding(name, w, kind)))
        self.first = False

    def activation(self, name: str) -> None:
        for handle in self.encodings.values():
            handle.write(", " + json.dumps({"name": name, "output_dtype": "uint8", "y_scale": 0.05, "y_zero_point": 128}))

    def finish(self, nodes: list, inputs: list, outputs: list) -> tuple[Path, dict[str, Path], int]:
        self.data.close()
        for handle in self.encodings.values():
            handle.write("]}")
            handle.close()
        graph = helper.make_graph(nodes, "generated", inputs, outputs, self.inits)
        onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(self.folder / "model.onnx"))
        return self.folder / "model.onnx", {k: self.folder / f"{k}.encodings" for k in self.kinds}, self.offset


def generate_stack(folder: Path, n_tensors: int, side: int, kinds: tuple[str, ...]) -> tuple[Path, dict[str, Path], int]:
    """input → (MatMul → Relu) × n, weights never all in memory."""
    writer = _Writer(folder, kinds)
    rng = np.random.default_rng(0)
    nodes, current = [], "input"
    for i in range(n_tensors):
        writer.weight(f"w{i}", rng.standard_normal((side, side), dtype=np.float32) * 0.02)
        nodes += [helper.make_node("MatMul", [current, f"w{i}"], [f"h{i}"]), helper.make_node("Relu", [f"h{i}"], [f"a{i}"])]
        writer.activation(f"a{i}")
        current = f"a{i}"
    return writer.finish(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, side])],
                         [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, side])])


def generate_llama(folder: Path, kinds: tuple[str, ...], layers: int, hidden: int, ffn: int, vocab: int):
    """A Llama-shaped decoder: per layer q/k/v/o, gate/up/down; an embedding and an lm_head."""
    writer = _Writer(folder, kinds)
    rng = np.random.default_rng(0)
    base = {shape: rng.standard_normal(shape, dtype=np.float32) * 0.02
            for shape in [(hidden, hidden), (hidden, ffn), (ffn, hidden)]}
    writer.weight("embed", rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02)
    nodes = [helper.make_node("Gather", ["embed", "ids"], ["x0"], axis=0)]
    x = "x0"
    for layer in range(layers):
        factor = np.float32(1 + 0.01 * layer)  # each layer's values (and scales) differ
        p = f"l{layer}."
        for proj in ("q", "k", "v", "o"):
            writer.weight(p + proj, base[(hidden, hidden)] * factor)
        for proj, shape in (("gate", (hidden, ffn)), ("up", (hidden, ffn)), ("down", (ffn, hidden))):
            writer.weight(p + proj, base[shape] * factor)
        nodes += [
            helper.make_node("MatMul", [x, p + "q"], [p + "qx"]), helper.make_node("MatMul", [x, p + "k"], [p + "kx"]),
            helper.make_node("MatMul", [x, p + "v"], [p + "vx"]), helper.make_node("Add", [p + "qx", p + "kx"], [p + "qk"]),
            helper.make_node("Add", [p + "qk", p + "vx"], [p + "att"]), helper.make_node("MatMul", [p + "att", p + "o"], [p + "ox"]),
            helper.make_node("Add", [x, p + "ox"], [p + "h"]),
            helper.make_node("MatMul", [p + "h", p + "gate"], [p + "g"]), helper.make_node("MatMul", [p + "h", p + "up"], [p + "u"]),
            helper.make_node("Relu", [p + "g"], [p + "gr"]), helper.make_node("Mul", [p + "gr", p + "u"], [p + "m"]),
            helper.make_node("MatMul", [p + "m", p + "down"], [p + "d"]), helper.make_node("Add", [p + "h", p + "d"], [p + "out"]),
        ]
        writer.activation(p + "out")
        x = p + "out"
    writer.weight("lm_head", rng.standard_normal((hidden, vocab), dtype=np.float32) * 0.02)
    nodes.append(helper.make_node("MatMul", [x, "lm_head"], ["logits"]))
    return writer.finish(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, vocab])])


# -- one case, in its own process -----------------------------------------------------------------------
def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it starts afresh at exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(tool: str, model: str, encodings: str, out: str, prequantize: bool) -> None:
    # Imports first: the clock measures the conversion, not the package's import time.
    if tool == "aimet":
        from aimet_onnx import encodings_to_onnx_qdq
    else:
        from onnxport import encodings_to_onnx_qdq, save_model
    start = time.perf_counter()
    if tool == "aimet":
        q = encodings_to_onnx_qdq(model, encodings, prequantize_constants=prequantize)
        convert_s, convert_rss = time.perf_counter() - start, _peak_rss()
        start = time.perf_counter()
        onnx.save_model(q, out, save_as_external_data=True, location=Path(out).name + ".data")
    else:
        q = encodings_to_onnx_qdq(model, encodings, prequantize_constants=prequantize, derive_data_movement=False)
        convert_s, convert_rss = time.perf_counter() - start, _peak_rss()
        start = time.perf_counter()
        save_model(q, out)
    print(json.dumps({"convert_s": convert_s, "convert_peak_rss": convert_rss, "save_s": time.perf_counter() - start,
                      "peak_rss": _peak_rss()}))


def _aimet_python(chosen: str) -> str | None:
    found = subprocess.run([chosen, "-c", "import aimet_onnx"], capture_output=True, check=False).returncode == 0
    return chosen if found else None


def _measure(tool: str, model: Path, encodings: Path, out: Path, prequantize: bool, python: str = sys.executable,
             tree: Path = ROOT) -> dict:
    """One conversion and save in a fresh process, with the onnxport of checkout ``tree``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([python, "-m", "bench.encodings", "--child", tool, str(model), str(encodings), str(out),
                           str(prequantize)], capture_output=True, text=True, cwd=tree, check=False,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if proc.returncode:
        raise RuntimeError(f"{tool} failed on {encodings.name}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- read-back checks at scale -----------------------------------------------------------------------------
def _sampled_check(source: Path, out: Path, encodings: Path, prequantize: bool, n: int = 3) -> str:
    """onnx.checker on the written path, and a few weights read back against NumPy's integers."""
    from onnxport.encodings.formats import StreamedEncodings

    onnx.checker.check_model(str(out))
    written = onnx.load_model(str(out), load_external_data=False)
    original = {t.name: t for t in onnx.load_model(str(source), load_external_data=False).graph.initializer}
    stored = {t.name: t for t in written.graph.initializer}
    rng = np.random.default_rng(1)
    names = [str(x) for x in rng.choice(sorted(original), size=n, replace=False)]
    wanted = {e["name"]: e for e in StreamedEncodings(encodings).get("encodings").entries(pairs=False) if e["name"] in names}
    for name in names:
        w = onnx.numpy_helper.to_array(original[name], str(source.parent))
        if not prequantize:
            assert np.array_equal(onnx.numpy_helper.to_array(stored[name], str(out.parent)), w), name
            continue
        e = wanted[name]
        if "per_block_int_scale" in e:
            scale = np.asarray(e["per_block_int_scale"], np.float32) * np.asarray(e["per_channel_float_scale"], np.float32)
        else:
            scale = np.asarray(e["y_scale"], np.float32)
        if "block_size" in e:
            scale = np.repeat(scale, e["block_size"], axis=e["axis"])
        elif scale.ndim == 1:
            scale = scale.reshape(1, -1)
        lo, hi = (-8, 7) if e["output_dtype"] == "int4" else (-128, 127)
        expected = np.clip(np.rint(w / scale), lo, hi)
        got = onnx.numpy_helper.to_array(stored[f"{name}_q"], str(out.parent)).astype(np.float32)
        assert np.array_equal(got, expected), f"{name}: {np.sum(got != expected)} integers differ"
    return f"checker ok, {n} weights read back equal"


# -- the runs ----------------------------------------------------------------------------------------------
def _stack_cases(scratch: Path, sizes: tuple[str, ...]) -> dict:
    results = {}
    for size in sizes:
        n, side = SIZES[size]
        model, encodings, weight_bytes = generate_stack(scratch / size, n, side, ("int4",))
        for prequantize in (False, True):
            figures = _measure("onnxport", model, encodings["int4"], scratch / size / "out" / "out.onnx", prequantize)
            figures.update(tensors=n, weight_bytes=weight_bytes, rss_fraction=figures["convert_peak_rss"] / weight_bytes,
                           convert_ms_per_tensor=figures["convert_s"] / n * 1e3)
            results[f"{size}{' prequantized' if prequantize else ''}"] = figures
            shutil.rmtree(scratch / size / "out")
        shutil.rmtree(scratch / size)
    return results


def _aimet_case(scratch: Path, aimet_python: str | None) -> dict:
    n, side = AIMET_STACK
    model, encodings, weight_bytes = generate_stack(scratch / "aimet", n, side, ("int8",))
    row = {"weight_bytes": weight_bytes, "tensors": n}
    row["onnxport"] = _measure("onnxport", model, encodings["int8"], scratch / "aimet" / "ours" / "out.onnx", False)
    python = _aimet_python(aimet_python or sys.executable)
    if python is None:
        row["aimet"] = None
        row["note"] = "aimet-onnx is not installed (--aimet-python names a Python that has it)"
    else:
        row["aimet"] = _measure("aimet", model, encodings["int8"], scratch / "aimet" / "theirs" / "out.onnx", False, python)
        row["speedup_convert"] = row["aimet"]["convert_s"] / row["onnxport"]["convert_s"]
        ends = [r["convert_s"] + r["save_s"] for r in (row["aimet"], row["onnxport"])]
        row["speedup_end_to_end"] = ends[0] / ends[1]
    shutil.rmtree(scratch / "aimet")
    return row


def _llama_case(scratch: Path, before: str | None) -> dict:
    c = LLAMA_7B
    size = 4 * (c["layers"] * (4 * c["hidden"] ** 2 + 3 * c["hidden"] * c["ffn"]) + 2 * c["vocab"] * c["hidden"])
    free = shutil.disk_usage(scratch).free
    if free < 2.5 * size:
        return {"skipped": f"needs {2.5 * size / 1e9:.0f} GB free beside {scratch}, has {free / 1e9:.0f} GB"}
    start = time.perf_counter()
    model, encodings, weight_bytes = generate_llama(scratch / "llama", ("int4", "lpbq", "int8"), **c)
    results = {"weight_bytes": weight_bytes, "generate_s": time.perf_counter() - start, "cases": {}}
    if before:
        results["before_tree"] = before
    try:
        for kind in ("int4", "lpbq", "int8"):
            for prequantize in (False, True):
                out = scratch / "llama" / "out" / "out.onnx"
                old = None
                if before:
                    old = _measure("onnxport", model, encodings[kind], out, prequantize, tree=Path(before))
                    shutil.rmtree(out.parent)
                figures = _measure("onnxport", model, encodings[kind], out, prequantize)
                if old is not None:
                    figures["before"] = old
                figures["file_bytes"] = sum(p.stat().st_size for p in out.parent.iterdir())
                figures["check"] = _sampled_check(model, out, encodings[kind], prequantize)
                results["cases"][f"{kind}{' prequantized' if prequantize else ''}"] = figures
                print(f"    7B {kind} prequantize={prequantize}: {figures}", file=sys.stderr, flush=True)
                shutil.rmtree(out.parent)
    finally:
        shutil.rmtree(scratch / "llama", ignore_errors=True)
    return results


def run(config: Config = Config()) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="onnxport-bench-enc-"))
    try:
        results = _stack_cases(scratch, config.sizes)
        if config.aimet:
            results["vs aimet"] = _aimet_case(scratch, config.aimet_python)
        if config.llama_7b:
            results["7B"] = _llama_case(scratch, config.before)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def report(results: dict) -> str:
    rows = [[name, r["tensors"], f"{r['weight_bytes'] / 1e9:.2f}G", f"{r['convert_s']:.2f}", f"{r['convert_ms_per_tensor']:.1f}",
             f"{r['convert_peak_rss'] / 1e9:.2f}G", f"{r['rss_fraction']:.1%}", f"{r['save_s']:.1f}"]
            for name, r in results.items() if name not in ("vs aimet", "7B")]
    parts = [table(["case", "tensors", "weights", "convert s", "ms/tensor", "peak RSS", "RSS/weights", "save s"], rows,
                   title="encodings_to_onnx_qdq — stacked MatMul model, blockwise int4 weights (block 128), uint8 activations")]
    row = results.get("vs aimet")
    if row:
        tools = [[tool, *(["absent: " + row["note"], "", ""] if row[tool] is None else
                          [f"{row[tool]['convert_s']:.2f}", f"{row[tool]['save_s']:.1f}", f"{row[tool]['peak_rss'] / 1e9:.2f}"])]
                 for tool in ("onnxport", "aimet")]
        notes = ([f"onnxport is {row['speedup_convert']:.1f}x faster to convert, {row['speedup_end_to_end']:.1f}x end to end"]
                 if row.get("speedup_convert") else [])
        parts.append(table(["tool", "convert s", "save s", "peak RSS GB"], tools, notes=notes,
                           title=f"vs aimet-onnx — {row['tensors']} per-channel int8 weights, {row['weight_bytes'] / 1e9:.2f} GB"))
    big = results.get("7B")
    if big and "skipped" in big:
        parts.append(f"7B: skipped — {big['skipped']}")
    elif big:
        cases = []
        for name, r in big["cases"].items():
            for label, f in ((name, r), (f"{name}, before", r.get("before"))):
                if f:
                    cases.append([label, f"{f['convert_s']:.1f}", f"{f['convert_peak_rss'] / 1e9:.2f}G", f"{f['save_s']:.1f}",
                                  f"{f['peak_rss'] / 1e9:.2f}G", f"{f['peak_rss'] / big['weight_bytes']:.1%}",
                                  cell(f.get("file_bytes", 0) / 1e9 if "file_bytes" in f else None, ".1f")])
        notes = ([f"(before: the checkout at {big['before_tree']}, measured just before each case)"]
                 if big.get("before_tree") else [])
        parts.append(table(["case", "convert s", "convert RSS", "save s", "peak RSS", "RSS/weights", "file GB"], cases, notes=notes,
                           title=f"7B-shaped model, {big['weight_bytes'] / 1e9:.1f} GB float32 weights "
                                 f"(generated in {big['generate_s']:.0f} s)"))
    return "\n\n".join(parts)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6] == "True")
    else:
        from bench.__main__ import main

        sys.exit(main(["encodings", *sys.argv[1:]]))
