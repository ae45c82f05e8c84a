"""``python -m bench seq2seq``: encoder–decoder generation — our two files (``export_seq2seq`` +
``generate``, both flavours) against PyTorch eager (transformers' ``generate``) and, where its environment is
given, Optimum's ``ORTModelForSeq2SeqLM`` with past (its own export of the same folder).

T5 models with random weights — T5-small's shape (6 + 6 layers, d_model 512, vocabulary 32128) and a
tiny one (2 + 2 layers, d_model 128) — a batch of 1 and of 4 sources of 32 tokens, 32 new tokens (the end token suppressed until then, so
every runner makes the same number of steps), greedy. Each runner generates in a fresh process of
its own; the processes take turns, round by round, in a rotating order, and each figure is the
median over rounds (each round the median of 5 generations after a warm-up) of the end-to-end generation (encoder included, sessions made beforehand: our
``Seq2SeqGenerator`` and Optimum's model each load once) as new tokens per second.

Optimum needs its own environment (its pins conflict with ours): point
``ONNXPORT_BENCH_OPTIMUM_PYTHON`` at a Python with ``optimum-onnx`` (or ``optimum[onnxruntime]``)
and ``onnxruntime``; without it that column is skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE, NEW, ROUNDS, BATCHES = 32, 32, 5, (1, 4)
_TOKENS = {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
#: T5-small's shape, and a tiny one where each runner's per-step overhead shows
SIZES = {
    "t5-small shape": {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
                       **_TOKENS},
    "t5 tiny (2 layers, d_model 128)": {"vocab_size": 32128, "d_model": 128, "d_kv": 32, "d_ff": 512, "num_layers": 2,
                                        "num_heads": 4, **_TOKENS},
}

_TIMED = r"""
import json, sys, time, numpy as np
kind, folder, batch, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
ids = rng.integers(2, 32000, (batch, 32)); mask = np.ones_like(ids)
if kind == "ours":
    from onnxport.llm import Seq2SeqGenerator
    model = Seq2SeqGenerator(folder)  # the sessions made once, as Optimum's model holds its own
    run = lambda: model.generate(ids, mask, max_new_tokens=new)
elif kind == "eager":
    import torch
    from transformers import AutoModelForSeq2SeqLM
    torch.set_grad_enabled(False)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    run = lambda: model.generate(input_ids=t_ids, attention_mask=t_mask, max_new_tokens=new).numpy()
else:
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM
    model = ORTModelForSeq2SeqLM.from_pretrained(folder, use_cache=True)
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    run = lambda: model.generate(input_ids=t_ids, attention_mask=t_mask, max_new_tokens=new).numpy()
tokens = run()  # warm-up
times = []
for _ in range(5):
    start = time.perf_counter(); tokens = run(); times.append(time.perf_counter() - start)
seconds = sorted(times)[2]
print(json.dumps({"seconds": seconds, "new": int(tokens.shape[1] - 1), "tokens": tokens[:, 1:].tolist()}))
"""


_EXPORT = r"""
import json, resource, sys, time
import onnxruntime, torch, transformers
from onnxport.llm import export_seq2seq
import onnxport.llm.seq2seq, onnxport.engine, onnxscript  # the libraries loaded: the export's own memory is what follows
def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))
before = rss()
start = time.perf_counter()
export_seq2seq(sys.argv[1], sys.argv[2], flavour=sys.argv[3])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": time.perf_counter() - start, "peak": peak - before}))
"""


def _export(folder: Path, out: Path, flavour: str) -> dict:
    """Our export in a fresh process: its time, and the process's peak memory above its resident
    size once the libraries are loaded (the model's loading from the folder included)."""
    done = subprocess.run([sys.executable, "-c", _EXPORT, str(folder), str(out), flavour], capture_output=True,
                          text=True, check=True, timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _timed(python: str, kind: str, folder: Path, batch: int) -> dict:
    done = subprocess.run([python, "-c", _TIMED, kind, str(folder), str(batch), str(NEW)], capture_output=True,
                          text=True, check=False, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run() -> dict:
    optimum = os.environ.get("ONNXPORT_BENCH_OPTIMUM_PYTHON")
    results: dict = {"source": SOURCE, "new_tokens": NEW, "rounds": ROUNDS, "optimum": bool(optimum), "models": {}}
    for name, config in SIZES.items():
        with tempfile.TemporaryDirectory() as scratch:
            results["models"][name] = _one(config, Path(scratch), optimum)
        print(f"  {name} done", flush=True)
    return results


def _one(config: dict, scratch: Path, optimum: str | None) -> dict:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    results: dict = {"batches": {}}
    folder = scratch / "model"
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(**config)).eval()
    model.generation_config.min_new_tokens = NEW  # the same number of steps for every runner
    model.save_pretrained(folder)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    results["weights_bytes"] = weights
    runners = {}
    for flavour in ("portable", "ort-cpu"):
        ours = scratch / f"ours-{flavour}"
        figures = _export(folder, ours, flavour)
        results[f"export {flavour}"] = {"seconds": figures["seconds"], "peak_vs_weights": figures["peak"] / weights}
        runners[f"ours {flavour}"] = (sys.executable, ours)
    runners["pytorch eager"] = (sys.executable, folder)
    if optimum:
        theirs = scratch / "optimum"
        started = time.perf_counter()
        done = subprocess.run([optimum, "-m", "optimum.exporters.onnx", "--model", str(folder), "--task",
                               "text2text-generation-with-past", str(theirs)], capture_output=True, text=True,
                              check=False, timeout=1800)
        results["export optimum"] = {"seconds": time.perf_counter() - started}
        if done.returncode == 0:
            runners["optimum ORTModelForSeq2SeqLM"] = (optimum, theirs)
        else:
            results["optimum_error"] = (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
    kinds = {"ours portable": "ours", "ours ort-cpu": "ours", "pytorch eager": "eager",
             "optimum ORTModelForSeq2SeqLM": "optimum"}
    for batch in BATCHES:
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        outputs: dict[str, list] = {}
        names = list(runners)
        for round_ in range(ROUNDS):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                python, path = runners[name]
                timed = _timed(python, kinds[name], path, batch)
                if "error" in timed:
                    outputs[name] = timed["error"]
                    continue
                seconds[name].append(timed["seconds"])
                outputs[name] = timed["tokens"]
        entry: dict = {}
        for name, values in seconds.items():
            entry[name] = ({"tokens_per_s": batch * NEW / statistics.median(values)} if values
                           else {"error": outputs.get(name)})
        entry["same_tokens_as_eager"] = {name: outputs.get(name) == outputs.get("pytorch eager") for name in runners}
        results["batches"][str(batch)] = entry
    return results


def report(results: dict) -> str:
    from onnxport import cpu_int8

    lines = [(f"Encoder-decoder generation (T5, random weights), {results['source']}-token sources, "
              f"{results['new_tokens']} new tokens, greedy; median of {results['rounds']} rounds, each runner in its "
              f"own process, rotating order; CPU: {cpu_int8().isa}"),
             "| model | batch | runner | new tokens/s | same tokens as eager |", "|---|---|---|---|---|"]
    notes = []
    for model, entry in results["models"].items():
        for batch, figures_by_runner in entry["batches"].items():
            for name, figures in figures_by_runner.items():
                if name == "same_tokens_as_eager":
                    continue
                shown = f"{figures['tokens_per_s']:.1f}" if "tokens_per_s" in figures else figures["error"]
                lines.append(f"| {model} | {batch} | {name} | {shown} | "
                             f"{figures_by_runner['same_tokens_as_eager'].get(name)} |")
            for mine in ("ours portable", "ours ort-cpu"):
                ours = figures_by_runner.get(mine, {}).get("tokens_per_s")
                for other in ("pytorch eager", "optimum ORTModelForSeq2SeqLM"):
                    theirs = figures_by_runner.get(other, {}).get("tokens_per_s")
                    if ours and theirs:
                        notes.append(f"  {model}, batch {batch}: {mine} / {other}: {ours / theirs:.2f}x tokens/s")
        for name in ("export portable", "export ort-cpu", "export optimum"):
            if name in entry:
                figures = entry[name]
                peak = (f", peak memory above the libraries' {figures['peak_vs_weights']:.1f}x the float weights "
                        f"({entry['weights_bytes'] / 1e6:.0f} MB)" if "peak_vs_weights" in figures else "")
                notes.append(f"  {model}: {name}: {figures['seconds']:.0f} s{peak}")
        if "optimum_error" in entry:
            notes.append(f"  {model}: Optimum's export failed: {entry['optimum_error']}")
    return "\n".join(lines + notes)


if __name__ == "__main__":
    print(report(run()))
