"""Run the benchmarks: ``python -m bench [NAME …] [--flag …]`` (or ``onnxport bench``, from a checkout).

Prints each benchmark's side-by-side table and writes one results file per run,
``bench/results/<UTC time>-<names>.json`` (the machine, the CPU's INT8 kernels, and each
benchmark's figures), and, when matplotlib is installed (``pip install -e .[bench]``),
``bench/latency_ratios.png``. Flags after the names go to the benchmarks that take them
(``python -m bench sweep --families Bert --rounds 20``; each one's ``--help`` lists its own).
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

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


def _takes_flags(module: object) -> bool:
    return "argv" in inspect.signature(module.run).parameters  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE.parent))
    argv = list(argv or [])
    split = next((i for i, arg in enumerate(argv) if arg.startswith("-")), len(argv))
    only, flags = argv[:split], argv[split:]
    unknown = sorted(set(only) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    chosen = [b for b in BENCHMARKS if not only or b in only]
    modules = {name: importlib.import_module(f"bench.{name}") for name in chosen}
    flagless = [name for name, module in modules.items() if not _takes_flags(module)]
    if flags and flagless:
        print(f"{', '.join(flagless)} take(s) no flags; run the benchmarks given {' '.join(flags)} by name",
              file=sys.stderr)
        return 2
    for module in modules.values():  # bad flags are named before anything runs (argparse exits 2)
        if flags and hasattr(module, "config_from"):
            module.config_from(flags)
    from onnxport import cpu_int8

    isa = cpu_int8()
    now = datetime.datetime.now(datetime.timezone.utc)
    results: dict = {"date": now.isoformat(timespec="seconds"), "machine": platform.platform(),
                     "processor": platform.processor(), "python": platform.python_version(),
                     "isa": isa.isa, "vnni": isa.vnni, "cpu": isa.describe(), "flags": flags}
    # every table below was measured on this CPU: its INT8 kernels decide the figures
    print(f"CPU: {isa.describe()}\n", flush=True)
    for name, module in modules.items():
        start = time.perf_counter()
        results[name] = module.run(flags) if _takes_flags(module) else module.run()
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
