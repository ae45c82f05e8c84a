"""The front door against Optimum's exporter, side by side in one run, on the sweep's families.

Each encoder and vision family of ``bench/sweep.py`` is saved as a ``save_pretrained`` folder
(random weights), then exported by ``export_pretrained`` (ours, in this process) and by
``optimum-cli export onnx`` (Optimum, in its own environment: its pins differ). Per family: which
exported, the export's wall time (a fresh process each for Optimum; ours timed in-process after a
warm-up, so the comparison is of the export, not of importing torch), and the float files' speed in
ONNX Runtime measured interleaved (``interleaved_ms``: fresh sessions, rotating order; ratio of ours
over Optimum's speed, the median of the rounds' own ratios). Batch 1, 64 tokens or 224x224.

    python -m bench pretrained --optimum /path/to/venv/bin/optimum-cli [--families Bert,ViT] [--rounds 8] [--int8]

Each export's proofs are in the table ("agreed": the float file's worst distance from the model's
float64 run against its float floor at both sizes; an INT8 file's cosine beside its rounding floor).
With ``--int8``, INT8 files too, each against ONNX Runtime's quantizer on Optimum's float file (what
a user of Optimum's exporter quantizes; on ours without ``--optimum``; the better of its default and ``reduce_range``): text
families ``quantize='dynamic'`` (ours) against ``quantize_dynamic``, vision families
``quantize='int8'`` with the 'onnxruntime' target (ours, 16 calibration images from a .npz)
against ``quantize_static`` (QDQ, per channel, the same images). Their speed is timed interleaved
with the float files, as a speed-up over our float file.

Each flag falls back to an environment variable (``python -m bench pretrained --help`` names them).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench._framework import cell, option, table
from bench.sweep import ENCODERS, VISION, _text_config


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        optimum: optimum-cli of an environment with optimum-onnx (None: Optimum's columns skipped).
        families: the families (empty: the sweep's encoders and vision models).
        rounds: interleaved timing rounds.
        int8: INT8 files too, ours against ONNX Runtime's quantizer on Optimum's float file.
    """

    optimum: str | None = option(None, "optimum-cli of an environment with optimum-onnx installed")
    families: tuple[str, ...] = option((), "families, comma-separated (default: the sweep's encoders and vision models)",
                                       choices=(*ENCODERS, *VISION))
    rounds: int = option(8, "interleaved timing rounds")
    int8: bool = option(False, "INT8 files too: ours against ONNX Runtime's quantizer on Optimum's float file")

    def check(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")


def _folder(family: str, where: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    if family in VISION:
        config = getattr(transformers, f"{family}Config")(**VISION[family])
        config.num_labels = 10
        own = getattr(transformers, f"{family}ForImageClassification", None)
        model = own(config) if own is not None else transformers.AutoModelForImageClassification.from_config(config)
    else:
        model = transformers.AutoModelForSequenceClassification.from_config(_text_config(family))
    model.config.architectures = [type(model).__name__]
    if getattr(model.config, "block_repeats", None) is not None:  # Funnel: one repeat per block, or it cannot be saved
        model.config.block_repeats = [1] * len(model.config.block_sizes)
    model.eval().save_pretrained(where)
    return where


def _ours(folder: Path, out: Path, **options) -> tuple[float | None, str, str]:
    """Our export of one folder: its wall seconds (None: refused, and why), and its proofs' figures."""
    from onnxport import export_pretrained

    start = time.perf_counter()
    try:
        result = export_pretrained(folder, out, **options)
    except Exception as error:  # noqa: BLE001 -- the table says why a family did not export
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}", ""
    return time.perf_counter() - start, "", _agreement(result.proofs)


def _agreement(proofs: list[dict]) -> str:
    """The proofs in one cell; each passed (the export refuses otherwise): the float files' worst
    distance against the model's float floor, a quantized file's cosine beside its rounding floor."""
    from onnxport.pretrained.export import proof_figure

    figures = [proof_figure(p).replace(" its float floor", " floor").replace("(its rounding floor ", "(floor ")
               for p in proofs]
    return f"{len(proofs)} runs: " + " | ".join(f for f in figures if f)


def _optimum(cli: str, folder: Path, out: Path, task: str) -> tuple[float | None, str]:
    start = time.perf_counter()
    done = subprocess.run([cli, "export", "onnx", "--model", str(folder), "--task", task, str(out)],
                          capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode or not (out / "model.onnx").is_file():
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        return None, (lines[-1][:120] if lines else f"exit {done.returncode}")
    return time.perf_counter() - start, ""


def _feeds(path: Path) -> dict:
    import numpy as np
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value or (1 if i == 0 else 64) for i, d in enumerate(value.type.tensor_type.shape.dim)]
        elem = value.type.tensor_type.elem_type
        if elem == onnx.TensorProto.INT64:
            feeds[value.name] = np.ones(dims, np.int64) if "mask" in value.name else \
                np.random.default_rng(0).integers(5, 100, dims).astype(np.int64)
            if "token_type" in value.name:
                feeds[value.name] = np.zeros(dims, np.int64)
        else:
            feeds[value.name] = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    return feeds


def _calibration(folder: Path, where: Path) -> Path:
    """16 images the size the folder's model reads, as a .npz of ``pixel_values``."""
    import numpy as np

    float_file = folder / "model.onnx"
    shape = [d.dim_value or 1 for d in _input_dims(float_file, "pixel_values")]
    images = np.random.default_rng(1).standard_normal((16, *shape[1:])).astype(np.float32)
    np.savez(where, pixel_values=images)
    return where


def _input_dims(path: Path, name: str) -> list:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    value = next(v for v in graph.input if v.name == name)
    return list(value.type.tensor_type.shape.dim)


def _ours_int8(folder: Path, out: Path, vision: bool, calibration: Path | None) -> tuple[float | None, str, str]:
    if vision:
        return _ours(folder, out, quantize="int8", calibration=calibration, calibration_samples=16)
    return _ours(folder, out, quantize="dynamic")


def _ort_int8(float_file: Path, out: Path, vision: bool, calibration: Path | None) -> dict[str, Path | str]:
    """ONNX Runtime's quantizer on a float file, with and without reduce_range: {name: file or why not}."""
    import numpy as np
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    class Images(CalibrationDataReader):
        def __init__(self) -> None:
            images = np.load(calibration)["pixel_values"] if calibration is not None else np.zeros((0,))
            self.feeds = iter([{"pixel_values": images[i:i + 1]} for i in range(len(images))])

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    made: dict[str, Path | str] = {}
    for suffix, reduce_range in (("", False), ("_rr", True)):
        target = out / f"ort{suffix}.onnx"
        try:
            if vision:
                quantize_static(str(float_file), str(target), Images(), quant_format=QuantFormat.QDQ, per_channel=True,
                                reduce_range=reduce_range, activation_type=QuantType.QUInt8,
                                weight_type=QuantType.QInt8)
            else:
                quantize_dynamic(str(float_file), str(target), per_channel=True, reduce_range=reduce_range,
                                 weight_type=QuantType.QInt8)
            made[f"ort{suffix}"] = target
        except Exception as error:  # noqa: BLE001 -- ORT's quantizer failing is a result of the bench
            made[f"ort{suffix}"] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    return made


def _int8_row(row: dict, root: Path, folder: Path, vision: bool, rounds: int) -> None:
    """Ours and ORT's INT8 files of one family, timed beside our float file."""
    from onnxport.runtime import interleaved_ms

    calibration = _calibration(root / "ours", root / "images.npz") if vision else None
    row["ours_int8_s"], row["ours_int8_error"], row["ours_int8_agreed"] = _ours_int8(folder, root / "ours_int8", vision,
                                                                                   calibration)
    (root / "ort_int8").mkdir()
    # ORT's quantizer on Optimum's float file, or on ours where there is none or it takes other
    # inputs (its RoBERTa has no token_type_ids): the timing runs every file on the same feeds
    base = root / "optimum" / "model.onnx"
    if not base.is_file() or set(_feeds(base)) != set(_feeds(root / "ours" / "model.onnx")):
        base = root / "ours" / "model.onnx"
    row["ort_int8_from"] = "Optimum's float file" if base.parent.name == "optimum" else "our float file"
    start = time.perf_counter()
    made = _ort_int8(base, root / "ort_int8", vision, calibration)
    row["ort_int8_s"] = time.perf_counter() - start
    row["ort_int8_errors"] = {k: v for k, v in made.items() if isinstance(v, str)}
    files = {"float": root / "ours" / "model.onnx", **{k: v for k, v in made.items() if isinstance(v, Path)}}
    if row["ours_int8_s"] is not None:
        files["ours_int8"] = root / "ours_int8" / "model.onnx"
    if len(files) < 2:
        return
    times = interleaved_ms(files, [_feeds(files["float"])], rounds=rounds)
    speedup = {name: statistics.median(f / t for f, t in zip(times["float"][0], ms[0]))
               for name, ms in times.items() if name != "float"}
    row["int8_speedup"] = speedup
    ort = {k: v for k, v in speedup.items() if k.startswith("ort")}
    if ort and "ours_int8" in speedup:
        best = max(ort, key=ort.get)
        row["ort_int8_best"] = best
        row["int8_ours_over_ort"] = speedup["ours_int8"] / ort[best]


def run(config: Config = Config()) -> dict:
    from onnxport import cpu_int8
    from onnxport.runtime import interleaved_ms

    results: dict = {"_isa": cpu_int8().isa}
    warmed = False
    for family in config.families or (*ENCODERS, *VISION):
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            try:
                folder = _folder(family, root / "model")
            except Exception as error:  # noqa: BLE001 -- a config that cannot be saved is a row, not the end
                results[family] = {"ours_error": f"cannot save the folder: {str(error).splitlines()[0][:100]}"}
                continue
            task = "image-classification" if family in VISION else "text-classification"
            if not warmed:  # the first export in a process pays the exporter's one-time set-up
                _ours(folder, root / "warm")
                shutil.rmtree(root / "warm", ignore_errors=True)
                warmed = True
            row: dict = {"task": task}
            row["ours_s"], row["ours_error"], row["ours_agreed"] = _ours(folder, root / "ours")
            if config.optimum:
                row["optimum_s"], row["optimum_error"] = _optimum(config.optimum, folder, root / "optimum", task)
            if row["ours_s"] is not None and row.get("optimum_s") is not None:
                feeds = _feeds(root / "ours" / "model.onnx")
                theirs = _feeds(root / "optimum" / "model.onnx")
                if set(feeds) == set(theirs):
                    times = interleaved_ms({"ours": root / "ours" / "model.onnx",
                                            "optimum": root / "optimum" / "model.onnx"}, [feeds], rounds=config.rounds)
                    ratios = [o / u for u, o in zip(times["ours"][0], times["optimum"][0])]
                    row["ours_ms"] = statistics.median(times["ours"][0])
                    row["optimum_ms"] = statistics.median(times["optimum"][0])
                    row["speed_ours_over_optimum"] = statistics.median(ratios)
                else:
                    row["note"] = f"inputs differ: ours {sorted(feeds)}, Optimum's {sorted(theirs)}"
            if config.int8 and row["ours_s"] is not None:
                _int8_row(row, root, folder, family in VISION, config.rounds)
            results[family] = row
            print(f"    {family}: {row}", flush=True)
    return results


def report(results: dict) -> str:
    families = {f: r for f, r in results.items() if not f.startswith("_")}
    rows = []
    for family, r in families.items():
        notes = "; ".join(x for x in (r.get("ours_error"), r.get("optimum_error") and f"Optimum: {r['optimum_error']}",
                                      r.get("note")) if x)
        rows.append([family, cell(r.get("ours_s"), ".1f"), r.get("ours_agreed") or "-", cell(r.get("optimum_s"), ".1f"),
                     cell(r.get("ours_ms"), ".2f"), cell(r.get("optimum_ms"), ".2f"),
                     cell(r.get("speed_ours_over_optimum"), ".2f"), notes])
    parts = [table(["family", "ours s", "ours agreed", "Optimum s", "ours ms", "Optimum ms", "speed ours/Optimum",
                    "notes"], rows,
                   title=f"The front door against Optimum's exporter (float files, batch 1; CPU: "
                         f"{results.get('_isa', 'see the run results file')})")]
    int8 = {f: r for f, r in families.items() if "ours_int8_s" in r}
    if int8:
        rows = []
        for family, r in int8.items():
            speed = r.get("int8_speedup", {})
            best = r.get("ort_int8_best")
            notes = "; ".join(x for x in (r.get("ours_int8_error"), *(f"ORT {k}: {v}" for k, v in
                                                                       r.get("ort_int8_errors", {}).items())) if x)
            rows.append([family, cell(r.get("ours_int8_s"), ".1f"), r.get("ours_int8_agreed") or "-",
                         cell(speed.get("ours_int8"), ".2f"),
                         f"{speed[best]:.2f} ({best.removeprefix('ort') or 'default'})" if best else "-",
                         cell(r.get("int8_ours_over_ort"), ".2f"), notes])
        parts.append(table(["family", "ours s", "ours agreed", "ours x", "ORT x", "ours/ORT", "notes"], rows, title=(
            "INT8 (x = speed-up over our float file): ours = export_pretrained(quantize='dynamic' for text, "
            "'int8' for vision); ORT = its quantizer on Optimum's float file (ours without --optimum), the better "
            "of default and reduce_range")))
    return "\n\n".join(parts)


if __name__ == "__main__":
    import sys

    print(report(run(sys.argv[1:])))
