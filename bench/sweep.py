"""The sweep: the ``'onnxruntime'`` preset against ONNX Runtime's own quantizer on many architectures.

Every ``transformers`` family the team sweeps (text encoders, decoders, vision models), built from
its config at a small size with seeded random weights (batch-norm statistics measured on a few
batches, as ``tests/zoo.py`` does), 224×224 images or 64 tokens, batch 1, every shape fixed (what
``export_qdq`` writes by default, and how a batch-1 deployment runs). Per model, side by side in
one process:

* the FP32 file (``export_onnx``), ours (``Quantizer(target='onnxruntime')`` + ``export_qdq``) and
  ORT's ``quantize_static`` of the FP32 file (QDQ, per-channel, MinMax, the same calibration
  batches; with and without ``reduce_range``), and ``quantize_dynamic`` for text models;
* latency interleaved (:func:`onnxport.runtime.interleaved_ms`: fresh sessions, rotating order, a
  speed-up is the median of the rounds' own ratios to FP32);
* ours / ORT's best static file (the issue's goal) and ours / ORT's best of any kind, each the
  median of the rounds' own ratios between the two files; the ops ORT runs in INT8 in our file,
  what ``qdq_report`` names as float in it, and our file's cosine with its pt2e model as deployed
  against the model's one-ulp floor;
* text models: the dynamic file against ``quantize_dynamic``'s, the dynamic file timed a second time
  as its own control (how far two equal files land apart in the same rounds), and the operators
  ONNX Runtime runs in one of the two files and not in the other.

    python -m bench sweep
    python -m bench sweep --families ModernBert,ViT     # only these families (--text: every text family)
    python -m bench sweep --rounds 20                   # more rounds (default 8; >= 20 near a goal's line)
    python -m bench sweep --round-ms 300                # longer rounds (default 150 ms)
    python -m bench sweep --front-door [--optimum PATH/optimum-cli]   # the front door's table instead

``--front-door`` runs ``export_pretrained`` on each encoder and vision family saved as a
``save_pretrained`` folder, float and INT8 (``quantize='dynamic'`` for text, ``'int8'`` for vision),
and tables which exported, what their proofs found against the model's floor, how long the export
took and how fast the files run — against Optimum's exporter and ORT's quantizer side by side when
``--optimum`` names its ``optimum-cli`` (the ``pretrained`` benchmark, run on the sweep's families;
decoders go through ``export_decoder``, the ``llm`` benchmark).

Each flag falls back to an environment variable (``python -m bench sweep --help`` names them).

The table goes in ``docs/benchmarks.md``. timm families need torchvision, which cannot be installed
beside the CPU torch build; they are not in this sweep.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench._framework import option, table

#: the dynamic file timed a second time under another name (an A/A control)
SAME = "ours_dynamic_again"
IMAGE = (3, 224, 224)
TOKENS = (64,)

#: one small size for every text family; each config maps these names onto its own
_TEXT = {"vocab_size": 4000, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 512, "max_position_embeddings": 256, "use_cache": False,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_VIT = {"hidden_size": 192, "num_hidden_layers": 4, "num_attention_heads": 3, "intermediate_size": 768, "image_size": 224}

ENCODERS = ("Bert", "Albert", "Electra", "DebertaV2", "XLMRoberta", "MPNet", "MobileBert", "ConvBert", "SqueezeBert",
            "Funnel", "ModernBert", "DistilBert", "Roberta")
DECODERS = ("GPT2", "OPT", "GPTNeoX", "GPTJ", "CodeGen", "Bloom", "Falcon", "Phi", "Phi3", "Mistral", "Qwen2", "Qwen3",
            "Gemma", "Gemma2", "StableLm", "Starcoder2", "Olmo", "Granite", "Cohere", "Llama")
#: vision families at their config's default (tiny/small variants) or, for plain ViTs, ViT-tiny's size
VISION = {"ViT": _VIT, "DeiT": _VIT, "Beit": _VIT, "Dinov2": {**_VIT, "image_size": 224}, "ConvNext": {},
          "ConvNextV2": {}, "MobileViT": {"image_size": 224}, "MobileViTV2": {"image_size": 224}, "Segformer": {},
          "Levit": {}, "PoolFormer": {}, "Swin": {}, "Swinv2": {}, "ResNet": {}, "MobileNetV1": {}, "MobileNetV2": {},
          "Bit": {}, "FocalNet": {}, "Pvt": {}, "RegNet": {}, "EfficientNet": {}}


def _text_config(family: str):
    import transformers

    config = getattr(transformers, f"{family}Config")()
    for key, value in _TEXT.items():
        if hasattr(config, key) or key in getattr(config, "attribute_map", {}):
            try:
                setattr(config, key, value)
            except NotImplementedError:  # Funnel's depth is its block_sizes, set below
                continue
    if family == "Funnel":
        config.block_sizes, config.d_model, config.n_head, config.d_head, config.d_inner = [1, 1], 128, 4, 32, 512
    if family == "SqueezeBert":
        config.embedding_size = 128
    if family == "Albert":
        config.embedding_size = 128
    if family == "MobileBert":
        config.embedding_size, config.intra_bottleneck_size, config.true_hidden_size = 128, 128, 128
    if family == "ModernBert":
        config.global_attn_every_n_layers, config.local_attention = 2, 32
        config.num_hidden_layers = 4  # alternating local and global layers
    if hasattr(config, "pooler_hidden_size"):  # DebertaV2's pooler keeps its default width otherwise
        config.pooler_hidden_size = config.hidden_size
    head_dim = config.hidden_size // config.num_attention_heads
    if hasattr(config, "head_dim") and family not in ("Funnel",):
        try:
            config.head_dim = head_dim
        except AttributeError:  # Falcon's head_dim is computed from the sizes above
            pass
    if getattr(config, "rotary_dim", None):  # GPT-J, CodeGen: a rotary part wider than a head does not fit
        config.rotary_dim = min(config.rotary_dim, head_dim)
    config.num_labels = 4
    return config


def sweep_models() -> list:
    """The sweep's models as zoo entries (a builder, a kind, an input shape)."""
    import transformers

    from tests.zoo import ZooModel

    def encoder(family: str):
        return lambda: transformers.AutoModelForSequenceClassification.from_config(_text_config(family))

    def decoder(family: str):
        return lambda: transformers.AutoModelForCausalLM.from_config(_text_config(family))

    def vision(family: str, overrides: dict):
        def build():
            config = getattr(transformers, f"{family}Config")(**overrides)
            config.num_labels = 10
            # the family's own class: transformers' auto class cannot build some families from a
            # bare config (DeiT's: "'NoneType' object is not iterable", its config names no architecture)
            own = getattr(transformers, f"{family}ForImageClassification", None)
            return own(config) if own is not None else transformers.AutoModelForImageClassification.from_config(config)
        return build

    entries = [ZooModel(f, encoder(f), "tokens", TOKENS) for f in ENCODERS]
    entries += [ZooModel(f, decoder(f), "tokens", TOKENS) for f in DECODERS]
    entries += [ZooModel(f, vision(f, o), "image", IMAGE) for f, o in VISION.items()]
    return entries


@dataclass(frozen=True)
class Config:
    """What one sweep measures.

    Attributes:
        families: the families to run (empty, and ``text`` off: all of them).
        text: every text family (encoders and decoders) besides ``families``.
        rounds: interleaved timing rounds per family (at least 20 for a verdict near a goal's line).
        round_ms: milliseconds of runs per file and round: the sweep's models take 1-30 ms, and a
            round of six runs of a 1 ms file moved ratios by ±0.15 between runs.
    """

    families: tuple[str, ...] = option((), "families, comma-separated (default: all)")
    text: bool = option(False, "every text family (encoders and decoders) besides --families")
    rounds: int = option(8, "interleaved timing rounds per family (>= 20 near a goal's line)")
    round_ms: float = option(150.0, "milliseconds of runs per file and round")
    front_door: bool = option(False, "export_pretrained on each family's folder, float and INT8, instead of the "
                                     "quantizer comparison (the pretrained benchmark's table)")
    optimum: str | None = option(None, "with --front-door: optimum-cli of an environment with optimum-onnx, "
                                       "for Optimum's exporter side by side")

    def check(self) -> None:
        known = {*ENCODERS, *DECODERS, *VISION}
        unknown = [f for f in self.families if f not in known]
        if unknown:
            raise ValueError(f"unknown families {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
        if self.rounds < 1 or self.round_ms <= 0:
            raise ValueError("--rounds must be at least 1 and --round-ms above 0")
        if self.optimum and not self.front_door:
            raise ValueError("--optimum is for --front-door; the quantizer sweep runs ORT's quantizer itself")
        if self.front_door and self.families and not any(f in ENCODERS or f in VISION for f in self.families):
            raise ValueError(f"--front-door exports encoder and vision families; {', '.join(self.families)} are "
                             f"decoders (the llm benchmark exports them)")

    def chosen(self) -> tuple[str, ...]:
        """The families this run measures (empty: all)."""
        text = [f for f in (*ENCODERS, *DECODERS) if f not in self.families] if self.text else []
        return (*self.families, *text)


def _runs_for(fp32: Path, sample, round_ms: float) -> int:
    """Runs per round so that a round of the FP32 file lasts about ``round_ms`` (6 to 200)."""
    from onnxport.runtime import make_session

    session = make_session(str(fp32), optimized=True)
    feed = {session.get_inputs()[0].name: sample}
    for _ in range(3):
        session.run(None, feed)
    start = time.perf_counter()
    for _ in range(5):
        session.run(None, feed)
    each = (time.perf_counter() - start) / 5 * 1e3
    return max(6, min(200, round(round_ms / max(each, 1e-3))))


def _pairwise(rounds: dict[str, dict[int, list[float]]], speedup: dict[str, float]) -> dict[str, float]:
    """Ours against ORT's best option of each kind, as the median of the rounds' own ratios
    (ORT's milliseconds / ours in the same round).

    A ratio of two speed-ups (each a median of ratios to FP32) carries both files' noise against a
    third; on the 1-2 ms text files it put ModernBERT's dynamic file at 0.95 of ORT's in two sweeps
    where their optimised graphs ran the same kernels, and 100-run rounds side by side gave 1.00.
    """
    pairs = {"ours_vs_ort_static": ("ours", ("ort_static", "ort_static_rr")),
             "ours_vs_ort_best": ("ours", tuple(k for k in speedup if k.startswith("ort_"))),
             "ours_dynamic_vs_ort_dynamic": ("ours_dynamic", ("ort_dynamic", "ort_dynamic_rr")),
             "ours_dynamic_vs_itself": ("ours_dynamic", (SAME,))}
    found = {}
    for key, (ours, options) in pairs.items():
        options = tuple(o for o in options if o in speedup and o in rounds)
        if ours not in rounds or not options:
            continue
        best = max(options, key=speedup.__getitem__)
        found[key] = statistics.median(o / u for o, u in zip(rounds[best][1], rounds[ours][1]))
    return found


def _op_difference(ours: Path, theirs: Path) -> dict[str, dict[str, int]]:
    """The operators ONNX Runtime runs (its optimised graph) in one file and not the other:
    ``{"ours_only": {op: n}, "ort_only": {op: n}}``. Empty on both sides, the two files run the
    same kernels, and a difference in their speed is the machine's."""
    from onnxport.inspection.stats import ort_optimised_ops

    a, b = ort_optimised_ops(ours), ort_optimised_ops(theirs)
    return {"ours_only": dict(a - b), "ort_only": dict(b - a)}


def _one(entry, out: Path, config: Config) -> dict:
    import torch

    from bench.zoo import _fused, _latencies, input_name
    from onnxport import Quantizer, compare_qdq, export_onnx, export_qdq
    from onnxport.passes.ort_quantize import OrtQuantizeOptions, quantize_file

    model = entry.model()
    if entry.kind == "tokens":  # the sweep's text models hold their vocabulary at _TEXT's size
        vocab = _TEXT["vocab_size"]
        sample_of = lambda batch, seed: torch.randint(3, vocab, (batch, *TOKENS),
                                                      generator=torch.Generator().manual_seed(seed))
    else:
        sample_of = lambda batch, seed: entry.sample(batch=batch, seed=seed)
    calibration = [sample_of(1, 10 + i) for i in range(4)]
    sample, check = sample_of(1, 0), sample_of(4, 3)
    result: dict = {"kind": entry.kind}
    start = time.perf_counter()
    files = {"fp32": export_onnx(model, sample, out / "fp32.onnx", dynamic_batch=False)}
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    files["ours"] = export_qdq(quantized, sample, out / "ours.onnx")
    first = compare_qdq(quantized, files["ours"], check, rounding_floor=True).outputs[0]
    result["ours"] = {"cosine": first.cosine_similarity, "rounding_floor": list(first.rounding_floor),
                      "within_floor": first.within_floor, **_fused(files["ours"])}
    if entry.kind == "tokens":  # the dynamic scheme: no calibration, DynamicQuantizeLinear + MatMulInteger
        dynamic = Quantizer(activations="dynamic").quantize(model, [sample])
        files["ours_dynamic"] = export_qdq(dynamic, sample, out / "ours_dynamic.onnx")
        first = compare_qdq(dynamic, files["ours_dynamic"], check, rounding_floor=True, optimized=True).outputs[0]
        result["ours_dynamic"] = {"cosine": first.cosine_similarity, "rounding_floor": list(first.rounding_floor),
                                  "within_floor": first.within_floor}
        # the same file timed again as if it were another: how far apart two equal files land
        # decides whether a dynamic ratio a point or two below 1.00 says anything
        files[SAME] = files["ours_dynamic"]
    result["seconds_ours"] = time.perf_counter() - start
    start = time.perf_counter()
    modes = ("static", "dynamic") if entry.kind == "tokens" else ("static",)
    feeds = [{input_name(files["fp32"]): batch.numpy()} for batch in calibration]
    for mode in modes:
        for suffix, reduce_range in (("", False), ("_rr", True)):
            name = f"ort_{mode}{suffix}"
            # ORT's quantizer on the FP32 file itself (what a user of ORT's tools starts from), not on a
            # second export of the model: the same graph, one torch export fewer per variant
            options = OrtQuantizeOptions(mode, feeds, reduce_range=reduce_range)
            try:
                quantize_file(files["fp32"], out / f"{name}.onnx", options, large=False)
                files[name] = out / f"{name}.onnx"
            except Exception as error:  # noqa: BLE001 — ORT's quantizer failing is a result of the sweep
                result[name] = {"error": f"{type(error).__name__}: {error}"[:200]}
    result["seconds_ort"] = time.perf_counter() - start
    if "ours_dynamic" in files and "ort_dynamic" in files:
        result["dynamic_ops"] = _op_difference(files["ours_dynamic"], files["ort_dynamic"])
    start = time.perf_counter()
    with torch.no_grad():
        runs = _runs_for(files["fp32"], sample.numpy(), config.round_ms)
        rounds = _latencies(files, {1: sample.numpy()}, runs=runs, rounds=config.rounds)
    result["seconds_timing"] = time.perf_counter() - start
    result["speedup"] = {name: statistics.median(f / t for f, t in zip(rounds["fp32"][1], ms[1]))
                         for name, ms in rounds.items()}
    ort = {k: v for k, v in result["speedup"].items() if k.startswith("ort_")}
    best = max(ort, key=ort.get) if ort else None
    result["ort_best"] = best
    result["ours_vs_ort_best"] = result["speedup"]["ours"] / ort[best] if best else None
    result["pairwise"] = _pairwise(rounds, result["speedup"])
    if best:  # what ORT runs in INT8 in its own best file, beside ours
        from onnxport.inspection.stats import ort_int8_counts

        result["ort_best_int8"] = {op: f"{c['int8']}/{c['int8'] + c['float']}"
                                   for op, c in ort_int8_counts(files[best]).items() if c["int8"] or c["float"]}
    return result


def run(config: Config = Config(), out_dir: Path | None = None) -> dict:
    import logging
    import sys
    import warnings

    from onnxport import cpu_int8

    if config.front_door:
        return _front_door(config)
    if out_dir is None:
        with tempfile.TemporaryDirectory(prefix="onnxport-bench-sweep-") as scratch:
            return run(config, Path(scratch))
    out = Path(out_dir)
    families = config.chosen()
    logging.getLogger("torch").setLevel(logging.ERROR)
    results: dict = {"_isa": cpu_int8().describe(), "_rounds": config.rounds}
    for entry in sweep_models():
        if families and entry.name not in families:
            continue
        start = time.perf_counter()
        folder = out / entry.name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[entry.name] = _one(entry, folder, config)
        except Exception as error:  # noqa: BLE001 — one family failing is a row of the table, not the end
            results[entry.name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]}
        results[entry.name]["seconds"] = time.perf_counter() - start
        print(f"  {entry.name}: {results[entry.name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    return results


def _front_door(config: Config) -> dict:
    """The front door on the sweep's encoder and vision families, float and INT8."""
    from bench import pretrained

    families = tuple(f for f in config.chosen() if f in ENCODERS or f in VISION)
    results = pretrained.run(pretrained.Config(optimum=config.optimum, families=families, rounds=config.rounds,
                                               int8=True))
    results["_front_door"] = True
    return results


def _short(reasons: list[str]) -> list[str]:
    """``qdq_report``'s reasons up to their first comma: the table names the cause, the docs explain it."""
    return [reason.split(",")[0] for reason in reasons]


def _ours_vs_ort(e: dict) -> tuple[float | None, float | None]:
    """Ours against ORT's best file and its best static file: the rounds' own ratios where the run
    kept them, a ratio of speed-ups in results files from before."""
    pairwise, speed = e.get("pairwise", {}), e["speedup"]
    static = [speed[k] for k in ("ort_static", "ort_static_rr") if k in speed]
    return (pairwise.get("ours_vs_ort_best", e["ours_vs_ort_best"]),
            pairwise.get("ours_vs_ort_static", speed["ours"] / max(static) if static else None))


def report(results: dict) -> str:
    if results.get("_front_door"):
        from bench import pretrained

        return pretrained.report(results)
    rows, below = [], []
    for name, e in results.items():
        if name.startswith("_"):
            continue
        if "error" in e:
            rows.append([name, f"failed: {e['error'][:90]}", *[""] * 7])
            continue
        best = e["ort_best"]
        ours = e["speedup"]["ours"]
        floor = e["ours"]["rounding_floor"]
        ratio, static = _ours_vs_ort(e)
        if (static is not None and static < 0.97) or (best and ours < 1.0 <= e["speedup"][best]):
            below.append(name)
        rows.append([
            name, f"{ours:.2f}x", f"{e['speedup'][best]:.2f}x ({best.removeprefix('ort_')})",
            f"{static:.2f}" if static is not None else "", f"{ratio:.2f}" if ratio is not None else "",
            f"{e['ours']['cosine']:.5f} ({min(floor):.5f}–{max(floor):.5f})"
            + ("" if e["ours"]["within_floor"] else " BELOW 2x floor"),
            ", ".join(f"{op} {c}" for op, c in e["ours"]["ort_int8"].items()),
            ", ".join(f"{op} {c}" for op, c in e.get("ort_best_int8", {}).items()),
            "; ".join([*_short(e["ours"]["float_in_file"][:3]),
                       *(f"{k} ({n})" for k, n in e["ours"].get("costlier_than_float", {}).items())])])
    unfaithful = [n for n, e in results.items() if not n.startswith("_") and "ours" in e and not e["ours"]["within_floor"]]
    main = table(
        ["model", "ours", "ORT best (which)", "ours / ORT static", "ours / ORT best", "cosine as deployed (floor min–max)",
         "INT8 in ORT: ours",
         "ORT best's", "float or costlier than float in our file (qdq_report)"], rows,
        title=[("The sweep on ONNX Runtime (CPU), batch 1, fixed shapes: x = FP32 latency / file latency (median of the "
               "rounds' ratios);"),
               "ORT's best of quantize_static and quantize_dynamic (text), each with and without reduce_range ('rr');",
               "ours / ORT static (the goal, >= 0.97) and ours / ORT best: the rounds' own ratios to ORT's best option.",
               f"CPU: {results.get('_isa', 'see the run results file')}; {results.get('_rounds', 8)} rounds"],
        notes=[f"Below 0.97x ORT's best static file (or below FP32 where ORT is not): {', '.join(below) or 'none'}",
               f"Beyond twice the model's rounding floor as deployed: {', '.join(unfaithful) or 'none'}"])
    dynamic = dynamic_report(results)
    return main + ("\n\n" + dynamic if dynamic else "")


def _ops_text(difference: dict | None) -> str:
    if difference is None:
        return ""
    side = lambda ops: ", ".join(f"{op} {n}" for op, n in sorted(ops.items())) or "—"
    return f"{side(difference['ours_only'])} / {side(difference['ort_only'])}"


def dynamic_report(results: dict) -> str:
    """The dynamic scheme (``Quantizer(activations='dynamic')``) against ORT's ``quantize_dynamic``
    (the better of its default and ``reduce_range``), text families only ('' when none ran)."""
    measured = [(n, e) for n, e in results.items() if not n.startswith("_") and "ours_dynamic" in e.get("speedup", {})]
    if not measured:
        return ""
    rows, below = [], []
    for name, e in measured:
        speed = e["speedup"]
        ort = {k: speed[k] for k in ("ort_dynamic", "ort_dynamic_rr") if k in speed}
        best = max(ort, key=ort.__getitem__) if ort else None
        ratio = e.get("pairwise", {}).get("ours_dynamic_vs_ort_dynamic",
                                          speed["ours_dynamic"] / ort[best] if best else None)
        itself = e.get("pairwise", {}).get("ours_dynamic_vs_itself")
        spread = abs(1.0 - itself) if itself is not None else 0.0
        # below only by more than the file differs from itself in the same rounds
        if ratio is not None and ratio < 1.0 - spread:
            below.append(name)
        d = e["ours_dynamic"]
        rows.append([name, f"{speed['ours_dynamic']:.2f}x",
                     f"{ort[best]:.2f}x ({best.removeprefix('ort_')})" if best else "failed",
                     f"{ratio:.2f}" if ratio is not None else "", f"{itself:.2f}" if itself is not None else "",
                     _ops_text(e.get("dynamic_ops")),
                     f"{d['cosine']:.5f} ({min(d['rounding_floor']):.5f}–{max(d['rounding_floor']):.5f})"
                     + ("" if d["within_floor"] else " BELOW 2x floor")])
    return table(["model", "ours dynamic", "ORT quantize_dynamic (which)", "ours / ORT's", "same file / itself",
                  "ORT runs only in ours / only in ORT's", "cosine as deployed (floor min–max)"], rows,
                 title=[("Dynamic INT8 (no calibration): ours = Quantizer(activations='dynamic') + export_qdq; ORT's = "
                         "quantize_dynamic, the better of default and reduce_range."),
                        ("ours / ORT's: the rounds' own ratios; same file / itself: our file timed again under another "
                         "name in the same rounds (how far two equal files land apart).")],
                 notes=[(f"Below 1.00x ORT's quantize_dynamic by more than the file differs from itself: "
                        f"{', '.join(below) or 'none'}")])



if __name__ == "__main__":
    import sys

    from bench.__main__ import main

    sys.exit(main(["sweep", *sys.argv[1:]]))
