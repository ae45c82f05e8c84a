"""``export_decoder``: a transformers causal LM to one ONNX decoder with a key/value cache, proven
by decoding with it against the model."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from .._checks import first_line
from .._core.io import check_output_path, write_bytes_atomic
from .._core.torch_helpers import eval_mode
from ..compare import (
    CosineAtLeast,
    Report,
    RunResults,
    ScaledAllclose,
    WithinFloatFloor,
    compare_runs,
    relative_distance,
)
from ..compare.exported import (
    FLOAT_FLOOR_MULTIPLE,
    float64_result,
    nonfinite_reason,
)
from ..engine import validate_opset
from ..errors import (
    ExportRefusedError,
    InvalidArgumentError,
    OnnxportWarning,
    PerformanceWarning,
    RuntimePrecisionWarning,
    WeakerCheckWarning,
    check_choice,
)
from .experts import exportable_experts, qmoe_holds
from .experts import translation_table as experts_translation
from .generate import METADATA_KEY, decode, ort_step
from .model import DecoderShape, cached_call, cached_forward, check_cache, decoder_shape, load_causal_lm
from .names import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, past_names, position_ids_for, present_names
from .repeat import TEMPLATE_LAYERS, first_layers, layer_stack, repeat_layers

log = logging.getLogger("onnxport")

PRECISIONS = ("fp32", "fp16", "int4", "int8")
FLAVOURS = ("portable", "ort-cpu")
#: fp32 decoders' default opset: the oldest the exporter writes, read by every ORT since 1.14.
DEFAULT_OPSET = 18
#: the 'ort-cpu' flavour's default: opset 23 has Attention (grouped key/value heads),
#: RotaryEmbedding and RMSNormalization, which torch.onnx writes and ONNX Runtime runs fused
ORT_CPU_OPSET = 23
#: int4/int8 decoders: DequantizeLinear with int4 and block_size is new in opset 21.
WEIGHT_ONLY_OPSET = 21
#: New tokens the exporter's proof decodes (teacher-forced: the model's greedy tokens fed to both).
PROOF_TOKENS = 8
#: fp32 files are held to the model's own float floor (its float64 logits the reference, within
#: FLOAT_FLOOR_MULTIPLE times its float32 logits' distance); where that cannot be measured, to this.
FP32_TOLERANCE = ScaledAllclose(rtol=1e-4, atol=1e-4)
#: Weight-only files against the torchao model they store: ONNX Runtime's unoptimised run
#: computes that model's arithmetic in another order; this is the weight-only exporter's bound.
WEIGHT_ONLY_COSINE = 0.9999
#: Files save_pretrained writes beside a model that a generator needs (copied into an output folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


@dataclass
class DecoderFile:
    """What :func:`export_decoder` wrote and proved. ``os.fspath`` gives the ``.onnx`` file.

    Attributes:
        path: the ONNX decoder (its weights in ``<name>.data`` beside it).
        precision, flavour: as asked.
        fusions: the fused operators the file holds, by type: opset 23's ``Attention``,
            ``RotaryEmbedding`` and ``RMSNormalization``, and com.microsoft ones onnxscript wrote.
        runtime_fusions: int4/int8: the com.microsoft operators in the graph ONNX Runtime makes
            of the file when it loads it (``MatMulNBits`` per quantized linear, fused at load or
            written in the file).
        agreement: the file's logits against the model's on the proof's prompts, at ONNX
            Runtime's unoptimised level (ONNX semantics), prefill and every decode step.
        deployed: the same at ONNX Runtime's default level, as a user's session runs the file.
        token_agreement: the share of the proof's greedy tokens the file (default level) picks
            as the model does, each step fed the model's own previous token.
        genai_config: the ``genai_config.json`` written beside the file (folder outputs only).
        repeated: whether the graph was captured from the first two layers and the second one
            repeated for the others (:mod:`onnxport.llm.repeat`), instead of every layer traced.

    ``str`` of it is the file's path (so ``onnx.load(str(result))`` works); :meth:`summary`
    describes it.
    """

    path: Path
    precision: str
    flavour: str
    shape: DecoderShape
    fusions: dict[str, int] = field(default_factory=dict)
    runtime_fusions: dict[str, int] = field(default_factory=dict)
    agreement: Report | None = None
    deployed: Report | None = None
    token_agreement: float = 1.0
    genai_config: Path | None = None
    repeated: bool = False

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def summary(self) -> str:
        """What was written and how it was proven, in a few lines."""
        fused = ", ".join(f"{k} {v}" for k, v in self.fusions.items()) or "none"
        lines = [
            f"{self.path} ({self.shape.model_type}, {self.shape.layers} layers, {self.precision}, {self.flavour})",
            f"  fused for ONNX Runtime: {fused}",
            *([f"  ONNX Runtime runs: {', '.join(f'{k} {v}' for k, v in self.runtime_fusions.items())}"]
              if self.runtime_fusions else []),
            f"  greedy tokens as the model's (default level): {self.token_agreement:.1%}",
        ]
        for label, report in (("unoptimised", self.agreement), ("default level", self.deployed)):
            if report is not None:
                worst = min(r.cosine_similarity for r in report.outputs)
                diff = max(r.max_abs_error for r in report.outputs)
                lines.append(f"  logits vs the model ({label}): min cosine {worst:.8f}, max |diff| {diff:.3g}")
        return "\n".join(lines)


def _output(output_path: Any) -> tuple[Path, Path | None]:
    """(the .onnx file, the folder for genai_config.json or None): a path ending in ``.onnx`` is
    the file; anything else is a folder that receives ``model.onnx`` and its generator config."""
    if not isinstance(output_path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"output_path must be a .onnx file or a folder (str or os.PathLike), not {type(output_path).__name__}."
        )
    path = Path(output_path)
    if path.suffix == ".onnx":
        return check_output_path(path), None
    if path.exists() and not path.is_dir():
        raise InvalidArgumentError(f"output_path '{path}' is a file that is not .onnx; give a .onnx file or a folder.")
    parent = path.parent if str(path.parent) else Path(".")
    if not path.exists() and not parent.is_dir():
        raise InvalidArgumentError(f"The folder above output_path '{path}' does not exist; create '{parent}' first.")
    return path / "model.onnx", path


def _sample(shape: DecoderShape, batch: int, length: int, past: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs the capture traces with: every symbolic size at least 2 (torch specialises 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, past + length, dtype=torch.int64)
    positions = torch.arange(past, past + length).expand(batch, length).contiguous()
    cache = [(torch.randn(*size, generator=generator) * 0.5).to(getattr(torch, shape.cache_dtype))
             for size in shape.cache_shapes(batch, past)]
    return (ids, mask, positions, *cache)


def _axes(shape: DecoderShape) -> dict[str, dict[int, str]]:
    axes = {INPUT_IDS: {0: "batch", 1: "sequence"}, ATTENTION_MASK: {0: "batch", 1: "total_sequence"},
            POSITION_IDS: {0: "batch", 1: "sequence"}}
    axes.update({name: {0: "batch", 2: "past_sequence"} for name in shape.input_names[3:]})
    return axes


def _proof_prompts(shape: DecoderShape, length: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts, the second left-padded by two: the batch the proof decodes."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, shape.vocab, size=(2, length), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = shape.pad_token_id if shape.pad_token_id is not None and 0 <= shape.pad_token_id < shape.vocab else 0
    return ids, mask


def _feeds(shape: DecoderShape, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: position_ids_for(mask, ids.shape[1]),
            **dict(zip(shape.input_names[3:], past))}


def torch_step(model: torch.nn.Module, shape: DecoderShape):
    """The decode step of the PyTorch model itself (for the proof's reference)."""

    def step(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray]):
        with torch.no_grad():
            out = cached_call(model, shape.layers, torch.from_numpy(ids), torch.from_numpy(mask),
                              torch.from_numpy(positions), tuple(torch.from_numpy(p) for p in past))
        logits = out[0] if out[0].dtype == torch.float64 else out[0].float()  # a float64 reference stays so
        return logits.numpy(), [t.numpy() for t in out[1:]]

    return step


def _empty(shape: DecoderShape, batch: int) -> list[np.ndarray]:
    return [np.zeros(size, shape.cache_dtype) for size in shape.cache_shapes(batch, 0)]


def _reference_decoding(model: torch.nn.Module, shape: DecoderShape) -> tuple[np.ndarray, list[np.ndarray]]:
    """The model's greedy tokens on the proof's prompts, and its last logits at every step."""
    ids, mask = _proof_prompts(shape)
    logits: list[np.ndarray] = []
    tokens = decode(torch_step(model, shape), ids, mask, _empty(shape, len(ids)), PROOF_TOKENS,
                    lambda last: last.argmax(-1), on_logits=logits.append)
    return tokens, logits


def _forced_decoding(step: Any, shape: DecoderShape, tokens: np.ndarray) -> tuple[list[np.ndarray], float]:
    """``step``'s last logits at every step, fed the model's tokens (teacher forcing, so a token the
    two pick differently does not send the rest apart), and how often its own pick matched."""
    ids, mask = _proof_prompts(shape)
    forced = iter(tokens[:, ids.shape[1]:].T)
    logits: list[np.ndarray] = []
    agree: list[bool] = []

    def pick(last: np.ndarray) -> np.ndarray:
        chosen = next(forced)
        agree.extend(last.argmax(-1) == chosen)
        return chosen

    decode(step, ids, mask, _empty(shape, len(ids)), PROOF_TOKENS, pick, on_logits=logits.append)
    return logits, float(np.mean(agree))


def _float_activations(path: Path) -> tuple[bytes, Any] | None:
    """The file's graph with every ``MatMulNBits`` and ``QMoE`` at accuracy level 0 (float activations), and
    session options that find its weights in the file's folder; None when it holds no other level.
    Its integers are the file's own: only the kernel's arithmetic differs."""
    import onnxruntime as ort

    proto = onnx.load_model(str(path), load_external_data=False)
    levels = [a for n in proto.graph.node if n.op_type in ("MatMulNBits", "QMoE") and n.domain == "com.microsoft"
              for a in n.attribute if a.name == "accuracy_level"]
    if not any(a.i for a in levels):
        return None
    for attribute in levels:
        attribute.i = 0
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(Path(path).parent))
    return proto.SerializeToString(), options


def unoptimised_session(path: Path) -> Any:
    """ONNX Runtime's session on ``path`` with every graph optimisation off, and every
    ``MatMulNBits``/``QMoE`` at accuracy level 0: the file computed by its ONNX semantics, its
    integer weights with float activations (torchao's arithmetic), whatever level it states."""
    from ..runtime import make_session

    twin = _float_activations(path)
    return (make_session(path, optimized=False) if twin is None
            else make_session(twin[0], optimized=False, session_options=twin[1]))


def _file_decoding(path: Path, shape: DecoderShape, tokens: np.ndarray, optimized: bool) -> tuple[list[np.ndarray], float]:
    """The file's last logits at every step, teacher-forced with the model's tokens (see
    :func:`_forced_decoding`), and how often its own pick matched. Unoptimised, the file's
    ``MatMulNBits`` compute with float activations (its ONNX semantics, torchao's arithmetic)."""
    from ..runtime import make_session

    try:
        session = make_session(path) if optimized else unoptimised_session(path)
    except Exception as error:  # ONNX Runtime raises its own Fail/InvalidGraph types
        raise _RuntimeRefused(f"ONNX Runtime cannot load it: {_first_line(error)}") from error
    try:
        return _forced_decoding(ort_step(session), shape, tokens)
    except Exception as error:
        raise _RuntimeRefused(f"ONNX Runtime cannot run it: {_first_line(error)}") from error


@dataclass
class FloatFloor:
    """An fp32 decoder's bound: the model's logits in float64 on the proof's tokens (the reference)
    and, per step, its own float32 logits' relative distance from them (the floor)."""

    reference: list[np.ndarray]
    floors: dict[str, float]


def _float_floor(model: torch.nn.Module, shape: DecoderShape, tokens: np.ndarray,
                 logits32: list[np.ndarray], *, owned: bool) -> FloatFloor | str:
    """The model's float floor on the proof's decoding, or why it cannot be measured. A model
    ``owned`` (loaded here) is widened a layer at a time while it runs: no float64 copy beside it."""
    wide_shape = dataclasses.replace(shape, cache_dtype="float64")

    def run(wide: Any) -> list[np.ndarray]:
        # a mixture of experts' default implementation (a grouped matmul) has no float64 kernel
        with eval_mode(wide), exportable_experts(wide, capture=False):
            return _forced_decoding(torch_step(wide, wide_shape), wide_shape, tokens)[0]

    reference = float64_result(model, run, in_place=owned)
    if isinstance(reference, str):
        return reference
    broken = nonfinite_reason(reference, logits32)
    if broken is not None:
        return broken
    names = _step_names(len(reference))
    return FloatFloor(reference, {n: relative_distance(a, b) for n, a, b in zip(names, logits32, reference)})


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _step_names(n: int) -> list[str]:
    return ["prefill"] + [f"decode step {i}" for i in range(1, n)]


def _compare(got: list[np.ndarray], ref: list[np.ndarray], strategy: Any, level: str,
             float_floors: dict[str, float] | None = None) -> Report:
    names = _step_names(len(ref))
    runner = "the PyTorch model" + (" in float64" if float_floors is not None else "")
    return compare_runs(RunResults(f"the file (ONNX Runtime, {level})", dict(zip(names, got)), 2),
                        RunResults(runner, dict(zip(names, ref)), 2), strategy, float_floors=float_floors)


def export_decoder(
    model_or_folder: Any,
    output_path: str | os.PathLike,
    *,
    precision: str = "fp32",
    flavour: str = "portable",
    group_size: int = 32,
    opset_version: int | None = None,
) -> DecoderFile:
    """Export a transformers causal LM to one ONNX decoder with a key/value cache.

    The file takes ``input_ids``, ``attention_mask``, ``position_ids`` and
    ``past_key_values.{i}.key/value`` and gives ``logits`` and ``present.{i}.key/value``
    (Optimum's names); batch, sequence and past length are symbolic, so one file runs the prompt
    (with an empty past) and every decode step, and the cache grows with the text — nothing is
    allocated to a maximum length. :func:`generate` decodes with it.

    Args:
        model_or_folder: a transformers causal LM (``AutoModelForCausalLM``), or the folder
            ``save_pretrained`` wrote (loaded in float32; nothing is downloaded).
        output_path: a ``.onnx`` file, or a folder that receives ``model.onnx`` (and
            ``model.onnx.data``), a ``genai_config.json`` for onnxruntime-genai and the folder's
            tokenizer files. It holds a complete, proven file or is left as it was.
        precision: ``'fp32'``; ``'fp16'``: the model in float16 (weights, cache and logits; the
            proof holds it to ``model.half()``, and the given model is not changed); ``'int4'`` or
            ``'int8'``: the faithful weight-only file — every Linear's weights are torchao's
            integers (symmetric, ``group_size`` per scale) as ``DequantizeLinear``, which ONNX
            Runtime fuses into ``MatMulNBits`` when it loads the file (at the accuracy level its
            session option ``session.qdq_matmulnbits_accuracy_level`` says, default 4); in the
            ``'ort-cpu'`` flavour, int4 weights are written as ``MatMulNBits`` at accuracy level 4
            (the same integers, held once in memory where the fused pair holds them twice).
        flavour: ``'portable'`` (standard ONNX operators at the oldest opset that states the
            file) or ``'ort-cpu'`` (fused for ONNX Runtime's CPU: at opset 23, com.microsoft
            ``GroupQueryAttention`` over the cache, ``SkipSimplifiedLayerNormalization`` for
            each residual add and its RMS norm, with ONNX's own ``RotaryEmbedding``; below 23,
            onnxscript's com.microsoft fusions —
            SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, MultiHeadAttention;
            in fp32, a mixture's experts as com.microsoft ``MoE`` where its CPU kernel computes
            them — all counted in the result's ``fusions``).
        group_size: int4/int8: input features per scale (a power of two from 16 for MatMulNBits).
        opset_version: the default-domain opset: 18 or later for fp32/fp16 (default 18), 21 or
            later for int4/int8 (default 21: int4 and blocked scales are new there); the
            ``'ort-cpu'`` flavour's default is 23.

    Returns:
        A :class:`DecoderFile`: the path, the fusions, and the proof's figures. The proof
        decodes two prompts (one left-padded) for 8 greedy tokens with the file and with the
        model, feeding both the model's tokens: every step's logits must agree (fp32: within
        ``1e-4`` of the logits' scale; fp16: cosine ≥ 0.9999 with the half model; int4/int8:
        cosine ≥ 0.9999 with the torchao model),
        at ONNX Runtime's unoptimised level (a file's ``MatMulNBits`` there with float
        activations, accuracy level 0); the default level is measured and reported.
    """
    from tqdm.auto import tqdm

    check_choice(precision, PRECISIONS, "precision")
    check_choice(flavour, FLAVOURS, "flavour")
    lowest = WEIGHT_ONLY_OPSET if precision in ("int4", "int8") else DEFAULT_OPSET
    if opset_version is None:
        opset_version = ORT_CPU_OPSET if flavour == "ort-cpu" else lowest
    opset_version = validate_opset(
        opset_version, lowest=lowest,
        why=f"precision={precision!r} is written at opset {lowest} or later"
        + (" (int4 and blocked scales are new in opset 21)." if lowest > DEFAULT_OPSET else ".")
    )
    file, folder = _output(output_path)
    model = load_causal_lm(model_or_folder)
    shape = decoder_shape(model)
    model_name = type(model).__name__
    source_folder = Path(model_or_folder) if isinstance(model_or_folder, (str, os.PathLike)) else None

    with tqdm(total=3, desc="export_decoder (model and reference)", leave=False, disable=None) as bar:
        weights: list = []
        reference_model = model
        export_model = model
        if precision == "fp32" and source_folder is not None:
            # loaded here: its tensors view the mapped weights file, which stays mapped (all of it
            # resident) while any view lives; owning their memory, nothing keeps the mapping
            from .._core.io import release_freed_memory

            _own_tensors(model)
            release_freed_memory()
        if precision == "fp16":
            # the half model is the reference: the file computes what it computes, as a user
            # running model.half() would see it (a copy: the model given is never changed)
            reference_model = export_model = half_for_export(model, in_place=source_folder is not None)
            shape = dataclasses.replace(shape, cache_dtype="float16")
            model = None
        elif precision != "fp32":
            from ..exporters.weight_only import export_copy, quantized_weights
            from ..quantize.weight_only import quantize_weight_only

            reference_model = quantize_weight_only(model, f"{precision}_weight_only", group_size=group_size,
                                                   symmetric=True, embeddings=False)
            weights = quantized_weights(reference_model)
            export_model = export_copy(reference_model, weights)
            if source_folder is not None:
                # loaded here, so nobody else holds it: its float linear weights would otherwise
                # stay in memory through the whole export (the weights file is mapped, and the
                # tensors the quantized copy shares keep the whole mapping alive)
                from .._core.io import release_freed_memory

                _own_tensors(reference_model)
                export_model = export_copy(reference_model, weights)
                model = None
                release_freed_memory()
        bar.update()
        sample = _sample(shape, batch=2, length=3, past=4, seed=0)
        dequantized: Any = contextlib.nullcontext()
        if weights:  # torchao's arithmetic, its weights dequantized once instead of at every step
            from ..quantize.weight_only import dequantized_once

            dequantized = dequantized_once(reference_model)
        with eval_mode(reference_model), dequantized:
            check_cache(reference_model, shape, sample)
            tokens, reference_logits = _reference_decoding(reference_model, shape)
        floor: FloatFloor | str | None = None
        if precision == "fp32":
            floor = _float_floor(reference_model, shape, tokens, reference_logits, owned=source_folder is not None)
            if isinstance(floor, str):
                warnings.warn(
                    f"export_decoder cannot measure {model_name}'s float floor: {floor}. The fp32 file is held to a "
                    f"fixed tolerance instead ({FP32_TOLERANCE.describe()}).",
                    WeakerCheckWarning,
                    stacklevel=2,
                )
        bar.update()
        if folder is not None:
            folder.mkdir(exist_ok=True)
        job = _Job(export_model, shape, sample, tokens, reference_logits, weights, precision, flavour,
                   group_size, opset_version, model_name, floor)
        try:
            result = _write_once(job, file, attention=True)
        except _RuntimeRefused as error:
            if flavour != "ort-cpu":
                raise
            warnings.warn(
                f"onnxscript's attention fusions wrote a graph ONNX Runtime refuses for this "
                f"{shape.model_type} model ({error}); the 'ort-cpu' file fuses its norms, rotary and GELU "
                f"and keeps attention in standard operators.",
                PerformanceWarning,
                stacklevel=2,
            )
            result = _write_once(job, file, attention=False)
        if folder is not None:
            result.genai_config = _write_folder_extras(folder, file, shape, source_folder)
        bar.update()
    return result


@contextlib.contextmanager
def _grouped_sdpa(enabled: bool):
    """Let transformers hand SDPA a grouped-query model's keys and values grouped (``enable_gqa``)
    instead of repeated to every query head: from opset 23 torch.onnx writes SDPA as ONNX's
    ``Attention``, which takes them grouped (``kv_num_heads``), so the file keeps no ``Expand`` that
    copies the whole cache at every step."""
    if not enabled:
        yield
        return
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: True
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = original


def half_for_export(model: torch.nn.Module, *, in_place: bool) -> torch.nn.Module:
    """``model.half()`` (in place when nobody else holds the model, else a copy), with its family's
    float16 adapter applied: a change that exports and leaves every output as ``model.half()``'s."""
    from .._core.adapters import adapter_for

    half = model.half() if in_place else _half_copy(model)
    adapter_for(str(getattr(getattr(half, "config", None), "model_type", ""))).prepare_half(half)
    return half


def _half_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in float16, without a float32 copy on the way (each tensor is halved
    straight into the copy; tied weights stay tied)."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point() and id(tensor) not in memo:
            half = tensor.detach().to(torch.float16)
            memo[id(tensor)] = torch.nn.Parameter(half, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else half
    return copy.deepcopy(model, memo)


def _own_tensors(module: torch.nn.Module) -> None:
    """Give every plain parameter and buffer of ``module`` its own memory (tied ones stay tied),
    so nothing in it points into the storage of the model it was copied from.

    Tensors viewing a mapped weights file give their pages back as each is copied, so the copy
    never sits beside the whole resident mapping."""
    from .._core.io import MappedFilePages

    mapped = MappedFilePages()
    copies: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table, wrap in ((sub._parameters, lambda t: torch.nn.Parameter(t, requires_grad=False)), (sub._buffers, lambda t: t)):
            for name, tensor in list(table.items()):
                if tensor is None or type(tensor.data) is not torch.Tensor:
                    continue  # torchao's quantized weights are tensor subclasses: already their own
                if id(tensor) not in copies:
                    copies[id(tensor)] = wrap(tensor.detach().clone())
                    if tensor.is_contiguous():
                        mapped.release(tensor.data_ptr(), tensor.numel() * tensor.element_size())
                table[name] = copies[id(tensor)]  # type: ignore[assignment]  # a buffer table holds plain tensors


class _RuntimeRefused(ExportRefusedError):
    """ONNX Runtime refused to load or run the written file."""


class _RepeatedLayersDiffer(ExportRefusedError):
    """A file whose layers were captured once and repeated computes something else than the model:
    the export captures every layer instead."""


@dataclass
class _Job:
    """What one write of the decoder file needs (the ``'ort-cpu'`` flavour may write twice)."""

    export_model: torch.nn.Module
    shape: DecoderShape
    sample: tuple[torch.Tensor, ...]
    tokens: np.ndarray
    reference_logits: list[np.ndarray]
    weights: list
    precision: str
    flavour: str
    group_size: int
    opset_version: int
    model_name: str
    #: fp32: the model's float floor on the proof's decoding, or why there is none
    floor: FloatFloor | str | None = None
    #: capture the first two layers and repeat the second where the layers are alike
    repeat: bool = True


def decoder_steps(weights: list, fusion: Any = None, *, contrib: bool = False, nbits: bool = False) -> list:
    """The decoder's graph steps, each with its proof: torchao's integers in place (int4/int8),
    ONNX Runtime's fusions (``'ort-cpu'``; before onnxslim, whose rewrites hide the patterns
    onnxscript looks for), attention's key transpositions in layouts ONNX Runtime reads without a
    copy, onnxslim's clean-up with the weights lifted out of its reach, and with
    ``nbits`` the int4 weights written as ORT's ``MatMulNBits`` (accuracy level 4)."""
    from onnx_ir.passes.common import RemoveUnusedOpsetsPass

    from ..exporters.weight_only import InsertDequantizersPass, SlimAroundWeightsPass
    from ..passes.attention_layout import MhaCacheLayoutPass, SwapLastAxesPass
    from ..passes.group_query_attention import GroupQueryAttentionPass
    from ..passes.matmul_nbits import MatMulNBitsPass
    from ..passes.moe_kernel import MoEInterleavePass, QMoEPass
    from ..passes.optimize import OnnxSlimPass
    from ..passes.relu_as_max import ReluAfterWeightOnlyMatMulPass
    from ..passes.rsqrt_div import RsqrtToDivPass
    from ..passes.skip_rms_norm import SkipRmsNormPass
    from ..passes.split_indexed_weight import SplitIndexedWeightPass
    from ..pipeline import LastBit, OnFile, Step, Structural

    steps = []
    if weights:
        steps.append(Step("store the weights as torchao's integers", InsertDequantizersPass(weights), OnFile))
    # routed experts read their float matrices one constant slice at a time
    steps.append(Step("store each expert's matrix on its own", SplitIndexedWeightPass(), Structural))
    if fusion is not None:
        # after the integers are in place: a quantized expert's stand-in is no float weight
        steps.append(Step("a mixture's float experts interleaved for ONNX Runtime's MoE", MoEInterleavePass(), Structural))
        # the fused kernels add in another order: the decoding proof on the file is theirs
        steps.append(Step("fuse for ONNX Runtime's CPU (onnxscript)", fusion, OnFile))
        if contrib:
            steps.append(Step("cached attention as GroupQueryAttention", GroupQueryAttentionPass(), OnFile))
            steps.append(Step("residual add and RMS norm as SkipSimplifiedLayerNormalization", SkipRmsNormPass(), OnFile))
        steps.append(Step("MultiHeadAttention reads a cached key and value in its own layout", MhaCacheLayoutPass(),
                          Structural))
    steps.append(Step("write rsqrt as a division", RsqrtToDivPass(), LastBit))
    if weights:
        steps.append(Step("optimise with onnxslim around the weights", SlimAroundWeightsPass(weights), LastBit))
        steps.append(Step("a weight-only MatMul's ReLU as Max(x, 0), which ORT fuses past",
                          ReluAfterWeightOnlyMatMulPass(), Structural))
    if weights and nbits:
        # ORT's kernel at its default level for the pair it would fuse itself: int8 activations;
        # the proof runs the file's integers at level 0 as well (torchao's arithmetic)
        steps.append(Step("int4 weights as ONNX Runtime's MatMulNBits", MatMulNBitsPass(accuracy_level=4), OnFile))
        steps.append(Step("int4 experts as ONNX Runtime's QMoE", QMoEPass(accuracy_level=4), OnFile))
    else:
        steps.append(Step("optimise with onnxslim (weights lifted out)", OnnxSlimPass(lift_larger_than=1 << 16), LastBit))
    # last: the fusions match torch.onnx's own attention patterns; and where onnxslim has written
    # the shapes and folded the targets (before it, a first version of the pass found none of a
    # Whisper decoder's: the intermediate shapes it then read were not recorded)
    steps.append(Step("swap a key's last two axes with one Transpose", SwapLastAxesPass(), Structural))
    steps.append(Step("drop unused opset imports", RemoveUnusedOpsetsPass(), Structural))
    return steps


def _write_once(job: _Job, file: Path, *, attention: bool) -> DecoderFile:
    """:func:`_write`, capturing every layer if the file made of a repeated layer fails its proof."""
    try:
        return _write(job, file, attention=attention)
    except _RepeatedLayersDiffer as error:
        warnings.warn(
            f"{job.model_name}'s decoder file, captured from its first two layers with the second repeated for "
            f"the others, does not compute what the model computes ({first_line(error)}); every layer is "
            f"captured instead, which takes longer.",
            PerformanceWarning,
            stacklevel=3,
        )
        job.repeat = False
        return _write(job, file, attention=attention)


def _program(job: _Job, shape: DecoderShape, sample: tuple[torch.Tensor, ...], taken: list, *,
             optimize: bool) -> Any:
    """torch.onnx's program of the job's model with ``shape.layers`` layers (inside
    ``exportable_experts``, which gives ``taken``)."""
    from .._core.capture import torch_program

    with cached_forward(job.export_model, shape), _grouped_sdpa(job.opset_version >= ORT_CPU_OPSET):
        # torch.export takes every traced size to be at least 2, so the mask (past and new
        # tokens together) at least 4; saying so up front saves a refused capture
        return torch_program(job.export_model, sample, opset_version=job.opset_version,
                             input_names=shape.input_names, output_names=shape.output_names, axes=_axes(shape),
                             ranges={"total_sequence": (4, None)},
                             custom_translation_table=experts_translation() if taken else None, optimize=optimize)


def _repeated_capture(job: _Job, shape: DecoderShape, taken: list) -> Any:
    """The graph of the job's model captured from its first two layers, the second repeated for
    every further one (:mod:`onnxport.llm.repeat`), optimised by torch.onnx's optimizer as a whole
    capture is; or why its layers cannot be captured that way."""
    model = job.export_model
    stack = layer_stack(model, shape.layers)
    if isinstance(stack, str):
        return stack
    # every layer's weights by the names the graph gives them, read before the list is cut
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    try:
        with first_layers(model, stack):
            program = _program(job, dataclasses.replace(shape, layers=TEMPLATE_LAYERS),
                               job.sample[:3 + 2 * TEMPLATE_LAYERS], taken, optimize=False)
    except ExportRefusedError as error:  # the whole model may still be captured
        return f"its first two layers alone cannot be captured: {first_line(error)}"
    reason = repeat_layers(program.model, stack, lambda i, n: past_names(n)[2 * i:2 * i + 2],
                           lambda i, n: present_names(n)[2 * i:2 * i + 2], shape.input_names, shape.output_names,
                           tensors)
    if reason is not None:
        return reason
    program.optimize()  # torch.onnx's own optimizer, on the whole graph
    return program.model


def _write(job: _Job, file: Path, *, attention: bool) -> DecoderFile:
    """Capture, rewrite, write and prove the decoder file at ``file`` (complete or not at all)."""
    from ..engine import ExportPlan, run_plan
    from ..passes.ort_fusions import OrtFusionPass, fused_ops
    from ..passes.ort_quantize import SetMetadataPass
    from ..pipeline import Step, Structural

    # this file's own list: the experts it reads per expert are resolved in it (InsertDequantizersPass)
    shape, weights = job.shape, list(job.weights)
    axes = _axes(shape)
    prompt, mask = _proof_prompts(shape)
    prefill = _feeds(shape, prompt, mask, _empty(shape, 2))
    rng = np.random.default_rng(1)
    step_past = [rng.standard_normal(size).astype(shape.cache_dtype) for size in shape.cache_shapes(2, prompt.shape[1])]
    step_mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    decode_feeds = _feeds(shape, job.tokens[:, prompt.shape[1]:prompt.shape[1] + 1], step_mask, step_past)
    fusion = OrtFusionPass(attention=attention)
    result = DecoderFile(file, job.precision, job.flavour, shape)

    def capture() -> Any:
        kernel = job.flavour == "ort-cpu" and (job.precision == "fp32" or job.precision == "int4" and qmoe_holds(weights))
        with eval_mode(job.export_model), exportable_experts(job.export_model, kernel=kernel) as taken:
            repeated = _repeated_capture(job, shape, taken) if job.repeat else "asked to capture every layer"
            if not isinstance(repeated, str):
                result.repeated = True
                return repeated
            log.info("export_decoder: capturing every layer (%s)", repeated)
            return _program(job, shape, job.sample, taken, optimize=True).model

    steps = decoder_steps(weights, fusion if job.flavour == "ort-cpu" else None,
                          contrib=job.flavour == "ort-cpu" and job.opset_version >= ORT_CPU_OPSET,
                          nbits=job.flavour == "ort-cpu" and job.precision == "int4")
    record = {**shape.__dict__, "precision": job.precision, "flavour": job.flavour,
              "group_size": job.group_size if weights else None}
    steps.append(Step("record the decoder", SetMetadataPass({METADATA_KEY: json.dumps(record)}), Structural))

    def read_fusions(graph: Any) -> None:
        result.fusions = dict(sorted(fused_ops(graph).items()))

    def integers(path: Path) -> None:
        from ..exporters.weight_only import check_weights_faithful

        check_weights_faithful(path, weights)

    def decoding(path: Path) -> None:
        strategy: Any = CosineAtLeast(WEIGHT_ONLY_COSINE) if weights or job.precision == "fp16" else FP32_TOLERANCE
        reference, floors = job.reference_logits, None
        if isinstance(job.floor, FloatFloor):  # fp32: the model's own float floor decides
            strategy, reference, floors = WithinFloatFloor(FLOAT_FLOOR_MULTIPLE), job.floor.reference, job.floor.floors
        got, _ = _file_decoding(path, shape, job.tokens, optimized=False)
        result.agreement = _compare(got, reference, strategy, "unoptimised", floors)
        if not result.agreement and result.repeated:
            raise _RepeatedLayersDiffer(str(result.agreement))
        if not result.agreement:
            raise ExportRefusedError(
                f"The decoder file does not compute what {job.model_name} computes "
                f"({strategy.describe()}):\n{result.agreement}\nNothing was kept."
            )
        got, result.token_agreement = _file_decoding(path, shape, job.tokens, optimized=True)
        result.deployed = _compare(got, reference, strategy, "default level", floors)
        if not result.deployed:
            warnings.warn(
                f"At ONNX Runtime's default level the decoder's logits agree with the model to "
                f"{min(r.cosine_similarity for r in result.deployed.outputs):.6f} (cosine)"
                + (": its MatMulNBits computes with int8 activations there (accuracy level 4); set the "
                   "session option 'session.qdq_matmulnbits_accuracy_level' to '0' for float activations."
                   if weights else "."),
                RuntimePrecisionWarning,
                stacklevel=6,
            )

    def as_deployed(outputs: list, optimised: Path) -> None:
        from ..exporters.weight_only import warn_unfused

        graph = onnx.load_model(str(optimised), load_external_data=False)
        result.runtime_fusions = dict(Counter(n.op_type for n in graph.graph.node if n.domain == "com.microsoft"))
        warn_unfused(graph, weights)

    plan = ExportPlan(
        "export_decoder", job.opset_version, prefill, capture, steps, axes=axes,
        # the runs every step's proof makes: a prompt with an empty past, and one decode step
        samples=[prefill, decode_feeds],
        # no step is proven by identical outputs (the decoding proof on the file covers them all),
        # so no copy of the graph as captured is kept: at LLM sizes it would cost the weights again
        keep_reference=False, before_write=read_fusions,
        # weights in model.onnx.data at every size: ONNX Runtime maps them instead of parsing and
        # copying a protobuf that holds them
        external_data=True,
        rules=([integers] if weights else []) + [decoding],
        # int4/int8: what ONNX Runtime made of the file (its MatMulNBits), read from its optimised
        # graph; an fp32 file's would be a copy of every weight on disk, for nothing to count
        on_default_run=as_deployed if weights else None,
    )
    run_plan(plan, file)
    return result


def genai_config(shape: DecoderShape, filename: str) -> dict[str, Any]:
    """onnxruntime-genai's configuration for a decoder file (its keys as its model builder writes
    them). The cache is not shared between past and present: the file's present grows by the new
    tokens, it is not a buffer of the maximum length."""
    eos = shape.eos_token_id
    return {
        "model": {
            "bos_token_id": shape.bos_token_id,
            "context_length": shape.max_positions,
            "eos_token_id": eos,
            "pad_token_id": shape.pad_token_id if shape.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos),
            "type": shape.model_type,
            "vocab_size": shape.vocab,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": shape.head_dim,
                "hidden_size": shape.hidden,
                "num_attention_heads": shape.heads,
                "num_hidden_layers": shape.layers,
                "num_key_value_heads": shape.kv_heads,
                "inputs": {
                    "input_ids": INPUT_IDS,
                    "attention_mask": ATTENTION_MASK,
                    "position_ids": POSITION_IDS,
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "max_length": shape.max_positions,
            "min_length": 0,
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def _write_folder_extras(folder: Path, file: Path, shape: DecoderShape, source: Path | None) -> Path | None:
    config: Path | None = folder / "genai_config.json"
    if shape.plain_cache:
        write_bytes_atomic(config, json.dumps(genai_config(shape, file.name), indent=2).encode())
    else:
        # onnxruntime-genai allocates keys and values of one shape, [heads, head_size]
        warnings.warn(f"No genai_config.json was written: {shape.model_type}'s cache keeps keys and values of different "
                      f"shapes (a latent cache), which onnxruntime-genai does not allocate; onnxport's generate runs "
                      f"the file.", OnnxportWarning, stacklevel=3)
        config = None
    if source is not None and source.resolve() != folder.resolve():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
    return config
