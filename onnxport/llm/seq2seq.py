"""``export_seq2seq``: a transformers encoder–decoder (T5, BART, Marian, mBART, M2M100, Pegasus,
Whisper, …) to an encoder file and one decoder file with its cache, proven by decoding with the
pair against the model."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._core.io import check_output_folder, release_freed_memory
from .._core.torch_helpers import drop_weights, eval_mode
from ..compare import (
    CosineAtLeast,
    Report,
    RunResults,
    WithinFloatFloor,
    compare_runs,
    relative_distance,
)
from ..compare.exported import FLOAT_FLOOR_MULTIPLE, float64_result, nonfinite_reason
from ..engine import validate_opset
from ..errors import ExportRefusedError, InvalidArgumentError, WeakerCheckWarning, check_choice
from .export import (
    DEFAULT_OPSET,
    FLAVOURS,
    FP32_TOLERANCE,
    PRECISIONS,
    PROOF_TOKENS,
    WEIGHT_ONLY_COSINE,
    WEIGHT_ONLY_OPSET,
)
from .names import DECODER_FILE, ENCODER_FILE, INPUT_FEATURES, INPUT_IDS, LAST_HIDDEN_STATE, LOGITS
from .names import SEQ2SEQ_METADATA_KEY as METADATA_KEY
from .search import DecoderStep, Settings, greedy_or_sample, interleave
from .seq2seq_generate import Encode, ort_decoder, ort_encoder
from .seq2seq_model import (
    Seq2SeqShape,
    check_split,
    decoder_call,
    decoder_forward,
    encoder_call,
    encoder_forward,
    load_seq2seq,
    sample_source,
    seq2seq_shape,
    start_token,
)

#: fp16 files against ``model.half()``, int4/int8 against the torchao model they store: ONNX
#: Runtime computes that model's arithmetic in another order (export_decoder's bound).
QUANTIZED_COSINE = WEIGHT_ONLY_COSINE
#: save_pretrained's companions a generator needs beside the files (tokenizers, processors);
#: config.json and generation_config.json are written from the model itself.
COMPANION_SUFFIXES = (".json", ".model", ".spm", ".txt", ".tiktoken")
_NOT_COMPANIONS = ("config.json", "generation_config.json")


@dataclass
class Seq2SeqFiles:
    """What :func:`export_seq2seq` wrote and proved. ``os.fspath`` gives the folder.

    Attributes:
        folder: the output folder; ``encoder``, ``decoder``: its two files.
        encoder_agreement: the encoder file's outputs (its output and every layer's cross keys
            and values) against the model's, at ONNX Runtime's unoptimised level.
        agreement: the decoder's logits at every step of the proof's decoding (the encoder file
            feeding it), unoptimised; ``deployed``: the same at ONNX Runtime's default level.
        token_agreement: the share of the proof's greedy tokens the files (default level) pick as
            the model does, each step fed the model's own previous token.
        fusions: per file, the fused operators it holds, by type (``'ort-cpu'``:
            com.microsoft MultiHeadAttention, SkipLayerNormalization, BiasGelu, …).
        genai_config: Whisper at its 30 s of frames: the ``genai_config.json`` onnxruntime-genai
            runs the pair with (None otherwise).
        shared_weights: the decoder's weights stored once, in the encoder's data file
            (``encoder_model.onnx.data``): a text model's shared embedding table.
    """

    folder: Path
    encoder: Path
    decoder: Path
    precision: str
    flavour: str
    shape: Seq2SeqShape
    encoder_agreement: Report | None = None
    agreement: Report | None = None
    fusions: dict[str, dict[str, int]] = field(default_factory=dict)
    deployed: Report | None = None
    token_agreement: float = 1.0
    genai_config: Path | None = None
    shared_weights: list[str] = field(default_factory=list)

    def __fspath__(self) -> str:
        return str(self.folder)

    def __str__(self) -> str:
        return str(self.folder)

    def summary(self) -> str:
        """What was written and how it was proven, in a few lines."""
        lines = [
            (f"{self.folder} ({self.shape.model_type}: {ENCODER_FILE} + {DECODER_FILE}, {self.shape.layers} decoder "
            f"layers, {self.precision}, {self.flavour})"),
            f"  greedy tokens as the model's (default level): {self.token_agreement:.1%}",
        ]
        if self.genai_config is not None:
            lines.append(f"  onnxruntime-genai: {self.genai_config.name}")
        if self.shared_weights:
            lines.append(f"  stored once, read by both files from {ENCODER_FILE}.data: {', '.join(self.shared_weights)}")
        for file, fused in self.fusions.items():
            if fused:
                lines.append(f"  {file} fused for ONNX Runtime: {', '.join(f'{k} {v}' for k, v in fused.items())}")
        for label, report in (("encoder outputs", self.encoder_agreement), ("logits, unoptimised", self.agreement),
                              ("logits, default level", self.deployed)):
            if report is not None:
                worst = min(r.cosine_similarity for r in report.outputs)
                lines.append(f"  {label} vs the model: min cosine {worst:.8f}, "
                             f"max |diff| {max(r.max_abs_error for r in report.outputs):.3g}")
        return "\n".join(lines)


def _output_dir(output_dir: Any) -> Path:
    if not isinstance(output_dir, (str, os.PathLike)):
        raise InvalidArgumentError(f"output_dir must be a folder path (str or os.PathLike), not {type(output_dir).__name__}.")
    path = Path(output_dir)
    if path.suffix == ".onnx":
        raise InvalidArgumentError(
            f"output_dir '{path}' names a .onnx file; export_seq2seq writes a folder ({ENCODER_FILE}, {DECODER_FILE} "
            f"and the model's configs): give a folder."
        )
    return check_output_folder(path)


def torch_encoder(model: Any, shape: Seq2SeqShape, start: int) -> Encode:
    """The encode function of the PyTorch model itself (the proof's reference), speech features
    given in the shape's float type (the model's own weights may be narrower until they run)."""
    dtype = getattr(torch, shape.cache_dtype)

    def encode(source: np.ndarray, mask: np.ndarray | None) -> list[np.ndarray]:
        given = torch.from_numpy(source)
        with torch.no_grad():
            out = encoder_call(model, given.to(dtype) if shape.audio else given,
                               None if mask is None else torch.from_numpy(mask), shape.audio, start)
        # contiguous once: every decoder step reads the cross keys and values (30 s of audio: a
        # copy of them per step otherwise)
        return [np.ascontiguousarray(t.numpy()) for t in out]

    return encode


def torch_decoder(model: Any, shape: Seq2SeqShape) -> DecoderStep:
    """The decoder step of the PyTorch model itself."""

    def step(ids: np.ndarray, mask: np.ndarray | None, own: list[np.ndarray],
             cross: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        past = tuple(torch.from_numpy(np.ascontiguousarray(t)) for t in interleave(own, cross))
        with torch.no_grad():
            out = decoder_call(model, shape.layers, shape.hidden, torch.from_numpy(ids),
                               None if mask is None else torch.from_numpy(mask), past, speech_mask=shape.speech_mask)
        return out[0].numpy(), [t.numpy() for t in out[1:]]

    return step


@dataclass
class _Proof:
    """The proof's sources, the model's tokens on them, and the references each file is held to."""

    source: np.ndarray
    mask: np.ndarray | None
    #: the decoder's ``encoder_attention_mask``: the source's mask, or a speech encoder's own
    decoder_mask: np.ndarray | None
    prompt: np.ndarray
    tokens: np.ndarray
    encoder_outputs: list[np.ndarray]
    logits: list[np.ndarray]
    #: the model in float64: its encoder outputs and logits, and the float32 run's distance from them
    wide_encoder: list[np.ndarray] | None = None
    wide_logits: list[np.ndarray] | None = None
    encoder_floors: dict[str, float] | None = None
    logit_floors: dict[str, float] | None = None


def _greedy(start: int) -> Settings:
    """The proof's search: the model's own largest logit, no processors, a fixed length."""
    return Settings(decoder_start_token_id=start, max_new_tokens=PROOF_TOKENS)


def _forced(step: DecoderStep, cross: list[np.ndarray], mask: np.ndarray | None, proof: _Proof,
            start: int) -> tuple[list[np.ndarray], float]:
    """``step``'s logits at every step, fed the model's tokens (teacher forcing), and how often
    its own pick matched them."""
    forced = iter(proof.tokens[:, proof.prompt.shape[1]:].T)
    logits: list[np.ndarray] = []
    agree: list[bool] = []

    def choose(scores: np.ndarray) -> np.ndarray:
        chosen = next(forced)
        agree.extend(scores.argmax(-1) == chosen)
        return chosen

    greedy_or_sample(step, cross, mask, proof.prompt, _greedy(start), on_logits=logits.append, choose=choose)
    return logits, float(np.mean(agree))


def _step_names(n: int) -> list[str]:
    return ["first step"] + [f"step {i}" for i in range(1, n)]


def _reference(model: Any, shape: Seq2SeqShape, start: int) -> _Proof:
    source_t, mask_t = sample_source(model, 2, 7, seed=1)
    source = source_t.numpy()
    mask = None if mask_t is None else mask_t.numpy()
    prompt = np.full((2, 1), start, np.int64)
    encoded = torch_encoder(model, shape, start)(source, mask)
    decoder_mask = shape.decoder_mask(encoded, mask)
    logits: list[np.ndarray] = []
    tokens = greedy_or_sample(torch_decoder(model, shape), shape.cross(encoded), decoder_mask, prompt, _greedy(start),
                              on_logits=logits.append)
    return _Proof(source, mask, decoder_mask, prompt, tokens, encoded, logits)


def _float_floor(model: Any, shape: Seq2SeqShape, start: int, proof: _Proof, *, owned: bool) -> str | None:
    """Fill the proof's float64 references and floors, or say why they cannot be measured. A model
    ``owned`` (loaded here) is widened a layer at a time while it runs: no float64 copy beside it
    (:func:`~onnxport.compare.exported.float64_result`)."""
    wide_shape = dataclasses.replace(shape, cache_dtype="float64")

    def run(wide: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        with eval_mode(wide):
            encoded = torch_encoder(wide, wide_shape, start)(proof.source, proof.mask)
            return encoded, _forced(torch_decoder(wide, wide_shape), wide_shape.cross(encoded), proof.decoder_mask, proof,
                                    start)[0]

    wide_run = float64_result(model, run, in_place=owned)
    if isinstance(wide_run, str):
        return wide_run
    encoded, logits = wide_run
    broken = nonfinite_reason(encoded, proof.encoder_outputs) or nonfinite_reason(logits, proof.logits)
    if broken is not None:
        return broken
    proof.wide_encoder, proof.wide_logits = encoded, logits
    proof.encoder_floors = {n: relative_distance(a, b) for n, a, b in zip(shape.encoder_outputs, proof.encoder_outputs, encoded)}
    proof.logit_floors = {n: relative_distance(a, b) for n, a, b in zip(_step_names(len(logits)), proof.logits, logits)}
    return None


def _compare(names: list[str], got: list[np.ndarray], ref: list[np.ndarray], floors: dict[str, float] | None,
             level: str, precision: str) -> Report:
    strategy: Any = (WithinFloatFloor(FLOAT_FLOOR_MULTIPLE) if floors is not None
                     else CosineAtLeast(QUANTIZED_COSINE) if precision != "fp32" else FP32_TOLERANCE)
    runner = "the PyTorch model" + (" in float64" if floors is not None else "")
    return compare_runs(RunResults(f"the files (ONNX Runtime, {level})", dict(zip(names, got)), 2),
                        RunResults(runner, dict(zip(names, ref)), 2), strategy, float_floors=floors)


def _axes(shape: Seq2SeqShape) -> tuple[dict[str, dict[int, str]], dict[str, dict[int, str]]]:
    """The encoder's and the decoder's symbolic axes (Whisper's frames are fixed; a speech
    encoder of any length takes ``frames`` or ``samples``)."""
    if shape.audio and not shape.source_mask:
        encoder = {shape.encoder_inputs[0]: {0: "batch"}}
        cross_axes = {0: "batch"}
    else:
        length = "source" if not shape.audio else "samples" if shape.source_dims == (None,) else "frames"
        encoder = {name: {0: "batch", 1: length} for name in shape.encoder_inputs}
        cross_axes = {0: "batch", 2: "source"}
    decoder: dict[str, dict[int, str]] = {shape.decoder_inputs[0]: {0: "batch", 1: "sequence"}}
    if shape.source_mask:
        decoder[shape.decoder_inputs[1]] = {0: "batch", 1: "source"}
    for name in shape.past_names:
        decoder[name] = {0: "batch", 2: "past_sequence"} if ".decoder." in name else dict(cross_axes)
    return encoder, decoder


def export_seq2seq(
    source: Any,
    output_dir: str | os.PathLike,
    *,
    precision: str = "fp32",
    flavour: str = "portable",
    group_size: int = 32,
    opset_version: int | None = None,
) -> Seq2SeqFiles:
    """Export a transformers encoder–decoder to an encoder file and one decoder file with its cache.

    ``output_dir`` receives ``encoder_model.onnx`` and ``decoder_model.onnx``, the model's
    ``config.json`` and ``generation_config.json``, and the tokenizer and processor files of the
    folder it came from; :func:`onnxport.llm.generate` generates with it. A weight both files hold
    (a shared embedding table, from 1 MB) is stored once, in ``encoder_model.onnx.data``, which
    the decoder reads it from (``result.shared_weights``).

    The encoder file takes ``input_ids`` and ``attention_mask`` (Whisper: ``input_features``;
    speech of any length: ``input_features`` or ``input_values`` with their ``attention_mask``) and
    gives ``last_hidden_state`` and every decoder layer's cross-attention keys and values
    (``present.{i}.encoder.key/value``): they depend on the source alone, so they are computed once;
    speech of any length also ``encoder_attention_mask``, which of its output positions hold audio,
    as the model computes it. The decoder file takes ``input_ids``, ``encoder_attention_mask`` (not
    Whisper) and, per layer,
    ``past_key_values.{i}.decoder.key/value`` (its own cache, empty at the first step) and
    ``past_key_values.{i}.encoder.key/value``; it gives ``logits`` and
    ``present.{i}.decoder.key/value``. Batch, source, sequence and past lengths are symbolic, so
    the one decoder graph runs the first step and every later one (no second copy of its weights,
    no ``If``); Whisper's encoder takes its fixed 30 s of frames.

    Args:
        source: a transformers model (``AutoModelForSeq2SeqLM``, ``AutoModelForSpeechSeq2Seq``) or
            the folder ``save_pretrained`` wrote (loaded in float32; nothing is downloaded). A
            model given is never changed.
        output_dir: the folder to write; it holds complete, proven files or is left as it was.
        precision: ``'fp32'``; ``'fp16'``: the model in float16 (weights, caches, logits), held to
            ``model.half()``; ``'int4'``/``'int8'``: every Linear's weights as torchao's integers
            (symmetric, ``group_size`` input features per scale) in ``DequantizeLinear``, which ONNX
            Runtime runs as ``MatMulNBits``, held to the torchao model; embeddings stay float.
        flavour: ``'portable'``: standard ONNX operators at ``opset_version``; ``'ort-cpu'``:
            onnxscript's fusions for ONNX Runtime's CPU (com.microsoft ``MultiHeadAttention`` for
            self- and cross-attention, ``SkipLayerNormalization`` or its RMS form, ``BiasGelu``),
            counted in the result's ``fusions``; int4 weights written as ``MatMulNBits`` at accuracy
            level 4 (held once in memory; the proof runs them at level 0 as well).
        group_size: int4/int8: input features per scale (a power of two from 16 for MatMulNBits).
        opset_version: the default-domain opset: 18 or later (default 18); int4/int8 21 or later
            (default 21: int4 and blocked scales are new there).

    Returns:
        A :class:`Seq2SeqFiles`. First, a padded batch run through the two files' forwards apart must
        give the model's own forward's logits (float32 rounding). The proof: two sources (one
        padded; Whisper: two clips) are encoded by the encoder file and decoded for 8 greedy tokens
        by the decoder file, fed the
        model's tokens, at ONNX Runtime's unoptimised level: fp32's encoder outputs and every
        step's logits must lie within the model's own float floor (its float64 run the reference,
        at most 8 times its float32 run's distance from it); fp16's and int4/int8's must reach
        cosine 0.9999 with the half or torchao model's, and int4/int8 files' integers must be
        torchao's. The default level's figures and token agreement are reported.
    """
    from tqdm.auto import tqdm

    from ..engine import output_folder_stage, share_weights

    check_choice(precision, PRECISIONS, "precision")
    check_choice(flavour, FLAVOURS, "flavour")
    lowest = WEIGHT_ONLY_OPSET if precision in ("int4", "int8") else DEFAULT_OPSET
    opset = validate_opset(lowest if opset_version is None else opset_version, lowest=lowest,
                           why=f"precision={precision!r} is written at opset {lowest} or later"
                           + (" (int4 and blocked scales are new in opset 21)." if lowest > DEFAULT_OPSET else "."))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgumentError(f"group_size must be a positive integer, not {group_size!r}.")
    folder = _output_dir(output_dir)
    model = load_seq2seq(source)
    source_folder = Path(source) if isinstance(source, (str, os.PathLike)) else None
    name = type(model).__name__
    with eval_mode(model), tqdm(total=4, desc="export_seq2seq", leave=False, disable=None) as bar:
        start = start_token(model)
        job = _prepare(model, precision, group_size, start, opset, folder, flavour, loaded=source_folder is not None)
        if precision == "fp32":
            why = _float_floor(model, job.shape, start, job.proof, owned=source_folder is not None)
            if why is not None:
                warnings.warn(
                    f"export_seq2seq cannot measure {name}'s float floor: {why}. The files are held to a fixed "
                    f"tolerance instead ({FP32_TOLERANCE.describe()}).",
                    WeakerCheckWarning,
                    stacklevel=2,
                )
        bar.update()
        with output_folder_stage(folder) as stage:
            _write_encoder(job, stage / ENCODER_FILE)
            bar.update()
            _write_decoder(job, stage, name)
            job.result.shared_weights = share_weights(stage, ENCODER_FILE, DECODER_FILE)
            bar.update()
            _write_companions(model, stage, source_folder)
            if genai_runs(job.shape):
                write_genai_config(model, job.shape, stage)
                job.result.genai_config = folder / GENAI_CONFIG
        bar.update()
    return job.result


@dataclass
class _Job:
    """What both files' writes need: the model the graphs are captured from, the one the proof
    holds them to, the quantized weights (int4/int8), and the proof's references."""

    export_model: Any
    reference_model: Any
    weights: list
    #: the models whose every tensor is ours (never the caller's): freed once the files are written
    owned: list
    shape: Seq2SeqShape
    start: int
    opset: int
    proof: _Proof
    result: Seq2SeqFiles


def _prepare(model: Any, precision: str, group_size: int, start: int, opset: int, folder: Path, flavour: str,
             *, loaded: bool) -> _Job:
    """The models of ``precision`` (the given model is never changed) and the proof's references."""
    weights: list = []
    reference = export = model
    # the model's own forward against the two files' forwards, before a copy is made from it
    float_shape = seq2seq_shape(model)
    check_split(model, float_shape, start)
    if precision == "fp32" and loaded:
        from .export import _own_tensors

        # its tensors view the mapped weights file, which stays mapped (all of it resident) while
        # any view lives: owning their memory, they free it when the files are written
        _own_tensors(model)
        release_freed_memory()
    if precision == "fp16":
        from .export import half_for_export

        # loaded here, so nobody else holds it: halved in place, no float32 copy beside it
        reference = export = half_for_export(model, in_place=loaded)
    elif precision in ("int4", "int8"):
        from ..exporters.weight_only import export_copy, quantized_weights
        from ..quantize.weight_only import quantize_weight_only

        # a head tied to the embeddings is quantized on its own (as onnxruntime-genai's builder
        # does): each step reads the whole head, so its integers are the step's largest saving,
        # while the lookups keep reading the float table (a few rows per step)
        head = model.get_output_embeddings()
        tied = head.weight is model.get_input_embeddings().weight
        reference = quantize_weight_only(
            model, f"{precision}_weight_only", group_size=group_size, symmetric=True, embeddings=False,
            untie=frozenset(n for n, m in model.named_modules() if m is head) if tied else frozenset())
        weights = quantized_weights(reference)
        export = export_copy(reference, weights)
    reference.eval()
    export.eval()
    # every tensor of these is ours to free once both files are written: a model loaded here and
    # what was made from it, or a float16 copy (an int4/int8 copy shares the caller's float tensors)
    owned = list({id(m): m for m in (model, reference, export)}.values()) if loaded else \
        [reference] if precision == "fp16" else []
    shape = float_shape if reference is model else seq2seq_shape(reference)
    if precision == "fp16":
        shape = dataclasses.replace(shape, cache_dtype="float16")
    proof = _reference(reference, shape, start)
    release_freed_memory()  # the reference run's activations, before the float floor's and the captures
    result = Seq2SeqFiles(folder, folder / ENCODER_FILE, folder / DECODER_FILE, precision, flavour, shape)
    return _Job(export, reference, weights, owned, shape, start, opset, proof, result)


def _record(job: _Job) -> dict[str, str]:
    record = {**dataclasses.asdict(job.shape), "precision": job.result.precision, "flavour": job.result.flavour}
    return {METADATA_KEY: json.dumps(record)}


def _steps(job: _Job) -> list:
    """The graph steps: export_decoder's (torchao's integers in place, onnxslim), and for
    'ort-cpu' onnxscript's ONNX Runtime fusions first."""
    from ..passes.ort_fusions import OrtFusionPass
    from .export import decoder_steps

    ort_cpu = job.result.flavour == "ort-cpu"
    return decoder_steps(job.weights, OrtFusionPass() if ort_cpu else None, nbits=ort_cpu and job.result.precision == "int4")


def _fusions_of(job: _Job, file: str) -> Any:
    def read(graph: Any) -> None:
        from ..passes.ort_fusions import fused_ops

        job.result.fusions[file] = dict(sorted(fused_ops(graph).items()))

    return read


def _weight_rules(job: _Job, present: list) -> list:
    """int4/int8: the file's integers are torchao's, for the quantized weights its graph reads
    (``present``, filled at capture: the encoder file holds the encoder's and the cross-attention
    projections, the decoder file the rest)."""
    if not job.weights:
        return []

    def integers(path: Path) -> None:
        from ..exporters.weight_only import check_weights_faithful

        check_weights_faithful(path, present)

    return [integers]


def _placed(job: _Job, graph: Any, present: list) -> Any:
    from ..exporters.weight_only import stand_in_value

    present[:] = [w for w in job.weights if stand_in_value(graph.graph, w) is not None]
    return graph


def _write_encoder(job: _Job, file: Path) -> None:
    from .._core.capture import torch_program
    from ..engine import ExportPlan, run_plan
    from .export import unoptimised_session

    shape, proof, result = job.shape, job.proof, job.result
    axes, _ = _axes(shape)
    sample, mask = sample_source(job.reference_model, 2, 5, seed=0)
    if shape.audio:
        sample = sample.to(getattr(torch, shape.cache_dtype))
    inputs = (sample,) if mask is None else (sample, mask)
    feeds = dict(zip(shape.encoder_inputs, (t.numpy() for t in inputs)))
    present: list = []

    def capture() -> Any:
        with encoder_forward(job.export_model, shape, job.start):
            return _placed(job, torch_program(job.export_model, inputs, opset_version=job.opset,
                                              input_names=shape.encoder_inputs, output_names=shape.encoder_outputs,
                                              axes=axes).model, present)

    def proven(path: Path) -> None:
        got = ort_encoder(unoptimised_session(path))(proof.source, proof.mask)
        reference = proof.wide_encoder or proof.encoder_outputs
        result.encoder_agreement = _compare(shape.encoder_outputs, got, reference, proof.encoder_floors, "unoptimised",
                                            result.precision)
        if not result.encoder_agreement:
            raise ExportRefusedError(
                f"The encoder file does not compute what the model's encoder computes:\n{result.encoder_agreement}\n"
                f"Nothing was kept."
            )

    # both files keep their weights in data files: written tensor by tensor, and read lazily by
    # the step that stores a weight both hold once (share_weights), so neither costs a copy
    # speech of any length is proven at the proof's clips, a whole number of tenths of a second
    # (a framed encoder takes whole frames: Moonshine Streaming's 80 samples), not one sample longer
    sizes = [feeds, dict(zip(shape.encoder_inputs, (proof.source, proof.mask)))] if shape.speech_mask else None
    run_plan(ExportPlan("export_seq2seq encoder", job.opset, feeds, capture, _steps(job), axes=axes, samples=sizes,
                        keep_reference=False, rules=[*_weight_rules(job, present), proven],
                        before_write=_fusions_of(job, ENCODER_FILE),
                        metadata=_record(job), external_data=True), file)


def _write_decoder(job: _Job, stage: Path, name: str) -> None:
    from .._core.capture import torch_program
    from ..engine import ExportPlan, run_plan
    from ..runtime import make_session
    from .export import unoptimised_session

    shape, proof, result = job.shape, job.proof, job.result
    _, axes = _axes(shape)
    generator = torch.Generator().manual_seed(2)
    cross = [torch.from_numpy(t) for t in shape.cross(proof.encoder_outputs)]
    dtype = getattr(torch, shape.cache_dtype)
    own = [torch.randn(2, shape.heads, 4, shape.head_dim, generator=generator).to(dtype) for _ in cross]
    ids = torch.from_numpy(proof.tokens[:, :3].copy())
    mask = None if proof.decoder_mask is None else torch.from_numpy(proof.decoder_mask)
    inputs = (ids, *([] if mask is None else [mask]), *interleave(own, cross))
    present: list = []

    def feeds(past: int, length: int) -> dict[str, np.ndarray]:
        values = [proof.tokens[:, past:past + length].copy(), *([] if mask is None else [proof.decoder_mask]),
                  *interleave([t[:, :, :past].numpy().copy() for t in own], shape.cross(proof.encoder_outputs))]
        return dict(zip(shape.decoder_inputs, values))

    def capture() -> Any:
        with decoder_forward(job.export_model, shape):
            # torch.export takes every traced size to be at least 2
            return _placed(job, torch_program(job.export_model, inputs, opset_version=job.opset,
                                              input_names=shape.decoder_inputs, output_names=shape.decoder_outputs,
                                              axes=axes).model, present)

    def release() -> None:
        # both files are written and the proofs' references computed: a model loaded here is
        # not run again, and its weights would sit beside the proofs' sessions
        drop_weights(*job.owned)

    def decoding(path: Path) -> None:
        # the written encoder feeds the decoder at both levels (ONNX semantics for its outputs)
        encoded = ort_encoder(unoptimised_session(stage / ENCODER_FILE))(proof.source, proof.mask)
        levels = {}
        for optimized in (False, True):
            step = ort_decoder(make_session(path) if optimized else unoptimised_session(path))
            levels[optimized] = _forced(step, shape.cross(encoded), shape.decoder_mask(encoded, proof.mask), proof,
                                        job.start)
            del step  # one session's copy of the weights at a time
        reference = proof.wide_logits or proof.logits
        names = _step_names(len(reference))
        result.agreement = _compare(names, levels[False][0], reference, proof.logit_floors, "unoptimised",
                                    result.precision)
        if not result.agreement:
            raise ExportRefusedError(
                f"The encoder and decoder files do not generate what {name} generates:\n{result.agreement}\nNothing was kept."
            )
        result.deployed = _compare(names, levels[True][0], reference, proof.logit_floors, "default level",
                                   result.precision)
        result.token_agreement = levels[True][1]

    run_plan(ExportPlan("export_seq2seq decoder", job.opset, feeds(0, 1), capture, _steps(job),
                        axes=axes, samples=[feeds(0, 1), feeds(3, 1), feeds(2, 3)], keep_reference=False,
                        rules=[*_weight_rules(job, present), decoding], metadata=_record(job),
                        before_write=_fusions_of(job, DECODER_FILE), after_write=release,
                        external_data=True),
             stage / DECODER_FILE)


def _write_companions(model: Any, stage: Path, source_folder: Path | None) -> None:
    """config.json and generation_config.json from the model, and the tokenizer and processor
    files of the folder it was loaded from."""
    model.config.to_json_file(stage / "config.json")
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.to_json_file(stage / "generation_config.json")
    if source_folder is None:
        return
    for path in sorted(source_folder.iterdir()):
        if (path.is_file() and path.suffix in COMPANION_SUFFIXES and path.name not in _NOT_COMPANIONS
                and not path.name.endswith(".index.json")):
            shutil.copyfile(path, stage / path.name)


#: onnxruntime-genai runs Whisper at its 30 s of frames only (its audio state takes 3000).
GENAI_WHISPER_FRAMES = 3000
GENAI_CONFIG = "genai_config.json"


def genai_runs(shape: Seq2SeqShape) -> bool:
    """Whether onnxruntime-genai can run the pair: its Whisper model, at the frames it takes."""
    return shape.model_type == "whisper" and shape.frames == GENAI_WHISPER_FRAMES


def genai_whisper_config(model: Any, shape: Seq2SeqShape) -> dict[str, Any]:
    """onnxruntime-genai's configuration for a Whisper pair (its keys as its model builder writes
    them), naming the files' own inputs and outputs: the encoder's cross keys/values are its
    cross cache, the decoder's growing cache is not a shared buffer (present = past + new)."""
    config, generation = model.config, model.generation_config

    def token(name: str) -> Any:
        value = getattr(generation, name, None)
        return getattr(config, name, None) if value is None else value

    eos = token("eos_token_id")
    session = {"log_id": "onnxruntime-genai", "provider_options": []}
    max_length = int(generation.max_length or shape.max_target_positions or 448)
    if shape.max_target_positions is not None:
        max_length = min(max_length, shape.max_target_positions)
    return {
        "model": {
            "type": "whisper",
            "bos_token_id": token("bos_token_id"),
            "decoder_start_token_id": token("decoder_start_token_id"),
            "eos_token_id": eos,
            "pad_token_id": token("pad_token_id") if token("pad_token_id") is not None else eos,
            "vocab_size": shape.vocab,
            "context_length": shape.max_target_positions or max_length,
            "encoder": {
                "session_options": session,
                "filename": ENCODER_FILE,
                "head_size": config.d_model // config.encoder_attention_heads,
                "hidden_size": config.d_model,
                "num_attention_heads": config.encoder_attention_heads,
                "num_hidden_layers": config.encoder_layers,
                "inputs": {"audio_features": INPUT_FEATURES},
                "outputs": {"encoder_hidden_states": LAST_HIDDEN_STATE,
                            "cross_present_key_names": "present.%d.encoder.key",
                            "cross_present_value_names": "present.%d.encoder.value"},
            },
            "decoder": {
                "session_options": session,
                "filename": DECODER_FILE,
                "head_size": shape.head_dim,
                "hidden_size": shape.hidden,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.heads,
                "num_hidden_layers": shape.layers,
                "inputs": {"input_ids": INPUT_IDS,
                           "past_key_names": "past_key_values.%d.decoder.key",
                           "past_value_names": "past_key_values.%d.decoder.value",
                           "cross_past_key_names": "past_key_values.%d.encoder.key",
                           "cross_past_value_names": "past_key_values.%d.encoder.value"},
                "outputs": {"logits": LOGITS,
                            "present_key_names": "present.%d.decoder.key",
                            "present_value_names": "present.%d.decoder.value"},
            },
        },
        "search": {
            "max_length": max_length, "min_length": 0, "do_sample": False, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": False, "early_stopping": True,
            "length_penalty": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def genai_names(config: dict[str, Any], layers: int) -> dict[str, tuple[list[str], list[str]]]:
    """Every graph name a genai configuration gives, by file: {file: (inputs, outputs)}; a
    ``%d`` pattern stands for one name per decoder layer."""

    def expand(patterns: dict[str, str]) -> list[str]:
        return [n for p in patterns.values() for n in ([p % i for i in range(layers)] if "%d" in p else [p])]

    return {section["filename"]: (expand(section["inputs"]), expand(section["outputs"]))
            for section in (config["model"]["encoder"], config["model"]["decoder"])}


def write_genai_config(model: Any, shape: Seq2SeqShape, stage: Path) -> None:
    """Write ``genai_config.json`` beside the staged pair, after checking every name it gives is
    an input or output of the file it names (onnxruntime-genai binds them by name)."""
    import onnx

    config = genai_whisper_config(model, shape)
    for file, (inputs, outputs) in genai_names(config, shape.layers).items():
        graph = onnx.load(stage / file, load_external_data=False).graph
        missing = [n for n in inputs if n not in {v.name for v in graph.input}]
        missing += [n for n in outputs if n not in {v.name for v in graph.output}]
        if missing:
            raise ExportRefusedError(
                f"genai_config.json would name {', '.join(missing)}, which {file} does not have; nothing was kept."
            )
    (stage / GENAI_CONFIG).write_text(json.dumps(config, indent=2))


__all__ = ["FLAVOURS", "PRECISIONS", "Seq2SeqFiles", "export_seq2seq"]
