"""``export_pretrained``: a Hugging Face folder, a timm model or a transformers module of any common
task to a proven ONNX file in one call — inputs and outputs named as the model names them, batch
and sequence symbolic, agreement with the model proven at two sizes on its own float floor."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .._core.adapters import adapter_for
from .._core.axes import second_size
from .._core.io import check_output_folder, write_text_atomic
from .._core.torch_helpers import eval_mode
from ..engine import output_folder_stage
from ..errors import ExportRefusedError, FixedAxesError, FixedShapeWarning, InvalidArgumentError, check_choice
from .calibration import calibration_batches
from .inputs import Signature, build_signature
from .source import (
    COMPANION_FILES,
    TIMM_PREFIX,
    Loaded,
    is_timm_model,
    load_folder,
    load_module,
    load_timm,
    load_timm_module,
)
from .tasks import Task, get_task

Quantize = Literal["int8", "dynamic", "int4", "int8-weight-only"]
QUANTIZE_CHOICES = ("int8", "dynamic", "int4", "int8-weight-only")
#: The torchao weight-only recipe behind each weight-only choice.
WEIGHT_ONLY = {"int4": "int4_weight_only", "int8-weight-only": "int8_weight_only"}
#: int4 weights get one scale per this many input features, or the largest power of two below it
#: that divides every Linear's width (a small model's layers can be narrower).
INT4_GROUP = 128
MODEL_FILE = "model.onnx"
RECORD_FILE = "onnxport.json"
#: Calibration samples used when none is said (the pt2e observers settle within a few dozen).
CALIBRATION_SAMPLES = 64


class TaskOutputs(torch.nn.Module):
    """A transformers model called with keyword inputs, giving the task's output fields as a tuple
    (nested outputs such as CLIP's per-tower results are left out; the file's outputs are these)."""

    def __init__(self, model: torch.nn.Module, outputs: list[str], extra: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.output_names, self.extra = model, list(outputs), dict(extra)

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**inputs, **self.extra)
        return tuple(out[name] for name in self.output_names)


@dataclass
class PretrainedExport:
    """What :func:`export_pretrained` wrote and proved; ``os.fspath`` gives the model file.

    Attributes:
        path: the ONNX file (``OUT/model.onnx``; weights in ``model.onnx.data`` past 2 GB).
        folder: the output folder (config, tokenizer/processor files, ``onnxport.json``).
        task: the task exported.
        inputs, outputs: the file's input and output names; ``axes`` their symbolic axes.
        proofs: per proof run, its size and per output the figures and verdict.
        quantization: what the file was quantized with, or ``None``.
    """

    path: Path
    folder: Path
    task: str
    inputs: list[str]
    outputs: list[str]
    axes: dict[str, dict[int, str]]
    proofs: list[dict[str, Any]] = field(default_factory=list)
    quantization: dict[str, Any] | None = None

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def proof_lines(self) -> list[str]:
        """One line per proof run: where it ran and its figure (the worst output's distance from
        the model's float64 run against its float floor, or each quantized output's cosine beside
        its rounding floor)."""
        lines = []
        for proof in self.proofs:
            figure = proof_figure(proof)
            place = proof["size"] if proof["size"].endswith("batch") else f"{proof['size']} size"
            shapes = ", ".join(f"{k} {v}" for k, v in proof["shapes"].items())
            lines.append(f"proven at the {place} ({shapes}){', ' + figure if figure else ''}")
        return lines


def proof_figure(proof: dict[str, Any]) -> str:
    """A proof record's figure in words: ``"at most 0.81x its float floor"`` for a float file,
    each output's cosine and rounding floor for a quantized one; empty when it has neither."""
    outputs = proof["outputs"]
    if outputs and outputs[0].get("float_floor") is not None:
        # a floor under one float32 step of 1.0 would make any distance look large
        worst = max((o.get("float_distance") or 0) / max(o.get("float_floor") or 2**-24, 2**-24) for o in outputs)
        return f"at most {worst:.2f}x its float floor"
    return "; ".join(f"{o['name']} cosine {cosine_text(o['cosine_similarity'])} (its rounding floor "
                     f"{cosine_text(min(o['rounding_floor']))} to {cosine_text(max(o['rounding_floor']))})"
                     for o in outputs if o.get("rounding_floor"))


def cosine_text(cosine: float) -> str:
    """A cosine in six decimals, or, where those would read 1.000000, its distance from 1
    (``"1 - 3.2e-08"``): a faithful dynamic INT8 file and its floor differ only there."""
    return f"1 - {1 - cosine:.1e}" if 1 - cosine < 5e-7 else f"{cosine:.6f}"


def _extra_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    import inspect

    parameters = inspect.signature(model.forward).parameters
    extra: dict[str, Any] = {}
    if "return_dict" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        extra["return_dict"] = True
    if "use_cache" in parameters:
        extra["use_cache"] = False
    return extra


def _output_fields(loaded: Loaded, signature: Signature, extra: dict[str, Any]) -> list[str]:
    """The task's output fields the model returns (every tensor field when the task names none)."""
    try:
        with torch.no_grad():
            out = loaded.model(**signature.as_dict(), **extra)
    except Exception as error:  # the model's own check or shape error, whatever its type
        shapes = ", ".join(f"{name} {list(value.shape)}" for name, value in signature.as_dict().items())
        raise ExportRefusedError(
            f"{loaded.description} does not run on the example inputs built from its config ({shapes}): "
            f"{type(error).__name__}: {error}. Nothing was written; export it with export_onnx and inputs it "
            f"accepts (a family that needs a fixed length or extra inputs).") from error
    items = out.items() if hasattr(out, "items") else []
    tensors = [name for name, value in items if isinstance(value, torch.Tensor)]
    if not tensors:
        raise InvalidArgumentError(f"{loaded.description} returned no named tensor outputs for task "
                                   f"{loaded.task.name!r}; export it with export_onnx.")
    wanted = [name for name in loaded.task.outputs if name in tensors]
    return wanted or tensors


def _load(source: Any, task: str, trust_remote_code: bool, weights: Any) -> Loaded:
    if isinstance(source, torch.nn.Module):
        return load_timm_module(source, task) if is_timm_model(source) else load_module(source, task)
    if isinstance(source, str) and source.startswith(TIMM_PREFIX):
        return load_timm(source, weights, task)
    if isinstance(source, (str, os.PathLike)):
        return load_folder(Path(source), task, trust_remote_code=trust_remote_code)
    raise InvalidArgumentError(
        f"source must be a save_pretrained folder, 'timm:NAME', or a transformers or timm model, not "
        f"{type(source).__name__}."
    )


def _prove_float(wrapper: TaskOutputs, path: Path, signature: Signature) -> list[dict[str, Any]]:
    """The file against the model at two sizes of every symbolic axis, on the model's float floor
    (one session and one float64 copy of the model for both)."""
    from ..compare.exported import compare_onnx_sizes

    feeds = {n: t.numpy() for n, t in signature.as_dict().items()}
    grown = {n: torch.from_numpy(v) for n, v in second_size(feeds, signature.axes).items()}
    labels = ("sample", "one longer on every symbolic axis")
    # a file without symbolic axes has one size
    samples = [signature.as_dict(), grown] if any(signature.axes.values()) else [signature.as_dict()]
    proofs = []
    for label, sample, report in zip(labels, samples, compare_onnx_sizes(wrapper, path, samples, rounding_floor=True)):
        proofs.append(_proof_record(label, sample, report))
        if not report.passed:
            raise ExportRefusedError(
                f"The file does not compute what the model computes at the {label} size:\n{report}\nNothing was kept."
            )
    return proofs


def _proof_record(label: str, sample: dict[str, torch.Tensor], report: Any) -> dict[str, Any]:
    return {
        "size": label, "shapes": {n: list(t.shape) for n, t in sample.items()}, "criterion": report.strategy,
        "passed": report.passed,
        "outputs": [{k: v for k, v in asdict(o).items() if k in (
            "name", "max_abs_error", "cosine_similarity", "float_distance", "float_floor", "max_error_in_steps",
            "rounding_floor", "passed")} for o in report.outputs],
    }


def export_pretrained(
    source: Any,
    output_dir: str | os.PathLike,
    *,
    task: str = "auto",
    quantize: Quantize | None = None,
    calibration: Any = None,
    calibration_samples: int = CALIBRATION_SAMPLES,
    calibration_length: int | None = None,
    target: str | None = None,
    opset_version: int | None = None,
    trust_remote_code: bool = False,
    weights: str | os.PathLike | None = None,
) -> PretrainedExport:
    """Export a pretrained model of a common task to ``output_dir``, proven on the file it wrote.

    Args:
        source: a ``save_pretrained`` folder (config.json and safetensors or .bin; nothing is
            downloaded), ``'timm:NAME'`` (random weights, or ``weights``), or a transformers or timm model
            in memory (left as it was given, its training mode too).
        output_dir: receives ``model.onnx`` (``model.onnx.data`` past 2 GB), config.json and the
            tokenizer/processor files, and ``onnxport.json`` (task, inputs and outputs with their
            axes, the proofs with their figures, the quantization, versions). Created if needed;
            on a refusal it is left as it was.
        task: a transformers pipeline name (``onnxport.pretrained.TASKS``), or ``'auto'`` to read it
            from ``architectures`` in config.json.
        quantize: ``None`` (float); ``'int8'`` (pt2e static INT8 with the target's rules, needs
            ``calibration``); ``'int4'`` or ``'int8-weight-only'`` (torchao weight-only Linear layers,
            activations float, no calibration: int4 in groups of 128 input features, or the largest
            power of two that divides every Linear's width; int8 one scale per output channel);
            ``'dynamic'`` (pt2e: each Linear's input quantized at run time, weights int8 per
            channel, no calibration; written as ``DynamicQuantizeLinear`` + ``MatMulInteger``).
        calibration: for ``'int8'``: a text file (one sample a line, tokenized with the folder's
            tokenizer), a folder of images or .wav/.flac files, a .npz (one array per input), or a
            list of dicts of arrays.
        calibration_samples: use at most this many calibration samples.
        calibration_length: the token length text calibration is padded or cut to (default: the
            sample's).
        target: the deployment target for ``'int8'`` (default ``'onnxruntime'``).
        opset_version: the default-domain opset (each exporter's default when ``None``).
        trust_remote_code: allow a folder whose config names custom code (``auto_map``) to run it.
        weights: for ``'timm:NAME'``: a local state dict or safetensors file.

    Returns a :class:`PretrainedExport` (``.path`` is the model file).
    """
    folder = check_output_folder(output_dir)
    if task != "auto":
        get_task(task)  # an unknown task is named, with the list, before anything is loaded
    if quantize is not None:
        check_choice(quantize, QUANTIZE_CHOICES, "quantize")
    if quantize == "int8" and calibration is None:
        raise InvalidArgumentError(
            "quantize='int8' needs calibration data: a text file (one sample a line), a folder of images or audio, "
            "a .npz, or a list of dicts; or use quantize='dynamic', which needs none."
        )
    if calibration is not None and quantize != "int8":
        raise InvalidArgumentError(f"calibration is only read with quantize='int8', and quantize={quantize!r}.")
    if target is not None and quantize != "int8":
        raise InvalidArgumentError(f"target={target!r} applies to quantize='int8' files only.")
    if isinstance(calibration_samples, bool) or not isinstance(calibration_samples, int) or calibration_samples < 1:
        raise InvalidArgumentError(f"calibration_samples must be a positive integer, not {calibration_samples!r}.")
    if calibration_length is not None:
        if isinstance(calibration_length, bool) or not isinstance(calibration_length, int) or calibration_length < 1:
            raise InvalidArgumentError(f"calibration_length must be a positive integer, not {calibration_length!r}.")
        if not _text_calibration(calibration):
            raise InvalidArgumentError(
                f"calibration_length sets the tokens of a text file's lines; calibration={calibration!r} is not a "
                f"text file. Leave calibration_length out, or give a text file (one sample a line)."
            )
    if weights is not None and not (isinstance(source, str) and source.startswith(TIMM_PREFIX)):
        raise InvalidArgumentError(
            "weights are read only for a 'timm:NAME' source; a folder holds its own weights, and a model in memory "
            "already has them."
        )

    loaded = _load(source, task, trust_remote_code, weights)
    # exported and proven in eval mode; a model given in training mode is given back in it
    with eval_mode(loaded.model):
        signature = build_signature(loaded.model, loaded.task, loaded.preprocessor, image_size=loaded.image_size)
        extra = _extra_kwargs(loaded.model)
        signature.outputs = _output_fields(loaded, signature, extra)
        wrapper = TaskOutputs(loaded.model, signature.outputs, extra).eval()
        positions = getattr(getattr(loaded.model, "config", None), "max_position_embeddings", None)
        if calibration_length is not None and isinstance(positions, int) and calibration_length > positions:
            raise InvalidArgumentError(
                f"calibration_length={calibration_length} is longer than the model's {positions} positions "
                f"(max_position_embeddings in its config); give at most {positions}."
            )
        batches = (calibration_batches(calibration, signature, loaded.folder, samples=calibration_samples,
                                       length=calibration_length, preprocess=loaded.preprocess)
                   if quantize == "int8" else None)

        # the family's changes for capture, on a model loaded here or given (undone afterwards)
        model_type = str(getattr(getattr(loaded.model, "config", None), "model_type", ""))
        capturing = adapter_for(model_type).capturing(loaded.model)
        with output_folder_stage(folder) as stage, capturing:
            path = stage / MODEL_FILE
            quantization, proofs = _write_fixing_axes(wrapper, loaded.task, signature, path, quantize=quantize,
                                                      batches=batches, target=target, opset_version=opset_version)
            if loaded.folder is not None:
                for name in COMPANION_FILES:
                    if (loaded.folder / name).is_file():
                        shutil.copyfile(loaded.folder / name, stage / name)
            result = PretrainedExport(folder / MODEL_FILE, folder, loaded.task.name, signature.names, signature.outputs,
                                      signature.axes, proofs, quantization)
            write_text_atomic(stage / RECORD_FILE, json.dumps(_record(result, loaded), indent=2))
    return result


def _text_calibration(calibration: Any) -> bool:
    """Whether ``calibration`` names a text file (what :func:`calibration_batches` tokenizes)."""
    from .calibration import TEXT_SUFFIXES

    if not isinstance(calibration, (str, os.PathLike)):
        return False
    path = Path(calibration)
    return not path.is_dir() and path.suffix in TEXT_SUFFIXES


def _write_fixing_axes(wrapper: TaskOutputs, task: Task, signature: Signature, path: Path, **options: Any
                       ) -> tuple[dict | None, list]:
    """:func:`_write`; where torch.export proves that the model's code fixes an axis the front door
    made symbolic (``len(tensor)`` on the batch, a table built for one length), the file is written
    once more with that axis at the sample's size, with a :class:`FixedShapeWarning` naming it and
    the line of model code, and ``signature.axes`` without it (the record says so)."""
    try:
        return _write(wrapper, task, signature, path, **options)
    except FixedAxesError as error:
        labels = set(error.fixed)
        if not labels:
            raise
        fixed = {name: {axis: label for axis, label in spec.items() if label in labels}
                 for name, spec in signature.axes.items()}
        sizes = {f"{name!r} axis {axis} ({label!r})": int(signature.as_dict()[name].shape[axis])
                 for name, spec in fixed.items() for axis, label in spec.items()}
        warnings.warn(f"{error.reason}. The file is written with {', '.join(f'{k} = {v}' for k, v in sizes.items())} "
                      f"fixed instead; it accepts inputs of that size only.", FixedShapeWarning, stacklevel=3)
        signature.axes = {name: {axis: label for axis, label in spec.items() if label not in labels}
                          for name, spec in signature.axes.items()}
        return _write(wrapper, task, signature, path, **options)


def _write(wrapper: TaskOutputs, task: Task, signature: Signature, path: Path, *, quantize: str | None,
           batches: list | None, target: str | None, opset_version: int | None) -> tuple[dict | None, list]:
    """Write the file at ``path`` by the exporter its precision needs, and prove it."""
    from ..exporters.float import export_onnx

    sample = signature.as_dict()
    # the batch stays symbolic unless the model's code fixes it (_write_fixing_axes)
    batch = any(0 in spec for spec in signature.axes.values())
    if quantize is None:
        export_onnx(wrapper, sample, path, opset_version=opset_version or 17, dynamic_axes=signature.axes,
                    dynamic_batch=batch, output_names=signature.outputs)
        return None, _prove_float(wrapper, path, signature)
    from ..exporters.qdq import export_qdq
    from ..quantize import Quantizer

    if quantize in WEIGHT_ONLY:
        return _write_weight_only(wrapper, signature, path, quantize, opset_version)
    if quantize == "dynamic":
        quantized = Quantizer(activations="dynamic").quantize(wrapper, [sample], dynamic_axes=signature.axes,
                                                                 dynamic_batch=batch)
        export_qdq(quantized, sample, path, output_names=signature.outputs, opset_version=opset_version,
                   dynamic_batch=batch)
        return ({"scheme": "pt2e dynamic INT8 (activations quantized at run time)"},
                [_prove_qdq(quantized, path, sample, optimized=True)])
    quantized = Quantizer(target=target or "onnxruntime").quantize(wrapper, batches, dynamic_axes=signature.axes,
                                                                            dynamic_batch=batch)
    export_qdq(quantized, sample, path, output_names=signature.outputs, opset_version=opset_version,
               dynamic_batch=batch)
    proof_sample, label = _calibration_sample(batches or [], sample, signature.axes)
    proof = _prove_qdq(quantized, path, proof_sample, label=label)
    return ({"scheme": "pt2e static INT8", "target": target or "onnxruntime", "calibration_batches": len(batches or [])},
            [proof])


def _calibration_sample(batches: list[dict[str, torch.Tensor]], sample: dict[str, torch.Tensor],
                        axes: dict[str, dict[int, str]]) -> tuple[dict[str, torch.Tensor], str]:
    """The static file's proof input: the first calibration batch, cut to the sample's batch (the
    data the file was calibrated for, as it is deployed: random pixels or noise lie outside the
    ranges it learned, where a random-weight model's rounding flips compound), or the sample where
    the batch does not fit the file: a size other than the sample's on an axis that is not symbolic
    (text tokenized to another length fits, its sequence axis being symbolic)."""
    if not batches:
        return sample, "sample"
    first = {name: value[:len(sample[name])] for name, value in batches[0].items() if name in sample}

    def fits(name: str) -> bool:
        got, want = first[name], sample[name]
        return got.dtype == want.dtype and got.dim() == want.dim() and all(
            a == b or i in axes.get(name, {}) for i, (a, b) in enumerate(zip(got.shape, want.shape)))

    if set(first) != set(sample) or not all(fits(n) for n in sample):
        return sample, "sample"
    return first, "first calibration batch"


def int4_group(model: torch.nn.Module) -> int:
    """:data:`INT4_GROUP`, or the largest power of two below it dividing every Linear's width."""
    group = INT4_GROUP
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    while group > 1 and any(width % group for width in widths):
        group //= 2
    return group


def _write_weight_only(wrapper: TaskOutputs, signature: Signature, path: Path, quantize: str,
                       opset_version: int | None) -> tuple[dict, list]:
    """torchao weight-only: export_qdq proves the integers are torchao's and the agreement at two
    sizes; the file is then held to the torchao model's rounding floor at the sample's size."""
    from ..exporters.qdq import export_qdq
    from ..quantize import Quantizer

    method = WEIGHT_ONLY[quantize]
    options: dict[str, Any] = {"group_size": int4_group(wrapper)} if quantize == "int4" else {}
    quantized = Quantizer(backend="torchao", method=method, **options).quantize(wrapper)
    sample = signature.as_dict()
    export_qdq(quantized, sample, path, output_names=signature.outputs, dynamic_axes=signature.axes,
               opset_version=opset_version)
    # unoptimised: the file's own semantics (ORT's MatMulNBits computes int8 activations by default)
    return ({"scheme": f"torchao {method}", **options}, [_prove_qdq(quantized, path, sample, optimized=False)])


def _prove_qdq(quantized: Any, path: Path, sample: dict[str, torch.Tensor], *,
               optimized: bool | None = None, label: str = "sample") -> dict[str, Any]:
    """The quantized file within twice its quantized model's rounding floor (``compare_qdq``)."""
    from ..compare.quantized import compare_qdq

    report = compare_qdq(quantized, path, sample, rounding_floor=True, optimized=optimized)
    record = _proof_record(label, sample, report)
    failing = [o.name for o in report.outputs if o.within_floor is False]
    if failing:
        raise ExportRefusedError(
            f"The quantized file is beyond twice its model's rounding floor on {failing}:\n{report}\nNothing was kept."
        )
    return record


def _record(result: PretrainedExport, loaded: Loaded) -> dict[str, Any]:
    import onnx
    import onnxruntime
    import transformers

    from .._version import __version__

    record = {
        "task": result.task, "source": loaded.description, "model_file": MODEL_FILE,
        "inputs": [{"name": n, "axes": result.axes.get(n, {})} for n in result.inputs],
        "outputs": result.outputs, "proofs": result.proofs, "quantization": result.quantization,
        "versions": {"onnxport": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
    }
    if loaded.preprocessing is not None:
        # a source without a processor file (timm): how its pixels are made, for the deployment
        record["preprocessing"] = loaded.preprocessing
    return record
