"""``python -m bench llm``: decoders with a key/value cache — ours (fp32, int4, each portable and
``'ort-cpu'``, and fp16) against onnxruntime-genai's model builder from the same
``save_pretrained`` folder, and PyTorch eager.

Llama-shaped models with random weights at three sizes (up to TinyLlama's 1.1B), and, when
``--sizes`` names it, a Mixtral-shaped mixture of experts (8 experts, 2 a token); a 128-token
prompt, 64 new tokens, batch 1, greedy. Every file is timed in a fresh process of its own; the
processes take turns, round by round, in a rotating order, and each figure is the median over
rounds. Per file: prefill latency, decode tokens/s, the process's peak memory, and decode
bandwidth (weight bytes read per token — the files' bytes less all but one row of the float
embedding table — ÷ time per token) against this machine's memory-copy bandwidth. Export peak memory is measured in a fresh process too.

onnxruntime-genai needs its own environment (its builder imports a newer transformers than some
pins allow; it needs a tokenizer, built here locally): point ``--genai-python`` at a Python with
``onnxruntime-genai``, ``torch``, ``transformers``, ``onnx`` and ``onnx-ir``; without it the
builder's columns are skipped. ``--sizes`` picks sizes by name, ``--ours`` our files
(``fp32,int4:ort-cpu``: precision, then the flavour when it is not 'portable').

    python -m bench llm --sizes "llama 42M" --ours fp32,int4:ort-cpu --genai-python /tmp/genai/bin/python
The bench also runs our folder (with its ``genai_config.json``) in onnxruntime-genai's generator
and checks its tokens equal ``onnxport.generate``'s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench._framework import cell, option, table

PROMPT, NEW, ROUNDS = 128, 64, 3
SIZES = {
    "llama 42M": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
                  "num_key_value_heads": 4},
    "llama 270M": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
                   "num_key_value_heads": 4},
    "llama 1.1B (TinyLlama shape)": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                                     "num_attention_heads": 32, "num_key_value_heads": 4},
    # a mixture of experts (Mixtral's layout: 8 experts, 2 a token): not run unless named
    "mixtral 8x29M": {"family": "mixtral", "hidden_size": 768, "intermediate_size": 1536, "num_hidden_layers": 8,
                      "num_attention_heads": 12, "num_key_value_heads": 4, "num_local_experts": 8,
                      "num_experts_per_tok": 2},
}
#: the sizes a run takes unless --sizes names others
DEFAULT_SIZES = tuple(name for name, config in SIZES.items() if "family" not in config)
VOCAB = 32000
#: our files, ``precision[:flavour]`` (the flavour 'portable' unless named)
OURS = ("fp32", "int4", "fp32:ort-cpu", "int4:ort-cpu", "fp16")
_CHOICES = tuple(f"{p}{f}" for p in ("fp32", "fp16", "int8", "int4") for f in ("", ":portable", ":ort-cpu"))


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        sizes: the Llama shapes.
        ours: our files, ``precision[:flavour]``.
        rounds: rotating rounds (each figure is the median over them).
        genai_python: a Python with onnxruntime-genai, for its builder's files (None: skipped).
    """

    sizes: tuple[str, ...] = option(DEFAULT_SIZES, "model shapes, comma-separated (the mixture of experts only when named)",
                                    choices=tuple(SIZES))
    ours: tuple[str, ...] = option(OURS, "our files, precision[:flavour], comma-separated", choices=_CHOICES)
    rounds: int = option(ROUNDS, "rotating rounds (each figure is the median over them)")
    genai_python: str | None = option(None, "a Python with onnxruntime-genai (its builder's columns; default: skipped)")

    def check(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")

    def files(self) -> list[tuple[str, str]]:
        """Our files as (precision, flavour)."""
        return [(item.partition(":")[0], item.partition(":")[2] or "portable") for item in self.ours]

_PEAK = r"""
def peak():
    # VmHWM starts afresh with this process; ru_maxrss would carry the parent's over exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""

_EXPORT = _PEAK + r"""
import json, sys, time, warnings
from onnxport import export_decoder
folder, out, precision, flavour = sys.argv[1:5]
start = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    result = export_decoder(folder, out, precision=precision, flavour=flavour)
print(json.dumps({"export_s": time.perf_counter() - start, "peak": peak(), "token_agreement": result.token_agreement,
                  "fusions": result.fusions}))
"""

_OURS = _PEAK + r"""
import json, sys, time
import numpy as np
from onnxport.llm.generate import decode, empty_past, ort_step
from onnxport.runtime import make_session
path, ids = sys.argv[1], np.array(json.loads(sys.argv[2]), dtype=np.int64)[None]
session = make_session(path)
step, marks = ort_step(session), []
def timed(*args):
    out = step(*args)
    marks.append(time.perf_counter())
    return out
start = time.perf_counter()
tokens = decode(timed, ids, np.ones_like(ids), empty_past(session, 1), int(sys.argv[3]), lambda last: last.argmax(-1))
print(json.dumps({"prefill_ms": (marks[0] - start) * 1e3, "decode_tok_s": (len(marks) - 1) / (marks[-1] - marks[0]),
                  "peak": peak(), "tokens": tokens[0, ids.shape[1]:].tolist()}))
"""

_GENAI = _PEAK + r"""
import json, sys, time
import numpy as np
import onnxruntime_genai as og
folder, ids, new = sys.argv[1], np.array(json.loads(sys.argv[2]), dtype=np.int32)[None], int(sys.argv[3])
model = og.Model(folder)
params = og.GeneratorParams(model)
params.set_search_options(max_length=ids.shape[1] + new, min_length=ids.shape[1] + new, do_sample=False)
generator = og.Generator(model, params)
start = time.perf_counter()
generator.append_tokens(ids)
prefilled = time.perf_counter()
tokens = []
for _ in range(new):  # the first call picks from the prompt's logits; each later one runs one step
    generator.generate_next_token()
    tokens.append(int(generator.get_next_tokens()[0]))
end = time.perf_counter()
print(json.dumps({"prefill_ms": (prefilled - start) * 1e3, "decode_tok_s": (new - 1) / (end - prefilled),
                  "peak": peak(), "tokens": tokens}))
"""

_EAGER = _PEAK + r"""
import json, sys, time
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids, new = torch.tensor([json.loads(sys.argv[2])]), int(sys.argv[3])
with torch.no_grad():
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    prefilled = time.perf_counter()
    cache, token, tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True), []
    for i in range(new - 1):
        tokens.append(int(token))
        out = model(input_ids=token, past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[ids.shape[1] + i]]))
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    tokens.append(int(token))
    end = time.perf_counter()
print(json.dumps({"prefill_ms": (prefilled - start) * 1e3, "decode_tok_s": (new - 1) / (end - prefilled),
                  "peak": peak(), "tokens": tokens}))
"""


def _json_of(done: subprocess.CompletedProcess) -> dict:
    if done.returncode:
        lines = (done.stderr.strip() or done.stdout.strip() or "failed").splitlines()
        return {"error": lines[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _python(code: str, *args: str, python: str = sys.executable) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return _json_of(subprocess.run([python, "-c", code, *map(str, args)], capture_output=True, text=True,
                                   check=False, env=env))


def _tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the vocabulary's ids, saved beside the model: onnxruntime-genai's
    builder refuses a folder without one (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def _build(config: dict, folder: Path) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    config = dict(config)
    family = {"llama": transformers.LlamaConfig, "mixtral": transformers.MixtralConfig}[config.pop("family", "llama")]
    model = transformers.AutoModelForCausalLM.from_config(family(
        vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, **config)).eval()
    model.save_pretrained(folder)
    _tokenizer(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def float_bytes_per(label: str) -> float:
    """A file's bytes per float32 weight byte (int4: an eighth, before its scales)."""
    return 0.125 if "int4" in label else 0.25 if "int8" in label else 0.5 if "fp16" in label else 1.0


def _copy_bandwidth() -> float:
    """Bytes per second numpy copies a 1 GiB array with (read + write), the best of five."""
    a = np.ones(1 << 28, dtype=np.float32)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _weights(folder: Path, name: str) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith(name))


def _one(name: str, config: dict, scratch: Path, chosen: Config, bandwidth: float) -> dict:
    hf = scratch / "hf"
    float_bytes = _build(config, hf)
    result: dict = {"float_bytes": float_bytes, "exports": {}, "runs": {}}
    files: dict[str, tuple[str, Path, str]] = {}  # label -> (runner, folder or file, weights file prefix)
    genai_python = chosen.genai_python
    for precision, flavour in chosen.files():
        label = f"ours {precision}" + (f" {flavour}" if flavour != "portable" else "")
        out = scratch / label.replace(" ", "-")
        figures = _python(_EXPORT, hf, out, precision, flavour)
        if "peak" in figures:
            figures["peak_vs_float_weights"] = figures["peak"] / float_bytes
        result["exports"][label] = figures
        if "error" not in figures:
            files[label] = ("ours", out / "model.onnx", "model.onnx")
    if genai_python:
        for precision in ("fp32", "int4"):
            out = scratch / f"genai-{precision}"
            start = time.perf_counter()
            done = subprocess.run([genai_python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                                   "-p", precision, "-e", "cpu", "-c", str(scratch / "cache")], capture_output=True,
                                  text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode:
                result["exports"][f"genai builder {precision}"] = {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
                continue
            result["exports"][f"genai builder {precision}"] = {"export_s": time.perf_counter() - start}
            files[f"genai builder {precision}"] = ("genai", out, "model.onnx")
    files["pytorch eager fp32"] = ("eager", hf, "model.safetensors")

    prompt = json.dumps(np.random.default_rng(0).integers(3, VOCAB, PROMPT).tolist())
    runs: dict[str, list[dict]] = {label: [] for label in files}
    labels = list(files)
    for round_ in range(chosen.rounds):
        for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
            runner, path, _ = files[label]
            if runner == "ours":
                figures = _python(_OURS, path, prompt, NEW)
            elif runner == "genai":
                figures = _python(_GENAI, path, prompt, NEW, python=genai_python)
            else:
                figures = _python(_EAGER, path, prompt, NEW)
            runs[label].append(figures)
    for label, figures in runs.items():
        good = [f for f in figures if "error" not in f]
        if not good:
            result["runs"][label] = {"error": figures[0]["error"]}
            continue
        runner, path, prefix = files[label]
        folder = path.parent if path.is_file() else path
        # a token reads every weight once, except the embedding table (one row of it) and, in a
        # mixture, the experts it was not routed to
        shape = SIZES[name]
        embedding = VOCAB * shape["hidden_size"] * 4
        unread = embedding - embedding // VOCAB
        if "num_local_experts" in shape:
            experts = shape["num_hidden_layers"] * shape["num_local_experts"] * 3 * shape["hidden_size"] * shape["intermediate_size"]
            unread += experts * 4 * (1 - shape["num_experts_per_tok"] / shape["num_local_experts"]) * float_bytes_per(label)
        weight_bytes = int(_weights(folder, prefix) - unread)
        tok_s = statistics.median(f["decode_tok_s"] for f in good)
        result["runs"][label] = {
            "prefill_ms": statistics.median(f["prefill_ms"] for f in good),
            "decode_tok_s": tok_s,
            "peak": max(f["peak"] for f in good),
            "weight_bytes": weight_bytes,
            "decode_bandwidth_vs_copy": weight_bytes * tok_s / bandwidth,
            "tokens": good[0]["tokens"],
        }
    # our folder in onnxruntime-genai's generator, with our genai_config.json: each of our files
    # runs there and gives onnxport.generate's tokens
    result["genai_runs_our_files"] = {}
    for label in [label for label in files if label.startswith("ours")] if genai_python else []:
        ours_in_genai = _python(_GENAI, files[label][1].parent, prompt, NEW, python=genai_python)
        ours = result["runs"].get(label, {})
        result["genai_runs_our_files"][label] = (
            "error" not in ours_in_genai and ours_in_genai["tokens"] == ours.get("tokens"), ours_in_genai.get("error"))
    return result


def run(config: Config = Config()) -> dict:
    results: dict = {"copy_bandwidth_gb_s": _copy_bandwidth() / 1e9, "prompt": PROMPT, "new_tokens": NEW,
                     "rounds": config.rounds, "genai": bool(config.genai_python), "models": {}}
    for name in config.sizes:
        with tempfile.TemporaryDirectory() as scratch:
            results["models"][name] = _one(name, SIZES[name], Path(scratch), config,
                                           results["copy_bandwidth_gb_s"] * 1e9)
            print(f"  {name} done", flush=True)
    return results


def report(results: dict) -> str:
    rows, notes = [], []
    for name, entry in results["models"].items():
        for label, run in entry["runs"].items():
            export = entry["exports"].get(label, {})
            if "error" in run:
                rows.append([name, label, run["error"], "", "", "", "", ""])
                continue
            rows.append([name, label, f"{run['prefill_ms']:.1f}", f"{run['decode_tok_s']:.1f}", f"{run['peak'] / 1e9:.2f}",
                         f"{run['decode_bandwidth_vs_copy']:.2f}", cell(export.get("export_s"), ".0f"),
                         cell(export.get("peak_vs_float_weights"), ".2f")])
        runs = entry["runs"]
        for ours, theirs in (("ours int4", "genai builder int4"), ("ours int4 ort-cpu", "genai builder int4"),
                             ("ours fp32", "genai builder fp32"), ("ours fp32 ort-cpu", "genai builder fp32"),
                             ("ours int4", "pytorch eager fp32"), ("ours fp32", "pytorch eager fp32"),
                             ("ours fp32 ort-cpu", "ours fp32"), ("ours fp32 ort-cpu", "pytorch eager fp32"),
                             ("ours fp16", "ours fp32")):
            a, b = runs.get(ours, {}), runs.get(theirs, {})
            if "decode_tok_s" in a and "decode_tok_s" in b:
                notes.append(f"{name}: {ours} / {theirs}: decode {a['decode_tok_s'] / b['decode_tok_s']:.2f}x tokens/s, "
                             f"prefill {a['prefill_ms'] / b['prefill_ms']:.2f}x latency")
        for label, export in entry["exports"].items():
            if "error" in export:
                notes.append(f"{name}: {label} export failed: {export['error']}")
        checked = entry.get("genai_runs_our_files") or ({"ours fp32": entry["genai_runs_our_file"]}
                                                        if "genai_runs_our_file" in entry else {})
        for label, (same, error) in checked.items():
            notes.append(f"{name}: onnxruntime-genai runs our {label[5:]} folder (genai_config.json): "
                         + ("same tokens as onnxport.generate" if same else f"NOT the same tokens ({error or 'differ'})"))
    return table(["model", "file", "prefill ms", "decode tok/s", "peak GB", "decode bandwidth / copy", "export s",
                  "export peak / float"], rows, notes=notes, title=(
        f"LLM decoders, prompt {results['prompt']}, {results['new_tokens']} new tokens, batch 1, greedy; median of "
        f"{results['rounds']} rounds, each file in its own process, rotating order; memory copy "
        f"{results['copy_bandwidth_gb_s']:.1f} GB/s"))



if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["llm", *sys.argv[1:]]))
