"""The front door against Optimum's exporter, side by side in one run, on the sweep's families.

Each encoder and vision family of ``bench/sweep.py`` is saved as a ``save_pretrained`` folder
(random weights), then exported by ``export_pretrained`` (ours, in this process) and by
``optimum-cli export onnx`` (Optimum, in its own environment: its pins differ). Per family: which
exported, the export's wall time (a fresh process each for Optimum; ours timed in-process after a
warm-up, so the comparison is of the export, not of importing torch), and the float files' speed in
ONNX Runtime measured interleaved (``interleaved_ms``: fresh sessions, rotating order; ratio of ours
over Optimum's speed, the median of the rounds' own ratios). Batch 1, 64 tokens or 224x224.

    python -m bench pretrained --optimum /path/to/venv/bin/optimum-cli [--families Bert,ViT] [--rounds 8]

Environment fallbacks: ONNXPORT_BENCH_OPTIMUM (the optimum-cli path), ONNXPORT_BENCH_PRETRAINED (families),
ONNXPORT_BENCH_PRETRAINED_ROUNDS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.sweep import ENCODERS, VISION, _text_config


@dataclass
class Config:
    optimum: str | None
    families: list[str]
    rounds: int


def config_from(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench pretrained")
    parser.add_argument("--optimum", default=os.environ.get("ONNXPORT_BENCH_OPTIMUM"),
                        help="optimum-cli of an environment with optimum-onnx installed")
    parser.add_argument("--families", default=os.environ.get("ONNXPORT_BENCH_PRETRAINED", ""),
                        help="comma-separated families (default: the sweep's encoders and vision models)")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("ONNXPORT_BENCH_PRETRAINED_ROUNDS", "8")))
    args = parser.parse_args(argv or [])
    families = [f for f in args.families.split(",") if f] or [*ENCODERS, *VISION]
    return Config(args.optimum, families, args.rounds)


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


def _ours(folder: Path, out: Path) -> tuple[float | None, str]:
    from onnxport import export_pretrained

    start = time.perf_counter()
    try:
        export_pretrained(folder, out)
    except Exception as error:  # noqa: BLE001 -- the table says why a family did not export
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return time.perf_counter() - start, ""


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


def run(argv: list[str] | None = None) -> dict:
    from onnxport.runtime import interleaved_ms

    config = config_from(argv)
    results: dict = {}
    warmed = False
    for family in config.families:
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
            row["ours_s"], row["ours_error"] = _ours(folder, root / "ours")
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
            results[family] = row
            print(f"    {family}: {row}", flush=True)
    return results


def report(results: dict) -> str:
    from onnxport import cpu_int8

    lines = [f"The front door against Optimum's exporter (float files, batch 1; CPU: {cpu_int8().isa})",
             f"  {'family':<14} {'ours s':>7} {'Optimum s':>9} {'ours ms':>8} {'Optimum ms':>10} {'speed ours/Opt':>14}  notes"]
    def num(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    for family, r in results.items():
        notes = "; ".join(x for x in (r.get("ours_error"), r.get("optimum_error") and f"Optimum: {r['optimum_error']}",
                                      r.get("note")) if x)
        lines.append(f"  {family:<14} {num(r, 'ours_s', '7.1f')} {num(r, 'optimum_s', '9.1f')} "
                     f"{num(r, 'ours_ms', '8.2f')} {num(r, 'optimum_ms', '10.2f')} "
                     f"{num(r, 'speed_ours_over_optimum', '14.2f')}  {notes}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(report(run(sys.argv[1:])))
