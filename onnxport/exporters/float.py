"""``export_onnx``: a PyTorch model to a checked float (or ONNX Runtime INT8) ONNX file."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedOpsetsPass

from .._core.axes import resolve_axes
from .._core.cpu import WEIGHT_RANGE_KEY, WEIGHT_RANGES
from .._core.io import check_output_path
from ..engine import ExportPlan, run_plan, validate_opset
from ..errors import InvalidArgumentError, PerformanceWarning, check_choice
from ..passes.gelu_order import GeluOrderPass
from ..passes.group_norm import GroupNormAsLayerNormPass
from ..passes.lower_opset import LowerOpsetPass
from ..passes.optimize import OnnxSlimPass
from ..passes.ort_quantize import OrtQuantizeOptions, OrtQuantizePass, SetMetadataPass
from ..passes.pool_window import PoolWindowPass
from ..passes.rsqrt_div import RsqrtToDivPass
from ..pipeline import IdenticalOutputs, LastBit, OnFile, Step, Structural

QUANTIZE_MODES = ("dynamic", "static")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
QUANT_TYPES = ("uint8", "int8")


def export_onnx(
    model: Any,
    sample: Any,
    output_path: str | os.PathLike,
    *,
    opset_version: int = 17,
    quantize: bool = False,
    quantize_mode: str = "dynamic",
    calibration_data: Iterable[Any] | None = None,
    optimize: bool = True,
    dynamic_batch: bool = True,
    dynamic_axes: Mapping[str, Any] | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    calibration_method: str = "minmax",
    activation_type: str = "uint8",
    weight_type: str = "int8",
    per_channel: bool = True,
    op_types_to_quantize: Sequence[str] | None = None,
    weight_range: str = "portable",
) -> Path:
    """Export a PyTorch model to ONNX, optimise it, and optionally quantize it with ONNX Runtime.

    Args:
        model: the float ``nn.Module`` to export (it is exported in eval mode; its own mode is
            restored afterwards). For a model quantized with ``Quantizer(backend='pt2e')`` use
            ``export_qdq``: the float optimiser here is not meant for Q/DQ graphs.
        sample: a tensor, a tuple of tensors (one per input), or a dict of tensors by forward's
            parameter names (keyword inputs: ``{'input_ids': …, 'attention_mask': …}``; the
            file's inputs take those names), batch dimension first.
        output_path: the ``.onnx`` file to write. It either receives a complete, checked file or
            is left as it was.
        opset_version: the default-domain opset the file must declare (13 to the newest ONNX
            knows). The exporter writes 18 or later; older opsets are lowered exactly and checked
            by running both graphs.
        quantize: quantize with ONNX Runtime after the float export.
        quantize_mode: ``'dynamic'`` (weights only, no calibration) or ``'static'``.
        calibration_data: for ``'static'``: an iterable of batches (a DataLoader works), each a
            tensor, a tuple of inputs, or an ``(inputs, target)`` pair.
        optimize: run the onnxslim graph optimiser on the float graph.
        dynamic_batch: make dim 0 of every input and output symbolic (the shorthand for
            ``dynamic_axes={name: {0: 'batch'}}`` on every input).
        dynamic_axes: more symbolic axes, in ``torch.onnx.export``'s form: ``{input_name: {axis:
            'label'}}`` or ``{input_name: [axes]}``, e.g. ``{'input_ids': {0: 'batch', 1:
            'sequence'}, 'attention_mask': {0: 'batch', 1: 'sequence'}}``. Inputs that share a
            label share that size. Names are ``input_names``, or the sample's keyword names. The
            file is proven at two sizes of every symbolic axis. An axis the model fixes (a mask
            built with a Python int, a check against one length) is refused, naming it.
        input_names, output_names: names for the graph's inputs and outputs (defaults ``input``
            / ``output``, or ``input_0…`` / ``output_0…`` for several).
        calibration_method: static calibration: ``'minmax'``, ``'entropy'`` or ``'percentile'``.
        activation_type, weight_type: static quantization types, ``'uint8'`` or ``'int8'``
            (uint8 activations with int8 weights is the fast pair on VNNI CPUs).
        per_channel: per-channel weight scales (static and dynamic).
        op_types_to_quantize: the ONNX operator types ONNX Runtime may quantize (default: all it
            supports). Dynamic quantization turns Conv into ConvInteger, which ONNX Runtime's CPU
            runs slower than float; a :class:`PerformanceWarning` says so. For CNNs use static.
        weight_range: quantized files: ``'portable'`` (default) quantizes int8 weights on
            [-64, 64] (ONNX Runtime's ``reduce_range``), which its U8S8 kernels compute exactly on
            every x86 CPU — without VNNI they add two products in a saturating int16 and a full
            range computes something else; ``'full'`` uses [-127, 127], for deployments known
            to have VNNI/AMX or ARM dot products. Recorded in the file's metadata.

    Returns:
        ``output_path`` as a ``Path``.
    """
    import torch

    from .._core.capture import check_names, torch_program
    from .._core.inputs import bind_sample, calibration_batches, flatten_outputs, forward_aliases, positional_forward
    from .._core.torch_helpers import eval_mode, require_module

    # -- everything is validated before anything is written ---------------------------------
    require_module(model)
    call, inputs, keywords = bind_sample(model, sample)
    target = check_output_path(output_path)
    opset_version = validate_opset(opset_version)
    check_choice(quantize_mode, QUANTIZE_MODES, "quantize_mode")
    check_choice(calibration_method, CALIBRATION_METHODS, "calibration_method")
    check_choice(activation_type, QUANT_TYPES, "activation_type")
    check_choice(weight_type, QUANT_TYPES, "weight_type")
    check_choice(weight_range, WEIGHT_RANGES, "weight_range")
    batches = None
    if quantize and quantize_mode == "static":
        if calibration_data is None:
            raise InvalidArgumentError(
                "quantize_mode='static' needs calibration_data: an iterable of input batches "
                "(a DataLoader works), or use quantize_mode='dynamic'."
            )
        batches = calibration_batches(calibration_data, inputs, names=keywords)
    elif calibration_data is not None:
        warnings.warn(
            "calibration_data is only used with quantize=True and quantize_mode='static'; it is ignored.",
            UserWarning,
            stacklevel=2,
        )
    with eval_mode(model), torch.no_grad():
        reference = flatten_outputs(call(*inputs))
    if not reference:
        raise InvalidArgumentError("The model returned no tensors on the sample; there is nothing to export.")
    in_names = check_names(input_names if input_names is not None else keywords, len(inputs), "input_names", "input")
    out_names = check_names(output_names, len(reference), "output_names", "output")
    axes = resolve_axes(dynamic_axes, dynamic_batch=dynamic_batch, names=in_names, inputs=inputs,
                        aliases=forward_aliases(model, in_names, keywords))
    feeds = {name: t.detach().cpu().numpy() for name, t in zip(in_names, inputs)}

    # -- the plan: export, lower, optimise, (quantize,) write once, prove the file ------------
    def capture() -> ir.Model:
        with eval_mode(model), positional_forward(model, keywords):
            return torch_program(
                model, inputs, opset_version=opset_version, input_names=in_names,
                output_names=out_names, axes=axes,
            ).model

    def steps(scratch: Path) -> list[Step]:
        steps = float_steps(opset_version, optimize)
        if quantize:
            options = OrtQuantizeOptions(
                quantize_mode, [dict(zip(in_names, (t.numpy() for t in batch))) for batch in batches or []],
                calibration_method, activation_type, weight_type, per_channel, op_types_to_quantize,
                reduce_range=weight_range == "portable",
            )
            steps += ort_quantize_steps(scratch, options, weight_range)
        return steps

    rules = [lambda path: _warn_about_quantized(onnx.load_model(str(path), load_external_data=False), quantize_mode)]
    run_plan(ExportPlan("export_onnx", opset_version, feeds, capture, steps, axes=axes,
                        rules=rules if quantize else ()), target)
    return target


def float_steps(opset_version: int, optimize: bool) -> list[Step]:
    """The graph steps of :func:`export_onnx`, in order, each with its proof."""
    steps = [
        Step(f"lower to opset {opset_version}", LowerOpsetPass(opset_version), IdenticalOutputs),
        Step("order GELUs for fusion", GeluOrderPass(), IdenticalOutputs),
        # one ulp apart in ORT's unoptimised run (another summation order or one rounding fewer),
        # equal in its optimised run and in torch: the checker is their proof (see qdq_steps)
        Step("write rsqrt as a division", RsqrtToDivPass(), LastBit),
        Step("clip pool windows to their input", PoolWindowPass(), LastBit),
        # ORT's InstanceNormalization and GroupNormalization sum a group norm's statistics in
        # float32 (28x and 9.5x torch's distance from float64 on a 200k-value group); its
        # LayerNormalization in double
        Step("write group norms as layer norms", GroupNormAsLayerNormPass(), LastBit),
    ]
    if optimize:
        # onnxslim's constant folding may round differently from the unfolded graph, so its
        # proof is the checker; verify_onnx measures agreement with the model.
        steps.append(Step("optimise with onnxslim", OnnxSlimPass(), LastBit))
    steps.append(Step("drop unused opset imports", RemoveUnusedOpsetsPass(), Structural))
    return steps


def ort_quantize_steps(scratch: Path, options: OrtQuantizeOptions, weight_range: str) -> list[Step]:
    """ONNX Runtime's quantizer on the float graph, and the record the quantized file carries."""
    return [
        # ORT chooses the scales: the file's own runs and the rule that it quantized something prove it
        Step(f"quantize with ONNX Runtime ({options.mode})", OrtQuantizePass(scratch, options), OnFile),
        Step("drop unused opset imports", RemoveUnusedOpsetsPass(), Structural),
        Step("record the weight range", SetMetadataPass({WEIGHT_RANGE_KEY: weight_range}), Structural),
    ]


_QUANTIZED_OPS = {
    "QuantizeLinear", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulInteger", "ConvInteger",
    "DynamicQuantizeLSTM", "QAttention", "QLinearConv", "QLinearMatMul",
}


def _warn_about_quantized(model: onnx.ModelProto, mode: str) -> None:
    ops = {n.op_type for n in model.graph.node}
    if not ops & _QUANTIZED_OPS:
        warnings.warn(
            f"quantize=True ({mode}) quantized no operator of this model: the file computes in float. "
            f"Check op_types_to_quantize, or use quantize_mode='static' for convolutions and Gemm.",
            PerformanceWarning,
            stacklevel=3,
        )
    elif "ConvInteger" in ops:
        warnings.warn(
            "Dynamic quantization turned Conv into ConvInteger, which ONNX Runtime's CPU provider runs "
            "several times slower than a float Conv; for CNNs use quantize_mode='static'.",
            PerformanceWarning,
            stacklevel=3,
        )
