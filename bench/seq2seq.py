"""``python -m bench seq2seq``: encoder–decoder generation — our two files (``export_seq2seq`` +
``generate``, both flavours, and int4 in 'ort-cpu') against PyTorch eager (transformers' ``generate``) and, where their environments are
given, Optimum's ``ORTModelForSeq2SeqLM`` / ``ORTModelForSpeechSeq2Seq`` with past (its own export of the same
folder) and onnxruntime-genai running our Whisper folders through the ``genai_config.json`` we write.

T5 models with random weights — T5-small's shape (6 + 6 layers, d_model 512, vocabulary 32128) and a
tiny one (2 + 2 layers, d_model 128) — a batch of 1 and of 4 sources of 32 tokens, 32 new tokens (the end token suppressed until then, so
every runner makes the same number of steps), greedy. Each runner generates in a fresh process of
its own; the processes take turns, round by round, in a rotating order, and each figure is the
median over rounds (each round the median of 5 generations after a warm-up) of the end-to-end generation (encoder included, sessions made beforehand: our
``Seq2SeqGenerator`` and Optimum's model each load once) as new tokens per second.

Whisper with random weights at whisper-tiny's shape (4 + 4 layers, d_model 384, 80 mel bins, 30 s of
frames, its vocabulary and special tokens): a batch of 1 and of 4 clips of random features, the prompt
start / English / transcribe / no-timestamps given to every runner, 32 new tokens (the end token
suppressed until then), greedy. Two figures per runner: end to end (the encoder included), and
decoding alone — the time of 32 new tokens less that of 8, so the encoder and the first steps cancel
out, whatever the runner does inside. int4 files' tokens are compared with our int4 file's (they
are held to the torchao model, not the float one); every other runner's with PyTorch eager's.

Moonshine with random weights at moonshine-tiny's shape (6 + 6 layers, hidden 288, vocabulary 32768):
a batch of 1 and of 4 clips of 5 s of random 16 kHz waveform (the batch's last clip a second shorter,
padded and masked as its feature extractor pads it), 32 new tokens from its start token, greedy.

Beside them, each fp32 file's batch-1 step against the machine's memory: one step (16 cached
tokens) and one ONNX Runtime ``MatMul`` reading as many bytes (every weight and the cache),
alternating; at batch 1 a step is bound by memory, so no fp32 file can go much below that floor.

Optimum needs its own environment (its pins conflict with ours): ``--optimum-python`` names a
Python with ``optimum-onnx`` (or ``optimum[onnxruntime]``) and ``onnxruntime``; ``--genai-python``
one with ``onnxruntime-genai``. Without them those columns are skipped. ``--models t5,whisper,moonshine``
picks the families, ``--rounds`` the rounds (each flag falls back to an environment variable:
``python -m bench seq2seq --help`` names them).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench._framework import cell, option, table

SOURCE, NEW, SHORT, BATCHES = 32, 32, 8, (1, 4)
_TOKENS = {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
#: T5-small's shape, and a tiny one where each runner's per-step overhead shows
SIZES = {
    "t5-small shape": {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
                       **_TOKENS},
    "t5 tiny (2 layers, d_model 128)": {"vocab_size": 32128, "d_model": 128, "d_kv": 32, "d_ff": 512, "num_layers": 2,
                                        "num_heads": 4, **_TOKENS},
}

#: whisper-tiny's shape and special tokens
_WHISPER_TOKENS = {"start": 50258, "en": 50259, "translate": 50358, "transcribe": 50359, "no_timestamps": 50363,
                   "eos": 50257}
WHISPER = {"vocab_size": 51865, "d_model": 384, "encoder_layers": 4, "decoder_layers": 4, "encoder_attention_heads": 6,
           "decoder_attention_heads": 6, "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536, "num_mel_bins": 80,
           "max_source_positions": 1500, "max_target_positions": 448, "decoder_start_token_id": 50258,
           "eos_token_id": 50257, "pad_token_id": 50257, "bos_token_id": 50257}
WHISPER_NAME = "whisper-tiny shape"
#: moonshine-tiny's shape; its clips: 5 s at 16 kHz
MOONSHINE = {"vocab_size": 32768, "hidden_size": 288, "intermediate_size": 1152, "encoder_num_hidden_layers": 6,
             "decoder_num_hidden_layers": 6, "encoder_num_attention_heads": 8, "decoder_num_attention_heads": 8,
             "max_position_embeddings": 194, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
             "decoder_start_token_id": 1}
MOONSHINE_NAME, SAMPLES = "moonshine-tiny shape", 80000
OPTIMUM = "optimum ORTModel (with past)"
EAGER, INT4 = "pytorch eager", "ours ort-cpu int4"

_TIMED = r"""
import json, sys, time, numpy as np
kind, folder, batch, new, short = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
speech = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None  # Whisper: the decoder prompt
wave = speech.pop() if speech and isinstance(speech[-1], dict) else None  # a waveform model: its clips
rng = np.random.default_rng(0)
if wave:
    samples = wave["samples"]
    values = (rng.standard_normal((batch, samples)) * 0.1).astype(np.float32)
    mask = np.ones((batch, samples), np.int64)
    if batch > 1:  # the last clip a second shorter, padded as the feature extractor pads it
        values[-1, samples - 16000:], mask[-1, samples - 16000:] = 0, 0
elif speech:
    features = rng.standard_normal((batch, 80, 3000)).astype(np.float32)
    prompt = np.array([speech] * batch, dtype=np.int64)
else:
    ids = rng.integers(2, 32000, (batch, 32)); mask = np.ones_like(ids)
if kind == "ours":
    from onnxport.llm import Seq2SeqGenerator
    model = Seq2SeqGenerator(folder)  # the sessions made once, as Optimum's model holds its own
    if wave:
        run = lambda n: model.generate(input_values=values, attention_mask=mask, max_new_tokens=n)
    elif speech:
        run = lambda n: model.generate(input_features=features, language="en", max_new_tokens=n)
    else:
        run = lambda n: model.generate(ids, mask, max_new_tokens=n)
elif kind == "genai":
    import onnxruntime_genai as og
    model = og.Model(folder)
    def run(n):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(speech) + n, min_length=len(speech) + n,
                                  batch_size=batch)
        generator = og.Generator(model, params)
        inputs = og.NamedTensors()
        inputs["input_features"] = features  # the graph's name: no processor maps genai's own
        inputs["input_ids"] = prompt.astype(np.int32)
        generator.set_inputs(inputs)
        while not generator.is_done():
            generator.generate_next_token()
        return np.array([generator.get_sequence(i) for i in range(batch)])
else:
    import torch
    torch.set_grad_enabled(False)
    if kind == "eager":
        from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
        model = (AutoModelForSpeechSeq2Seq if speech or wave else AutoModelForSeq2SeqLM).from_pretrained(folder).eval()
    else:
        from optimum.onnxruntime import ORTModelForSeq2SeqLM, ORTModelForSpeechSeq2Seq
        model = (ORTModelForSpeechSeq2Seq if speech or wave else ORTModelForSeq2SeqLM).from_pretrained(folder, use_cache=True)
    if wave:
        t_values, t_mask = torch.from_numpy(values), torch.from_numpy(mask)
        run = lambda n: model.generate(input_values=t_values, attention_mask=t_mask, max_new_tokens=n).numpy()
    elif speech:
        from transformers.generation.utils import GenerationMixin
        t_features, t_prompt = torch.from_numpy(features), torch.from_numpy(prompt)
        # the plain search from the given prompt (Whisper's own generate adds its language logic)
        run = lambda n: GenerationMixin.generate(model, t_features, decoder_input_ids=t_prompt, max_new_tokens=n).numpy()
    else:
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        run = lambda n: model.generate(input_ids=t_ids, attention_mask=t_mask, max_new_tokens=n).numpy()
def median(n):
    times = []
    for _ in range(5):
        start = time.perf_counter(); tokens = run(n); times.append(time.perf_counter() - start)
    return sorted(times)[2], tokens
run(new)  # warm-up
seconds, tokens = median(new)
# the same generation cut short: the difference is the decoding of the last new - short tokens,
# the encoder and the first steps cancelling out
short_seconds, _ = median(short)
skip = len(speech) if speech and not wave else 1
print(json.dumps({"seconds": seconds, "short_seconds": short_seconds, "new": int(tokens.shape[1] - skip),
                  "tokens": tokens[:, skip:].tolist()}))
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
export_seq2seq(sys.argv[1], sys.argv[2], flavour=sys.argv[3], precision=sys.argv[4])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": time.perf_counter() - start, "peak": peak - before}))
"""


def _export(folder: Path, out: Path, flavour: str, precision: str = "fp32") -> dict:
    """Our export in a fresh process: its time, and the process's peak memory above its resident
    size once the libraries are loaded (the model's loading from the folder included)."""
    done = subprocess.run([sys.executable, "-c", _EXPORT, str(folder), str(out), flavour, precision], capture_output=True,
                          text=True, check=True, timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _timed(python: str, kind: str, folder: Path, batch: int, prompt: list | None) -> dict:
    speech = [json.dumps(prompt)] if prompt else []
    done = subprocess.run([python, "-c", _TIMED, kind, str(folder), str(batch), str(NEW), str(SHORT), *speech], capture_output=True,
                          text=True, check=False, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _encoder_positions(folder: Path) -> int:
    """How many positions a waveform encoder gives for the bench's clips (its own file says)."""
    import numpy as np
    import onnxruntime as ort

    from onnxport.llm.names import ENCODER_FILE

    session = ort.InferenceSession(str(folder / ENCODER_FILE), providers=["CPUExecutionProvider"])
    values = np.zeros((1, SAMPLES), np.float32)
    return int(session.run(["last_hidden_state"], {"input_values": values,
                                                    "attention_mask": np.ones((1, SAMPLES), np.int64)})[0].shape[1])


def _memory_floor(folder: Path, source: int, rounds: int = 7) -> dict:
    """One batch-1 decoder step (16 cached tokens) against one ONNX Runtime ``MatMul`` reading as
    many bytes as the step must: every weight once and the cache. At batch 1 a step is bound by
    memory, so the ratio says how close the file comes to what the machine allows (rounds
    alternate the two; the ratio is the median of the rounds' own)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from onnxport.llm.names import DECODER_FILE
    from onnxport.runtime import ONNXModel

    proto = onnx.load(str(folder / DECODER_FILE), load_external_data=False)
    weights = sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                  for t in proto.graph.initializer)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    step = ONNXModel(folder / DECODER_FILE, session_options=options)
    rng = np.random.default_rng(0)
    feeds = {}
    for value in step.session.get_inputs():
        lengths = {2: 16 if ".decoder." in value.name else source} if value.name.startswith("past_key_values") else {}
        shape = [d if isinstance(d, int) else lengths.get(i, source if i == 1 and "mask" in value.name else 1)
                 for i, d in enumerate(value.shape)]
        feeds[value.name] = (np.ones(shape, np.int64) if value.type == "tensor(int64)"
                             else rng.standard_normal(shape).astype(np.float32))
    cache = sum(a.nbytes for a in feeds.values() if a.dtype == np.float32)
    columns = (weights + cache) // 4 // 512
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "floor",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 512])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, columns])],
        [onnx.numpy_helper.from_array(rng.standard_normal((512, columns)).astype(np.float32), "w")])
    with tempfile.TemporaryDirectory() as scratch:
        onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]), f"{scratch}/floor.onnx")
        reader = ONNXModel(f"{scratch}/floor.onnx", session_options=options)
    x = np.ones((1, 512), np.float32)
    steps, floors = [], []
    for _ in range(rounds):
        steps.append(step.latency_ms(repeat=40, warmup=10, **feeds))
        floors.append(reader.latency_ms(x, repeat=40, warmup=10))
    return {"bytes": weights + cache, "weights_bytes": weights, "step_ms": statistics.median(steps),
            "floor_ms": statistics.median(floors), "ratio": statistics.median(a / b for a, b in zip(steps, floors))}


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: ``'t5'`` (T5-small's shape and a tiny T5), ``'whisper'`` (whisper-tiny's shape),
            ``'moonshine'`` (moonshine-tiny's shape: speech of any length, masked).
        rounds: rotating rounds per batch (each runner's figure is the median over them).
        optimum_python: a Python with optimum-onnx, for Optimum's ORTModel column (None: skipped).
        genai_python: a Python with onnxruntime-genai, for its run of our Whisper folders (None: skipped).
    """

    models: tuple[str, ...] = option(("t5", "whisper"), "families, comma-separated",
                                     choices=("t5", "whisper", "moonshine"))
    rounds: int = option(5, "rotating rounds per batch (each figure is the median over them)")
    optimum_python: str | None = option(None, "a Python with optimum-onnx (Optimum's column; default: skipped)")
    genai_python: str | None = option(None, "a Python with onnxruntime-genai (its run of our Whisper folders; "
                                            "default: skipped)")

    def check(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")


def run(config: Config = Config()) -> dict:
    from onnxport import cpu_int8

    results: dict = {"isa": cpu_int8().isa, "source": SOURCE, "new_tokens": NEW, "rounds": config.rounds,
                     "optimum": bool(config.optimum_python), "genai": bool(config.genai_python), "models": {}}
    chosen = {**(SIZES if "t5" in config.models else {}),
              **({WHISPER_NAME: WHISPER} if "whisper" in config.models else {}),
              **({MOONSHINE_NAME: MOONSHINE} if "moonshine" in config.models else {})}
    for name, shape in chosen.items():
        with tempfile.TemporaryDirectory() as scratch:
            results["models"][name] = _one(name, shape, Path(scratch), config)
        print(f"  {name} done", flush=True)
    return results


def _model(name: str, config: dict) -> tuple:
    """The random-weight model of ``name``, its end token suppressed for ``NEW`` tokens, and the
    decoder prompt every runner is given (speech only)."""
    import torch
    from transformers import (
        GenerationConfig,
        T5Config,
        T5ForConditionalGeneration,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(0)
    if name == MOONSHINE_NAME:
        from transformers import MoonshineConfig, MoonshineForConditionalGeneration

        model = MoonshineForConditionalGeneration(MoonshineConfig(**config)).eval()
        model.generation_config.min_new_tokens = NEW
        # the timed script reads a trailing dict as a waveform model's clips
        return model, [{"samples": SAMPLES}]
    if name != WHISPER_NAME:
        model = T5ForConditionalGeneration(T5Config(**config)).eval()
        model.generation_config.min_new_tokens = NEW  # the same number of steps for every runner
        return model, None
    model = WhisperForConditionalGeneration(WhisperConfig(**config)).eval()
    t = _WHISPER_TOKENS
    # a multilingual checkpoint's language and task tables; no suppressed tokens, which
    # onnxruntime-genai's search does not apply
    model.generation_config = GenerationConfig(
        decoder_start_token_id=t["start"], eos_token_id=t["eos"], pad_token_id=t["eos"], bos_token_id=t["eos"],
        max_length=448, min_new_tokens=NEW, no_timestamps_token_id=t["no_timestamps"], is_multilingual=True,
        lang_to_id={"<|en|>": t["en"]}, task_to_id={"transcribe": t["transcribe"], "translate": t["translate"]})
    return model, [t["start"], t["en"], t["transcribe"], t["no_timestamps"]]


def _one(name: str, shape: dict, scratch: Path, config: Config) -> dict:
    optimum, genai = config.optimum_python, config.genai_python
    results: dict = {"batches": {}}
    folder = scratch / "model"
    model, prompt = _model(name, shape)
    model.save_pretrained(folder)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    results["weights_bytes"] = weights
    runners = {}
    # int4 weight-only (the head too): the step reads an eighth of the float weights
    for flavour, precision in (("portable", "fp32"), ("ort-cpu", "fp32"), ("ort-cpu", "int4")):
        label = flavour if precision == "fp32" else f"{flavour} {precision}"
        ours = scratch / f"ours-{flavour}-{precision}"
        figures = _export(folder, ours, flavour, precision)
        results[f"export {label}"] = {"seconds": figures["seconds"], "peak_vs_weights": figures["peak"] / weights}
        if precision == "fp32":
            source = SOURCE if not prompt else 1500 if name == WHISPER_NAME else _encoder_positions(ours)
            results[f"floor {label}"] = _memory_floor(ours, source)
        runners[f"ours {label}"] = ("ours", sys.executable, ours)
        if genai and prompt and (ours / "genai_config.json").is_file():
            runners[f"onnxruntime-genai, our {label} folder"] = ("genai", genai, ours)
    runners[EAGER] = ("eager", sys.executable, folder)
    if optimum:
        theirs = scratch / "optimum"
        task = "automatic-speech-recognition-with-past" if prompt else "text2text-generation-with-past"
        started = time.perf_counter()
        done = subprocess.run([optimum, "-m", "optimum.exporters.onnx", "--model", str(folder), "--task", task,
                               str(theirs)], capture_output=True, text=True, check=False, timeout=1800)
        results["export optimum"] = {"seconds": time.perf_counter() - started}
        if done.returncode == 0:
            runners[OPTIMUM] = ("optimum", optimum, theirs)
        else:
            results["optimum_error"] = (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
    for batch in BATCHES:
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        decoding: dict[str, list[float]] = {name: [] for name in runners}
        outputs: dict[str, list] = {}
        names = list(runners)
        for round_ in range(config.rounds):
            for runner in names[round_ % len(names):] + names[:round_ % len(names)]:
                kind, python, path = runners[runner]
                timed = _timed(python, kind, path, batch, prompt)
                if "error" in timed:
                    outputs[runner] = timed["error"]
                    continue
                seconds[runner].append(timed["seconds"])
                decoding[runner].append(timed["seconds"] - timed["short_seconds"])
                outputs[runner] = timed["tokens"]
        entry: dict = {}
        for runner, values in seconds.items():
            entry[runner] = ({"tokens_per_s": batch * NEW / statistics.median(values),
                              "decode_tokens_per_s": batch * (NEW - SHORT) / statistics.median(decoding[runner])}
                             if values else {"error": outputs.get(runner)})
        # int4 files are held to the torchao model, not the float one: their tokens are compared
        # with our int4 file's
        entry["same_tokens"] = {runner: outputs.get(runner) == outputs.get(INT4 if "int4" in runner else EAGER)
                                for runner in runners if runner not in (EAGER, INT4)}
        results["batches"][str(batch)] = entry
    return results


def report(results: dict) -> str:
    rows, notes = [], []
    # the first runs measured one model, T5-small's shape, and kept its figures at the top level
    for model, entry in results.get("models", {"t5-small shape": results}).items():
        for batch, figures_by_runner in entry["batches"].items():
            # (the first runs named the agreement "same_tokens_as_eager")
            same = figures_by_runner.get("same_tokens", figures_by_runner.get("same_tokens_as_eager", {}))
            for name, figures in figures_by_runner.items():
                if name.startswith("same_tokens"):
                    continue
                shown = ([f"{figures['tokens_per_s']:.1f}", cell(figures.get("decode_tokens_per_s"), ".1f")]
                         if "tokens_per_s" in figures else [figures["error"], ""])
                rows.append([model, batch, name, *shown, same.get(name, "the reference")])
            for mine in ("ours portable", "ours ort-cpu", INT4):
                ours = figures_by_runner.get(mine, {})
                for other in (EAGER, OPTIMUM, *(n for n in figures_by_runner if n.startswith("onnxruntime-genai"))):
                    theirs = figures_by_runner.get(other, {})
                    if "decode_tokens_per_s" in ours and "decode_tokens_per_s" in theirs:
                        notes.append(f"{model}, batch {batch}: {mine} / {other}: "
                                     f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x end to end, "
                                     f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x decoding")
        for name in ("export portable", "export ort-cpu", "export ort-cpu int4", "export optimum"):
            if name in entry:
                figures = entry[name]
                peak = (f", peak memory above the libraries' {figures['peak_vs_weights']:.1f}x the float weights "
                        f"({entry['weights_bytes'] / 1e6:.0f} MB)" if "peak_vs_weights" in figures else "")
                notes.append(f"{model}: {name}: {figures['seconds']:.0f} s{peak}")
        for name in ("floor portable", "floor ort-cpu"):
            if name in entry:
                f = entry[name]
                notes.append(f"{model}: a batch-1 step of ours {name.removeprefix('floor ')} (16 cached tokens) "
                             f"{f['step_ms']:.2f} ms = {f['ratio']:.2f}x one ONNX Runtime MatMul reading its "
                             f"{f['bytes'] / 1e6:.0f} MB of weights and cache ({f['floor_ms']:.2f} ms)")
        if "optimum_error" in entry:
            notes.append(f"{model}: Optimum's export failed: {entry['optimum_error']}")
    return table(["model", "batch", "runner", "new tokens/s, end to end", "decode tokens/s", "same tokens"], rows,
                 notes=notes, title=(
        f"Encoder-decoder generation (random weights; T5: {results['source']}-token sources; Whisper: 30 s of features, "
        f"a 4-token prompt; Moonshine: 5 s of waveform, masked), {results['new_tokens']} new tokens, greedy; median of {results['rounds']} rounds, each "
        f"runner in its own process, rotating order; CPU: {results.get('isa', 'see the run results file')}"))


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["seq2seq", *sys.argv[1:]]))
