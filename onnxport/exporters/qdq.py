"""``export_qdq``: a pt2e-quantized model to an ONNX file whose Q/DQ pairs are the model's own."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedOpsetsPass

from .._core.axes import BATCH, asked_axes, captured_axes, resolve_axes
from .._core.io import check_output_path
from ..engine import ExportPlan, run_plan, validate_opset
from ..errors import ExportRefusedError, InvalidArgumentError
from ..inspection.checks import (
    activation_zero_points,
    captured_symbolic_axes,
    captured_with_dynamic_batch,
    check_faithful,
    check_standard_qdq,
    model_qparams,
    pt2e_qdq_nodes,
)
from ..inspection.rules import WEIGHT_RANGE_KEY, check_target
from ..inspection.stats import qdq_stats
from ..passes.bias_skip_norm import BiasSkipLayerNormPass
from ..passes.contrib_gelu import BiasFastGeluPass, BiasGeluPass, DequantizedGeluPass
from ..passes.conv_kernel_shape import AddConvKernelShapePass
from ..passes.dynamic_matmul import DynamicQuantizePass, MatMulIntegerPass
from ..passes.fold_bias_shift import FoldBiasIntoShiftPass
from ..passes.fold_pad import FoldPadIntoConvPass
from ..passes.fold_weight_transpose import FoldWeightTransposePass
from ..passes.gelu_order import GeluOrderPass
from ..passes.global_mean import SpatialMeanToGlobalPoolPass
from ..passes.linear_bias_rank import LinearBiasRankPass
from ..passes.lower_opset import LowerOpsetPass
from ..passes.optimize import OnnxSlimPass
from ..passes.pool_window import PoolWindowPass
from ..passes.qdq_parameters import FoldQDQParameterCastsPass
from ..passes.rsqrt_div import RsqrtToDivPass
from ..passes.uint8_activations import ActivationsToUint8Pass
from ..pipeline import IdenticalOutputs, LastBit, Step, Structural
from ..targets import ExportDefaults, get_target
from .weight_only import WEIGHT_ONLY_OPSET, QuantizedWeight, export_weight_only, quantized_weights

ACTIVATION_DTYPES = ("int8", "uint8")


def _preconditions(model: Any, spec: Any, activation_dtype: str, dynamic_batch: bool) -> None:
    import torch

    if activation_dtype not in ACTIVATION_DTYPES:
        raise InvalidArgumentError(
            f"activation_dtype must be 'int8' (zero-point 0) or 'uint8' (zero-point 128), not {activation_dtype!r}."
        )
    if spec is not None and not spec.has_qdq_form:
        raise InvalidArgumentError(
            f"export_qdq cannot write this model: it was quantized {spec.describe()} with "
            f"backend='{spec.backend}', and {spec.qdq_refusal()}. Quantize with Quantizer(backend='pt2e') "
            f"for a Q/DQ file, or export the float model with export_onnx."
        )
    if not pt2e_qdq_nodes(model):
        raise InvalidArgumentError(
            f"export_qdq needs a pt2e-quantized model, and this {type(model).__name__} carries no "
            f"quantize/dequantize operators: quantize it with Quantizer(backend='pt2e') first, or use "
            f"export_onnx for a float (or ONNX Runtime-quantized) file."
        )
    if activation_dtype == "uint8":
        nonzero = sorted({zp for zp, dtype in activation_zero_points(model) if zp != 0 and dtype == torch.int8})
        if nonzero:
            raise InvalidArgumentError(
                f"activation_dtype='uint8' moves zero-point 0 to 128, but this model's activations have "
                f"zero-points {nonzero[:5]} (quantized with symmetric=False); export with activation_dtype='int8'."
            )
    if dynamic_batch and not captured_with_dynamic_batch(model):
        raise InvalidArgumentError(
            "dynamic_batch=True needs a model captured with a dynamic batch, and this one was captured "
            "with a fixed batch size: quantize with Quantizer(...).quantize(model, data, dynamic_batch=True)."
        )


def _check_captured_axes(model: Any, axes: dict, names: Sequence[str]) -> None:
    """Every axis the file is to have symbolic was captured symbolic."""
    symbolic = captured_symbolic_axes(model)
    for name, wanted in axes.items():
        position = list(names).index(name)
        fixed = [axis for axis in wanted if position < len(symbolic) and axis not in symbolic[position]]
        if fixed:
            raise InvalidArgumentError(
                f"dynamic_axes asks for {name!r} axis {fixed[0]} ({wanted[fixed[0]]!r}) symbolic, but the model was "
                f"captured with that size fixed: quantize with Quantizer(...).quantize(model, data, "
                f"dynamic_axes={{{name!r}: {{{fixed[0]}: {wanted[fixed[0]]!r}}}}}) first."
            )


def export_qdq(
    model: Any,
    sample: Any,
    output_path: str | os.PathLike,
    *,
    opset_version: int | None = None,
    activation_dtype: str | None = None,
    dynamic_batch: bool = False,
    dynamic_axes: Mapping[str, Any] | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> Path:
    """Export a quantized model to ONNX, keeping its Q/DQ node pairs intact — with
    ``activation_dtype='uint8'`` the activation pairs are written with the same scales and
    zero-point 128, and the weight pairs stay int8.

    Args:
        model: a model from ``Quantizer(backend='pt2e')`` (or any pt2e-converted graph module).
        sample: example input(s): a tensor, a tuple of tensors, or a dict of them by name for a model
            quantized from keyword inputs (the file's inputs take those names), batch first.
        output_path: the ``.onnx`` file; it receives a complete, checked file or is left as it was.
        opset_version: the default-domain opset the file must declare (13 and up); ``None``
            takes the model's target's (TensorRT 17, QNN A16W8 21, otherwise 18). The exporter
            writes 18; older opsets are lowered and the lowered graph must run byte-identically.
        activation_dtype: ``'int8'`` (activations as quantized: zero-point 0 when symmetric,
            what TensorRT reads) or ``'uint8'`` (int8 activation pairs move to zero-point 128,
            same scales); weights stay int8 per channel either way. ``None`` takes the target's
            (``'uint8'`` for ``'onnxruntime'`` and ``'qnn'``, else ``'int8'``).
        dynamic_batch: write a symbolic batch dimension (the model must have been captured with
            one: ``Quantizer.quantize(..., dynamic_batch=True)``, the default).
        dynamic_axes: symbolic axes in ``torch.onnx.export``'s form (``{input_name: {axis:
            'label'}}``); by default the axes the model was captured with
            (``Quantizer.quantize(..., dynamic_axes=...)``), its batch only with
            ``dynamic_batch=True``. Every promise is checked at two sizes of each.
        input_names, output_names: graph input/output names (defaults as ``export_onnx``).

    A file for the ``'onnxruntime'`` target writes, where ORT's load-time fusions cannot, a GELU
    whose input is a DequantizeLinear as ORT's ``com.microsoft.Gelu``, a GELU after a float-output
    linear's bias as ``BiasGelu`` or ``FastGelu``, and such a bias with the residual Add and
    LayerNormalization after it as ``SkipLayerNormalization``; every other node is standard.

    Every promise is checked on the produced graph: standard Q/DQ operators only, the model's
    exact scales, zero-points, types and axes, the declared opset, ``kernel_shape`` on every
    Conv, the recorded placement, the recorded target's rules (``check_target``), and a run in
    ONNX Runtime (at two batch sizes when dynamic).

    **Weight-only models** (``Quantizer(backend='torchao', method='int4_weight_only' |
    'int8_weight_only')``) are written at opset 21 (the default for them; older opsets are
    refused, naming 21): each quantized Linear as ``DequantizeLinear(int4|int8, scale[,
    zero-point], axis, block_size) → MatMul`` (what ONNX Runtime runs as ``MatMulNBits``), each
    quantized Embedding as ``DequantizeLinear → Gather``; activations stay float and
    ``activation_dtype`` must be left out. The file's integers, scales, zero-points, axes and
    blocks are checked equal to torchao's, and its outputs must agree with the torchao model to
    cosine ≥ 0.9999 at ONNX Runtime's unoptimised and default levels. A model larger than
    protobuf's 2 GB limit gets its weights in ``<name>.data`` beside the file.
    """

    from .._core.capture import check_names, torch_program
    from .._core.inputs import bind_sample
    from .._core.torch_helpers import eval_mode, require_module
    from ..quantize.spec import quant_spec
    from .translation import translation_table

    require_module(model)
    _, inputs, keywords = bind_sample(model, sample)
    if input_names is None:
        input_names = keywords
    target = check_output_path(output_path)
    spec = quant_spec(model)
    weights = quantized_weights(model) if spec is None or spec.weight_only else []
    if weights or (spec is not None and spec.weight_only):
        return _export_weight_only_checked(
            model, inputs, target, spec, weights, opset_version=opset_version, activation_dtype=activation_dtype,
            dynamic_batch=dynamic_batch, dynamic_axes=dynamic_axes, input_names=input_names, output_names=output_names,
            keywords=keywords,
        )
    preset = spec.target if spec is not None else None
    dynamic = spec is not None and spec.dynamic_activations and spec.has_qdq_form
    if dynamic and activation_dtype not in (None, "uint8"):
        raise InvalidArgumentError(
            f"activation_dtype={activation_dtype!r}: this model quantizes its activations at run time, which ONNX "
            f"DynamicQuantizeLinear does in uint8 only. Drop activation_dtype."
        )
    defaults = get_target(preset).defaults
    default_opset = defaults.opset_for(spec.activation_bits if spec is not None else None)
    activation_dtype = defaults.activation_dtype if activation_dtype is None else activation_dtype
    opset_version = validate_opset(default_opset if opset_version is None else opset_version)
    _preconditions(model, spec, activation_dtype, dynamic_batch)
    expected = model_qparams(model)
    n_outputs = _count_outputs(model, inputs)
    in_names = check_names(input_names, len(inputs), "input_names", "input")
    out_names = check_names(output_names, n_outputs, "output_names", "output")
    axes = _file_axes(model, dynamic_axes, dynamic_batch, in_names, inputs)
    _check_captured_axes(model, axes, in_names)
    feeds = {name: t.detach().cpu().numpy() for name, t in zip(in_names, inputs)}

    def capture() -> ir.Model:
        with eval_mode(model):
            captured = torch_program(
                model, inputs, opset_version=opset_version, input_names=in_names, output_names=out_names,
                axes=axes, custom_translation_table=translation_table(dynamic=dynamic),
            ).model
        if dynamic:  # part of the translation: the graph is not valid ONNX before it
            DynamicQuantizePass()(captured)
        return captured

    steps = dynamic_steps(opset_version) if dynamic else qdq_steps(opset_version, activation_dtype, defaults)
    plan = ExportPlan(
        "export_qdq", opset_version, feeds, capture, steps, axes=axes,
        captured_proofs=[*([] if dynamic else [check_standard_qdq]), lambda produced: check_faithful(produced, expected)],
        # the record check_target reads: which weight rule the file follows
        metadata={WEIGHT_RANGE_KEY: spec.weight_range} if spec is not None else {},
        rules=[*_record_rules(spec, preset), *([_within_floor(model, inputs, in_names, axes)] if dynamic else [])],
    )
    run_plan(plan, target)
    return target


def dynamic_steps(opset_version: int) -> list[Step]:
    """The graph steps of a model with run-time quantized activations (``activations='dynamic'``):
    the weights' pairs tidied as in :func:`qdq_steps`, then each linear layer written as
    ``MatMulInteger``, whose exact integer sum is proven by the rounding floor, not last-bit equality."""
    return [
        Step("store cast Q/DQ parameters", FoldQDQParameterCastsPass(), IdenticalOutputs),
        Step(f"lower to opset {opset_version}", LowerOpsetPass(opset_version), IdenticalOutputs),
        Step("fold weight transposes", FoldWeightTransposePass(), IdenticalOutputs),
        Step("order GELUs for fusion", GeluOrderPass(), IdenticalOutputs),
        Step("drop unused opset imports", RemoveUnusedOpsetsPass(), Structural),
        Step("write linear layers as MatMulInteger", MatMulIntegerPass(), LastBit),
        Step("write rsqrt as a division", RsqrtToDivPass(), LastBit),
        # as export_onnx does: no weight is left behind a DequantizeLinear (MatMulInteger reads them),
        # and onnxslim keeps such pairs anyway; it drops what a float file drops (an all-zero bias
        # or mask added, a constant computed at every run)
        Step("optimise with onnxslim", OnnxSlimPass(), LastBit),
    ]


def _within_floor(model: Any, inputs: tuple, names: list[str], axes: dict) -> Any:
    """The file rule of the dynamic scheme: at ONNX Runtime's unoptimised and default levels, at
    two sizes of every symbolic axis, each output within twice the model's own rounding floor."""
    import torch

    from .._core.axes import second_size
    from ..compare.quantized import compare_qdq

    feeds = {name: t.detach().cpu().numpy() for name, t in zip(names, inputs)}
    samples = [feeds, second_size(feeds, axes)] if axes else [feeds]

    def rule(path: Path) -> None:
        for sample in samples:
            tensors = tuple(torch.from_numpy(v) for v in sample.values())
            for optimized in (False, True):
                report = compare_qdq(model, path, tensors, optimized=optimized, rounding_floor=True)
                failing = [o.name for o in report.outputs if o.within_floor is False]
                if failing:
                    level = "default" if optimized else "unoptimised"
                    raise ExportRefusedError(
                        f"At ONNX Runtime's {level} level the file is beyond twice its model's rounding floor on "
                        f"{failing} ({', '.join(f'{k} {list(v.shape)}' for k, v in sample.items())}):\n{report}\n"
                        f"Nothing was kept."
                    )
    return rule


def qdq_steps(opset_version: int, activation_dtype: str, defaults: ExportDefaults | None = None) -> list[Step]:
    """The graph steps of :func:`export_qdq`, in order, each with its proof (which of the optional
    ones run: the target's :class:`~onnxport.targets.ExportDefaults`)."""
    defaults = defaults or ExportDefaults()
    steps = [
        Step("store cast Q/DQ parameters", FoldQDQParameterCastsPass(), IdenticalOutputs),
        Step(f"lower to opset {opset_version}", LowerOpsetPass(opset_version), IdenticalOutputs),
        Step("fold weight transposes", FoldWeightTransposePass(), IdenticalOutputs),
        Step("fold zero pads into convs", FoldPadIntoConvPass(), IdenticalOutputs),
        Step("order GELUs for fusion", GeluOrderPass(), IdenticalOutputs),
        *([Step("give float-output linears' biases the input's rank", LinearBiasRankPass(), IdenticalOutputs)]
          if defaults.bias_at_input_rank else []),
        Step("add Conv kernel_shape", AddConvKernelShapePass(), Structural),
        Step("drop unused opset imports", RemoveUnusedOpsetsPass(), Structural),
    ]
    if activation_dtype == "uint8":
        steps.append(Step("move activations to uint8", ActivationsToUint8Pass(), IdenticalOutputs))
    # Last: ORT's unoptimised run of a global pool or a clipped window sums in another order, and a
    # quotient rounds once where the product of a reciprocal rounded twice (one ulp apart; its
    # optimised run and torch agree with the original), and identical-outputs proofs
    # compare with the graph as produced, so no such proof may follow a step that can move a last bit.
    steps.append(Step("write rsqrt as a division", RsqrtToDivPass(), LastBit))
    steps.append(Step("write spatial means as global pools", SpatialMeanToGlobalPoolPass(), LastBit))
    steps.append(Step("clip pool windows to their input", PoolWindowPass(), LastBit))
    if defaults.fold_bias_shifts:
        steps.append(Step("fold biases into the next constant shift", FoldBiasIntoShiftPass(), LastBit))
    if defaults.bias_skip_norm:
        steps.append(Step("write bias, residual and LayerNorm as ORT's SkipLayerNormalization", BiasSkipLayerNormPass(), LastBit))
    if defaults.contrib_gelu:
        # the fused kernels may round a last bit unlike the five ops: the checker is their proof
        steps.append(Step("write biased GELUs as ORT's BiasGelu", BiasGeluPass(), LastBit))
        steps.append(Step("write biased tanh GELUs as ORT's FastGelu", BiasFastGeluPass(), LastBit))
        steps.append(Step("write dequantized GELUs as ORT's Gelu", DequantizedGeluPass(), LastBit))
    return steps


def _record_rules(spec: Any, preset: str | None) -> list:
    """The file rules the model's record implies: its placement, and its target's rules."""
    rules = []
    if spec is not None and spec.placement == "skip_conv_add":
        def placement(path: Path) -> None:
            if qdq_stats(path).n_unquantized_conv_add == 0:
                raise ExportRefusedError(
                    "The model records qdq_placement='skip_conv_add', but in the exported graph every Add reads its "
                    "inputs through a Q/DQ pair; nothing was kept."
                )
        rules.append(placement)
    if preset is not None:
        def target_rules(path: Path) -> None:
            problems = check_target(path, preset)
            if problems:
                raise ExportRefusedError(
                    f"The exported file breaks target '{preset}': " + " ".join(problems[:5])
                    + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") + " Nothing was kept."
                )
        rules.append(target_rules)
    return rules


def _export_weight_only_checked(
    model: Any,
    inputs: tuple,
    target: Path,
    spec: Any,
    weights: list[QuantizedWeight],
    *,
    opset_version: int | None,
    activation_dtype: str | None,
    dynamic_batch: bool,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    keywords: tuple[str, ...] | None = None,
    dynamic_axes: Mapping[str, Any] | None = None,
) -> Path:
    """The weight-only path of :func:`export_qdq`: validate everything, then export, write, check."""
    from .._core.capture import check_names
    from .._core.inputs import forward_aliases

    precision = spec.describe() if spec is not None else "torchao weight-only"
    if activation_dtype is not None:
        raise InvalidArgumentError(
            f"activation_dtype={activation_dtype!r} was given, but this model ({precision}) quantizes weights only: "
            f"its activations stay float and have no Q/DQ pairs. Drop activation_dtype."
        )
    opset_version = validate_opset(WEIGHT_ONLY_OPSET if opset_version is None else opset_version)
    if opset_version < WEIGHT_ONLY_OPSET:
        kinds = sorted({f"int{w.bits}" for w in weights}) or ["int4/int8"]
        raise InvalidArgumentError(
            f"This model ({precision}) has {'/'.join(kinds)} weights in blocks, which DequantizeLinear says from "
            f"opset {WEIGHT_ONLY_OPSET} (int4 and block_size are new there); opset {opset_version} has no such "
            f"form. Pass opset_version={WEIGHT_ONLY_OPSET} (the default for weight-only models)."
        )
    if not weights:
        raise InvalidArgumentError(
            f"The model records {precision}, but none of its layers holds a torchao weight-only tensor; "
            f"quantize it with Quantizer(backend='torchao', method='int4_weight_only') again."
        )
    in_names = check_names(input_names, len(inputs), "input_names", "input")
    axes = resolve_axes(dynamic_axes, dynamic_batch=dynamic_batch, names=in_names, inputs=inputs,
                        aliases=forward_aliases(model, in_names, keywords))

    export_weight_only(
        model, inputs, target, weights=weights, opset_version=opset_version, in_names=in_names,
        out_names=None if output_names is None else list(output_names), axes=axes, keywords=keywords,
    )
    return target


def _file_axes(model: Any, dynamic_axes: Any, dynamic_batch: bool, names: list[str], inputs: tuple) -> dict:
    """The axes the file gets: those asked for, or those the model was captured with — its batch
    with ``dynamic_batch``, or when the batch was named in ``dynamic_axes`` at capture."""
    if dynamic_axes is None:
        captured = captured_axes(model)
        asked = asked_axes(model) or [{} for _ in names]
        if captured:
            dynamic_axes = {
                name: {axis: label for axis, label in spec.items()
                       if not (axis == 0 and label == BATCH and axis not in named)}
                for name, spec, named in zip(names, captured, asked)
            }
            dynamic_axes = {name: spec for name, spec in dynamic_axes.items() if spec} or None
    return resolve_axes(dynamic_axes, dynamic_batch=dynamic_batch, names=names, inputs=inputs)


def _count_outputs(model: Any, inputs: tuple) -> int:
    """How many tensors the model returns, read from its graph (no forward pass needed)."""
    import torch

    from .._core.inputs import flatten_outputs

    output = next((n for n in model.graph.nodes if n.op == "output"), None)
    if output is not None:
        leaves = torch.utils._pytree.tree_leaves(output.args[0])
        return sum(1 for leaf in leaves if isinstance(leaf, torch.fx.Node))
    with torch.no_grad():
        return len(flatten_outputs(model(*inputs)))
