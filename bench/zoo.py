"""The model zoo at deployment sizes: every path on every model, and the ``'onnxruntime'`` preset's
speed against ONNX Runtime's own quantizer, measured side by side.

Each model is real ``transformers`` code (the same families as ``tests/zoo.py``, at sizes close to
the checkpoints people deploy, with seeded random weights). Per model:

* ``export_onnx`` (opset 17, dynamic batch) and ``compare_onnx`` against PyTorch;
* ``Quantizer(target='onnxruntime')`` + ``export_qdq``, and ``compare_qdq`` of the file against
  the pt2e model it came from (cosine, error in quantization steps, top-1), beside how close the
  pt2e model comes to itself when every float op rounds an ulp differently (3 seeds,
  ``compare_qdq(..., rounding_floor=True)``): the floor for any runtime whose float kernels are
  not bit-equal to torch's. The other presets
  run on every zoo model in the test suite (``tests/test_zoo.py``), at smaller sizes;
  ``--targets tensorrt,onnxruntime,qnn`` measures them here too;
* ONNX Runtime's ``quantize_static`` (QDQ, per-channel, MinMax, the same calibration batches) and,
  for text models, ``quantize_dynamic``, both on the FP32 export;
* latency of the FP32 file, our ``'onnxruntime'`` file and ORT's files, at batch 1 (and 8 for
  image models): in each of several turns every file runs alone in a fresh session (an idle
  session's spinning threads would slow the next), the order rotating; a speed-up is the median
  of the rounds' own ratios, so the machine's drift between rounds cancels;
* what ORT runs in INT8 in our file (its optimised graph) and which compute ops stay float;
* the portable default against the opt-out: the same preset with ``weight_range='full'``, its
  speed and its agreement with its model as deployed on this CPU (on a VNNI CPU both are exact
  and the question is only speed; without VNNI the full range saturates).

    python -m bench zoo
    python -m bench zoo --models EfficientNet-B0,"BERT 4x256"   # only these models
    python -m bench zoo --rounds 30                             # more rounds: a closer look at near ties
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench._framework import option, scratch, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# turns of the latency loop (the benchmark's --rounds); per turn and file: untimed, then timed runs
ROUNDS, WARMUP, RUNS = 8, 3, 6
CALIBRATION = (2, 4)  # batches, samples per batch: the same data for pt2e and for ORT's quantizer


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: zoo model names (empty: every one).
        targets: deployment presets quantized, exported and compared on every model.
        rounds: latency rounds (more for a closer look at near ties).
        out_dir: keep the files in this folder (None: a temporary one, removed).
    """

    models: tuple[str, ...] = option((), "zoo models by name, comma-separated (default: every one)")
    targets: tuple[str, ...] = option(("onnxruntime",), "presets measured on every model",
                                      choices=("onnxruntime", "tensorrt", "qnn", "openvino"))
    rounds: int = option(ROUNDS, "latency rounds (each file once per round, the order rotating)")
    out_dir: str | None = option(None, "keep the files in this folder (default: a temporary one, removed)")

    def check(self) -> None:
        known = [m.name for m in zoo_models()]
        unknown = [m for m in self.models if m not in known]
        if unknown:
            raise ValueError(f"--models: no zoo model {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")


def zoo_models() -> list:
    """The zoo at deployment sizes (the tests use the same families, smaller)."""
    import transformers as t

    from tests.zoo import ZooModel

    image, tokens = (3, 224, 224), (128,)
    text = {"vocab_size": 30522, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "intermediate_size": 1024, "max_position_embeddings": 512}
    return [
        ZooModel("ResNet-50", lambda: t.ResNetForImageClassification(t.ResNetConfig()), "image", image),
        ZooModel("ConvNeXt-atto", lambda: t.ConvNextForImageClassification(t.ConvNextConfig(
            hidden_sizes=[40, 80, 160, 320], depths=[2, 2, 6, 2])), "image", image),
        ZooModel("MobileNetV2", lambda: t.MobileNetV2ForImageClassification(t.MobileNetV2Config()), "image", image),
        ZooModel("EfficientNet-B0", lambda: t.EfficientNetForImageClassification(t.EfficientNetConfig(
            width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280, dropout_rate=0.2)), "image", image),
        ZooModel("RegNetY-800MF", lambda: t.RegNetForImageClassification(t.RegNetConfig(
            layer_type="y", embedding_size=32, hidden_sizes=[64, 128, 320, 768], depths=[1, 3, 8, 2],
            groups_width=16)), "image", image),
        ZooModel("ViT-tiny", lambda: t.ViTForImageClassification(t.ViTConfig(
            hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768)), "image", image),
        ZooModel("Swin-tiny", lambda: t.SwinForImageClassification(t.SwinConfig()), "image", image),
        ZooModel("BERT 4x256", lambda: t.BertForSequenceClassification(t.BertConfig(**text)), "tokens", tokens),
        ZooModel("DistilBERT", lambda: t.DistilBertForSequenceClassification(t.DistilBertConfig()), "tokens", tokens),
        ZooModel("RoBERTa 4x256", lambda: t.RobertaForSequenceClassification(t.RobertaConfig(
            **{**text, "max_position_embeddings": 514})), "tokens", tokens),
        ZooModel("GPT-2", lambda: t.GPT2LMHeadModel(t.GPT2Config(use_cache=False)), "tokens", tokens),
        ZooModel("Llama 3x512 GQA", lambda: t.LlamaForCausalLM(t.LlamaConfig(
            vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=512, use_cache=False)), "tokens", tokens),
        ZooModel("Whisper-tiny encoder", lambda: t.WhisperModel(t.WhisperConfig(
            d_model=384, encoder_layers=4, decoder_layers=1, encoder_attention_heads=6, decoder_attention_heads=6,
            encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80, max_source_positions=1500,
            pad_token_id=50257, bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258))
            .get_encoder(), "audio", (80, 3000)),
    ]


def _latencies(files: dict[str, Path], inputs: dict[int, np.ndarray], runs: int = RUNS,
               rounds: int = ROUNDS) -> dict[str, dict[int, list[float]]]:
    """Each round's median milliseconds per file and batch (:func:`onnxport.runtime.interleaved_ms`:
    in a round each file runs alone in a fresh session, the order rotating)."""
    import onnxruntime as ort

    from onnxport.runtime import interleaved_ms

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # random weights push some FP32 activations into subnormal floats (EfficientNet-B0's
    # squeeze-excite: 280 ms instead of ~20), which trained weights do not: flush them for every file
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    # every file of one model takes the same input name
    name = input_name(next(iter(files.values())))
    batches = list(inputs)
    feeds = [{name: inputs[batch]} for batch in batches]
    timed = interleaved_ms(files, feeds, rounds=rounds, runs=runs, warmup=WARMUP, session_options=options)
    return {name: dict(zip(batches, per_feed)) for name, per_feed in timed.items()}


def input_name(path: Path) -> str:
    """The name of a file's first input, read from its header (weights not loaded)."""
    import onnx

    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def _fused(path: Path) -> dict:
    from onnxport import qdq_report

    report = qdq_report(path)
    counts = report.extra["ort_int8"]
    fused = {op: f"{c['int8']}/{c['int8'] + c['float']}" for op, c in counts.items()}
    float_ops = sorted({f"{op.op_type}: {op.why_float}" for op in report.compute_ops if not op.quantized})
    return {"ort_int8": fused, "float_in_file": float_ops[:6], "costlier_than_float": report.extra["ort_costlier_than_float"]}


def _one(entry, out: Path, config: Config) -> dict:
    import torch

    from onnxport import Quantizer, compare_onnx, compare_qdq, export_onnx, export_qdq
    from onnxport.errors import OnnxportError

    model = entry.model()
    batches, per_batch = CALIBRATION
    calibration = [entry.sample(batch=per_batch, seed=10 + i) for i in range(batches)]
    sample, check = entry.sample(batch=1), entry.sample(batch=4, seed=3)
    result: dict = {"kind": entry.kind}
    start = time.perf_counter()
    fp32 = export_onnx(model, sample, out / "fp32.onnx")
    report = compare_onnx(model, fp32, check, atol=1e-4, rtol=1e-3)
    result["export_onnx"] = {"passed": report.passed, "max_abs_error": max(o.max_abs_error for o in report.outputs),
                             "seconds": time.perf_counter() - start}
    files = {"fp32": fp32}
    for target in config.targets:
        start = time.perf_counter()
        try:
            quantized = Quantizer(target=target).quantize(model, calibration)
            path = export_qdq(quantized, sample, out / f"{target}.onnx", dynamic_batch=True)
        except OnnxportError as error:  # a refusal is a result of the bench, not its end
            result[target] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        # an 'onnxruntime' file as ORT deploys it on this CPU; another target's by its ONNX semantics
        first = compare_qdq(quantized, path, check, rounding_floor=target == "onnxruntime").outputs[0]
        result[target] = {"cosine": first.cosine_similarity, "steps": first.max_error_in_steps,
                          "top1": first.top1_agreement, "seconds": time.perf_counter() - start}
        if target == "onnxruntime":
            files["onnxruntime"] = path
            result[target].update(_fused(path))
            result[target]["rounding_floor"] = list(first.rounding_floor)
    if "onnxruntime" in files:
        # the opt-out beside the portable default: the same preset with int8 weights on [-127, 127],
        # as deployed on this CPU (on one without VNNI its U8S8 kernels saturate on it)
        full = Quantizer(target="onnxruntime", weight_range="full").quantize(model, calibration)
        files["onnxruntime_full"] = export_qdq(full, sample, out / "onnxruntime_full.onnx", dynamic_batch=True)
        first = compare_qdq(full, files["onnxruntime_full"], check).outputs[0]
        result["onnxruntime_full"] = {"cosine": first.cosine_similarity, "top1": first.top1_agreement}
    for name, mode, weight_range in _ort_files(entry.kind):
        try:
            files[name] = export_onnx(model, sample, out / f"{name}.onnx", quantize=True, quantize_mode=mode,
                                      calibration_data=calibration, weight_range=weight_range)
        except Exception as error:  # noqa: BLE001 — ORT's quantizer raises many types; its failure is a result
            result[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    sizes = (1, 8) if entry.kind == "image" else (1,)
    inputs = {b: entry.sample(batch=b, seed=5).numpy() for b in sizes}
    with torch.no_grad():
        rounds = _latencies(files, inputs, rounds=config.rounds)
    result["latency_ms"] = {name: {f"batch{b}": statistics.median(ms) for b, ms in by_batch.items()}
                            for name, by_batch in rounds.items()}
    # The machine's speed drifts over a model's minute of timing: a speed-up is the median of each
    # round's own ratio (the files of one round ran seconds apart), not a ratio of medians.
    result["speedup"] = {name: {f"batch{b}": statistics.median(f / t for f, t in zip(rounds["fp32"][b], ms))
                                for b, ms in by_batch.items()} for name, by_batch in rounds.items()}
    return result


def _ort_files(kind: str) -> list[tuple[str, str, str]]:
    """ONNX Runtime's own quantizer as users call it: its defaults (full-range int8 weights, which
    saturate in U8S8 kernels on x86 without VNNI) and with ``reduce_range`` (7-bit weights, ORT's
    advice for such CPUs); ``quantize_dynamic`` too for text models."""
    modes = ("static", "dynamic") if kind == "tokens" else ("static",)
    return [(f"ort_{mode}{suffix}", mode, weight_range)
            for mode in modes for suffix, weight_range in (("", "full"), ("_rr", "portable"))]


def run(config: Config = Config()) -> dict:
    with scratch(config.out_dir, "onnxport-bench-zoo-") as out:
        return _measure(config, out)


def _measure(config: Config, out: Path) -> dict:
    import logging

    from onnxport import cpu_int8

    models = [m for m in zoo_models() if not config.models or m.name in config.models]
    results: dict = {"_isa": cpu_int8().describe(), "_targets": list(config.targets), "_rounds": config.rounds}
    logging.getLogger("torch").setLevel(logging.ERROR)

    def measure(entry, folder: Path) -> dict:
        start = time.perf_counter()
        result = _one(entry, folder, config)
        result["bench_seconds"] = time.perf_counter() - start
        return result

    results.update(each_model({m.name for m in models}, out, measure))
    return results


def each_model(names, out: Path, measure) -> dict:
    """``measure(entry, folder)`` for each deployment-size zoo model in ``names`` (in the zoo's
    order), warnings silenced, its time printed; the results by model name."""
    results: dict = {}
    for entry in zoo_models():
        if entry.name not in names:
            continue
        start = time.perf_counter()
        folder = out / entry.name.replace(" ", "_")
        folder.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[entry.name] = measure(entry, folder)
        print(f"  {entry.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return results


def _speed(entry: dict, file: str, batch: str) -> float | None:
    return entry["speedup"].get(file, {}).get(batch)


def report(results: dict) -> str:
    targets = results.get("_targets", ["onnxruntime"])
    header = ["model", "export_onnx", *(f"{t} cos / steps" for t in targets), "pt2e vs itself, 1 ulp (3 seeds)",
              "ours b1", "ORT static b1", "ORT static rr b1", "ORT dynamic b1", "ORT dynamic rr b1", "ours / ORT best b1",
              "ours b8", "ORT static b8", "INT8 in ORT (ours)", "ours, full range: b1, cos (top-1)"]
    rows = []
    for name, e in results.items():
        if name.startswith("_"):
            continue
        cells = [name, "ok" if e["export_onnx"]["passed"] else f"max err {e['export_onnx']['max_abs_error']:.2g}"]
        for target in targets:
            t = e.get(target, {"error": "not measured"})
            cells.append(f"refused: {t['error'][:60]}" if "error" in t else f"{t['cosine']:.6f} / {t['steps'] or 0:.1f}")
        floor = sorted(e.get("onnxruntime", {}).get("rounding_floor", []))
        cells.append(f"{floor[len(floor) // 2]:.6f} ({floor[0]:.4f}–{floor[-1]:.4f})" if floor else "-")
        b1 = {f: _speed(e, f, "batch1") for f in ("onnxruntime", "ort_static", "ort_static_rr", "ort_dynamic", "ort_dynamic_rr")}
        best = max((v for k, v in b1.items() if k != "onnxruntime" and v), default=None)
        cells += [f"{v:.2f}x" if v else "-" for v in b1.values()]
        cells.append(f"{b1['onnxruntime'] / best:.2f}" if best and b1["onnxruntime"] else "-")
        for f in ("onnxruntime", "ort_static"):
            v = _speed(e, f, "batch8") if "batch8" in e["latency_ms"]["fp32"] else None
            cells.append(f"{v:.2f}x" if v else "-")
        fused = e.get("onnxruntime", {}).get("ort_int8", {})
        cells.append(", ".join(f"{op} {c}" for op, c in fused.items()) or "-")
        full, full_speed = e.get("onnxruntime_full"), _speed(e, "onnxruntime_full", "batch1")
        cells.append(f"{full_speed:.2f}x, {full['cosine']:.6f} ({full['top1']:.2f})" if full and full_speed else "-")
        rows.append(cells)
    return table(header, rows, title=[
        "The zoo on ONNX Runtime (CPU): every path, fidelity of each target's file to its pt2e model, and the",
        ("'onnxruntime' file's speed (x = FP32 latency / file latency, median of the rounds' ratios) against ORT's "
        "quantize_static"),
        "and quantize_dynamic files of the same model, each at ORT's defaults and with reduce_range ('rr', 7-bit weights).",
        f"CPU: {results.get('_isa', 'see the run results file')}"])


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["zoo", *sys.argv[1:]]))
