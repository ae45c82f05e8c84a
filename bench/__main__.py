"""Run every benchmark in one go: ``python -m bench`` (or ``onnxport bench``).

Prints each benchmark's side-by-side table, writes ``bench/results.json``, and, when matplotlib is
installed (``pip install -e .[bench]``), ``bench/latency_ratios.png``.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

BENCHMARKS = ("float_export", "quantizer", "qdq_export", "targets", "encodings", "layers", "weight_only", "export_overhead", "zoo",
              "dynamic_axes", "openvino", "sweep", "llm", "float_floor", "pretrained")
HERE = Path(__file__).resolve().parent


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


def main(only: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE.parent))
    unknown = sorted(set(only or ()) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    chosen = [b for b in BENCHMARKS if not only or b in only]
    saved = HERE / "results.json"
    # A partial run (`python -m bench NAME`) updates the saved results instead of dropping the rest.
    results: dict = json.loads(saved.read_text()) if only and saved.exists() else {}
    from onnxport import cpu_int8

    isa = cpu_int8()
    results.update({"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                    "processor": platform.processor(), "python": platform.python_version(),
                    "isa": isa.isa, "vnni": isa.vnni})
    # every table below was measured on this CPU: its INT8 kernels decide the figures
    print(f"CPU: {isa.describe()}\n", flush=True)
    for name in chosen:
        module = importlib.import_module(f"bench.{name}")
        start = time.perf_counter()
        results[name] = module.run()
        print(module.report(results[name]))
        print(f"  ({name}: {time.perf_counter() - start:.0f} s)\n", flush=True)
    staged = HERE / ".results.json.partial"  # a complete file or the previous one, never half of one
    staged.write_text(json.dumps(results, indent=2, default=str))
    os.replace(staged, HERE / "results.json")
    print(f"wrote {HERE / 'results.json'}")
    if _chart(results, HERE / "latency_ratios.png"):
        print(f"wrote {HERE / 'latency_ratios.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or None))
