"""Run the benchmarks: ``python -m bench [NAME …] [--flag …]`` (or ``onnxport bench``, from a checkout).

Prints each benchmark's side-by-side tables and writes one results file per run,
``bench/results/<UTC time>-<names>.json`` (the machine, the CPU's INT8 kernels, and each
benchmark's figures), and, when matplotlib is installed (``pip install -e .[bench]``),
``bench/latency_ratios.png``. Flags after the names go to every benchmark that takes them
(``python -m bench sweep --families Bert --rounds 20``; ``python -m bench NAME --help`` lists one
benchmark's own); a flag none of the chosen benchmarks takes is refused before anything runs.
``python -m bench --tables FILE`` prints the tables of a results file again.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench._framework import parse_config, parser_for

BENCHMARKS = ("float_export", "quantizer", "qdq_export", "targets", "encodings", "layers", "weight_only", "export_overhead", "zoo",
              "dynamic_axes", "openvino", "sweep", "llm", "float_floor", "pretrained", "seq2seq")
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _chart(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars: list[tuple[str, float]] = []
    for name, entry in results.get("targets", {}).items():
        if name.startswith("_"):
            continue
        for file, figures in entry.items():
            bars.append((f"{name}\n{file}", figures["batch1_vs_fp32"]))
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(max(8, len(bars) * 0.9), 4.5))
    ax.bar(range(len(bars)), [b[1] for b in bars], color=["#999" if "fp32" in b[0] else "#2a7" for b in bars])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speed-up vs FP32 (batch 1, ONNX Runtime CPU)")
    ax.set_title("onnxport: latency ratios measured side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _tables(path: Path) -> int:
    results = json.loads(path.read_text())
    print(f"CPU: {results.get('cpu', results.get('isa', 'not recorded'))}; measured {results.get('date', '?')}\n")
    for name in BENCHMARKS:
        if name in results:
            print(importlib.import_module(f"bench.{name}").report(results[name]) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE.parent))
    argv = list(argv or [])
    if argv[:1] == ["--tables"]:
        if len(argv) != 2 or not Path(argv[1]).is_file():
            print("--tables takes one results file, e.g. bench/results/<time>-<names>.json", file=sys.stderr)
            return 2
        return _tables(Path(argv[1]))
    split = next((i for i, arg in enumerate(argv) if arg.startswith("-")), len(argv))
    only, flags = argv[:split], argv[split:]
    unknown = sorted(set(only) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    chosen = [b for b in BENCHMARKS if not only or b in only]
    modules = {name: importlib.import_module(f"bench.{name}") for name in chosen}
    if {"-h", "--help"} & set(flags):
        for name, module in modules.items():
            parser_for(module.Config, name).print_help()
            print()
        return 0
    # every benchmark reads the flags it knows; one that no chosen benchmark knows is a mistake,
    # named before anything runs (a bad value exits 2 through argparse, naming the flag)
    configs, left = {}, []
    for name, module in modules.items():
        configs[name], rest = parse_config(module.Config, flags, name, known_only=True)
        left.append({arg for arg in rest if arg.startswith("-")})
    not_taken = sorted(set.intersection(*left)) if left else []
    if not_taken:
        print(f"{', '.join(not_taken)}: no chosen benchmark ({', '.join(chosen)}) takes this flag; "
              f"python -m bench NAME --help lists a benchmark's flags", file=sys.stderr)
        return 2
    from onnxport import cpu_int8

    isa = cpu_int8()
    now = datetime.datetime.now(datetime.timezone.utc)
    results: dict = {"date": now.isoformat(timespec="seconds"), "machine": platform.platform(),
                     "processor": platform.processor(), "python": platform.python_version(),
                     "isa": isa.isa, "vnni": isa.vnni, "cpu": isa.describe(), "flags": flags,
                     "configs": {name: dataclasses.asdict(config) for name, config in configs.items()}}
    # every table below was measured on this CPU: its INT8 kernels decide the figures
    print(f"CPU: {isa.describe()}\n", flush=True)
    for name, module in modules.items():
        start = time.perf_counter()
        results[name] = module.run(configs[name])
        print(module.report(results[name]))
        print(f"  ({name}: {time.perf_counter() - start:.0f} s)\n", flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{now:%Y-%m-%dT%H%M%S}-{'-'.join(only) or 'all'}.json"
    staged = path.with_name(path.name + ".partial")  # a complete file or none, never half of one
    staged.write_text(json.dumps(results, indent=2, default=str))
    os.replace(staged, path)
    print(f"wrote {path}")
    if _chart(results, HERE / "latency_ratios.png"):
        print(f"wrote {HERE / 'latency_ratios.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or None))
