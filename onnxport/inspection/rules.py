"""``check_target``: a target's :class:`~onnxport.targets.FileRules`, checked on a Q/DQ file."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir

from .._core.cpu import PORTABLE_WEIGHT_RANGE, WEIGHT_RANGE_KEY
from .._core.ir import const_tensor, graphs, is_default, opset_of, read_model, read_values
from ..errors import check_choice
from ..passes.conv_kernel_shape import convs_missing_kernel_shape
from ..targets import I8 as _I8
from ..targets import TARGETS, get_target
from ..targets import U8 as _U8
from ..targets import U16 as _U16
from .view import qdq_nodes


def _label(node: ir.Node) -> str:
    return f"{node.op_type} '{node.name or node.outputs[0].name}'"


def check_target(onnx_path: str | os.PathLike | onnx.ModelProto, target: str) -> list[str]:
    """Every way the file breaks ``target``'s rules, in plain words; an empty list when none.

    ``'tensorrt'``: zero-points all 0 and signed, opset at most 17, ``kernel_shape`` on every
    Conv, no DequantizeLinear of an int32 bias. ``'onnxruntime'``: activations uint8 (U8S8),
    weights int8, no ReLU/Clip between a producer and a Q whose range does not start at 0 (ORT
    keeps such a ReLU and runs the conv in float). ``'qnn'``: activations uint8 or uint16, weights
    int8 with zero-point 0, uint16 only at opset 21 or later.
    """
    record = get_target(check_choice(target, TARGETS, "target"))
    rules, consumer = record.rules, record.consumer
    model, _ = read_model(onnx_path)
    opset = opset_of(model)
    problems: list[str] = []
    activation_types: Counter[int] = Counter()
    weight_inputs = _weight_inputs(model)
    portable = rules.portable_weights and file_weight_range(model) != "full"
    for q in qdq_nodes(model):
        zp, dtype = q.zero_point_values(), q.dtype if q.zero_point is not None else None
        label = _label(q.node)
        if q.kind == "activation" and dtype is not None:
            activation_types[dtype] += 1
        if rules.zero_points_zero == "all" and zp is not None and np.any(zp != 0):
            problems.append(f"{label} has a non-zero zero-point; {consumer} needs every zero-point 0.")
        if not rules.unsigned_allowed and dtype in (_U8, _U16):
            problems.append(f"{label} is unsigned; {consumer} rejects UINT8 QuantizeLinear/DequantizeLinear.")
        if not rules.int32_bias_allowed and q.kind == "bias":
            problems.append(f"{label} dequantizes an int32 bias, which {consumer}'s parser rejects.")
        # A weight is a dequantized constant that a Conv/Gemm/MatMul reads as its weight. Other
        # constant pairs (a position table or mask the exporter folded, quantized with the
        # activation spec) follow neither the weight rules nor the activation ones.
        is_weight = q.kind == "constant" and q.op_type == "DequantizeLinear" and q.output in weight_inputs
        if not is_weight or dtype is None:
            continue
        if rules.weight_type is not None and dtype != rules.weight_type:
            problems.append(f"{label} stores its weight as {onnx.TensorProto.DataType.Name(dtype)}; "
                            f"{target} wants {onnx.TensorProto.DataType.Name(rules.weight_type).lower()} weights.")
        elif rules.zero_points_zero == "weights" and zp is not None and np.any(zp != 0):
            problems.append(f"{label} has a weight zero-point other than 0; {consumer} wants symmetric weights.")
    for label, tensor in integer_op_weights(model):  # MatMulInteger/ConvInteger read their integers directly
        if rules.weight_type is not None and int(tensor.dtype) != rules.weight_type:
            problems.append(f"{label} reads its weight as {onnx.TensorProto.DataType.Name(int(tensor.dtype))}; "
                            f"{target} wants {onnx.TensorProto.DataType.Name(rules.weight_type).lower()} weights.")
    if portable:
        problems += [
            f"{label} holds int8 weights on [{low}, {high}], beyond [{PORTABLE_LOW}, {PORTABLE_HIGH}]: on x86 CPUs "
            f"without VNNI, {consumer}'s U8S8 kernels add two products in a saturating int16 and compute "
            f"something else. Quantize with weight_range='portable' (the default), or record weight_range='full' "
            f"for a deployment known to have VNNI/AMX."
            for label, low, high in weights_beyond_portable(model)
        ]
    if rules.max_opset is not None and opset > rules.max_opset:
        problems.append(f"the file declares opset {opset}; export at opset {rules.max_opset} for {consumer}'s parser.")
    if rules.needs_kernel_shape:
        for graph in graphs(model):
            problems += [f"Conv '{n}' has no kernel_shape, which {consumer}'s parser needs."
                         for n in convs_missing_kernel_shape(graph)]
    if rules.activation_types is not None:
        wrong = {t: n for t, n in activation_types.items() if t not in rules.activation_types}
        if wrong:
            kinds = ", ".join(f"{n} {onnx.TensorProto.DataType.Name(t).lower()}"
                              + (" (signed)" if np.issubdtype(onnx.helper.tensor_dtype_to_np_dtype(t), np.signedinteger) else "")
                              for t, n in sorted(wrong.items()))
            problems.append(f"activation Q/DQ node(s) are {kinds}; {rules.activation_hint}")
    if activation_types[_U16] and opset < rules.opset_16bit:
        problems.append(f"uint16 activations need opset {rules.opset_16bit}, and the file declares {opset}.")
    if rules.relu_range_from_zero:
        problems += _ort_unfoldable_relus(model)
    return problems


PORTABLE_LOW, PORTABLE_HIGH = PORTABLE_WEIGHT_RANGE


def file_weight_range(model: ir.Model | onnx.ModelProto) -> str | None:
    """The ``weight_range`` a file records (``'portable'`` or ``'full'``), ``None`` when it records none."""
    if isinstance(model, ir.Model):
        return model.metadata_props.get(WEIGHT_RANGE_KEY)
    return next((p.value for p in model.metadata_props if p.key == WEIGHT_RANGE_KEY), None)


_INTEGER_OPS = ("MatMulInteger", "ConvInteger")


def integer_op_weights(model: ir.Model) -> list[tuple[str, ir.TensorProtocol]]:
    """(label, stored integers) of the weight (input 1) of every MatMulInteger and ConvInteger:
    dynamic-scheme files (ours, and ONNX Runtime's ``quantize_dynamic``) keep their weights there."""
    found = []
    for graph in graphs(model):
        for node in graph:
            if node.op_type in _INTEGER_OPS and is_default(node) and len(node.inputs) > 1:
                tensor = const_tensor(node.inputs[1])
                if tensor is not None:
                    found.append((_label(node), tensor))
    return found


def weights_beyond_portable(model: ir.Model, nodes: list | None = None) -> list[tuple[str, int, int]]:
    """(reader, lowest, highest) of every int8 weight a Conv/Gemm/MatMul reads through a
    DequantizeLinear (of ``nodes``, or all of the file's) or a MatMulInteger/ConvInteger reads
    directly, whose integers leave [-64, 64]: the weights that x86 U8S8 kernels without VNNI may
    saturate on."""
    weight_inputs = _weight_inputs(model)
    found = []
    for label, tensor in integer_op_weights(model):
        if tensor.dtype == _I8:
            integers = read_values(tensor)
            low, high = int(integers.min(initial=0)), int(integers.max(initial=0))
            if low < PORTABLE_LOW or high > PORTABLE_HIGH:
                found.append((label, low, high))
    for q in qdq_nodes(model) if nodes is None else nodes:
        if q.op_type != "DequantizeLinear" or q.output not in weight_inputs:
            continue
        tensor = const_tensor(q.input)
        if tensor is None or tensor.dtype != _I8:
            continue
        integers = read_values(tensor)
        low, high = int(integers.min(initial=0)), int(integers.max(initial=0))
        if low < PORTABLE_LOW or high > PORTABLE_HIGH:
            found.append((_label(q.node), low, high))
    return found


def _weight_inputs(model: ir.Model) -> set[ir.Value]:
    """Values read as the weight (input 1) of a Conv, ConvTranspose, Gemm or MatMul."""
    return {
        node.inputs[1]
        for graph in graphs(model)
        for node in graph
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and is_default(node) and len(node.inputs) > 1
        and node.inputs[1] is not None
    }


def _ort_unfoldable_relus(model: ir.Model) -> list[str]:
    problems = []
    for graph in graphs(model):
        for node in graph:
            if node.op_type not in ("Relu", "Clip") or not is_default(node):
                continue
            for q, _ in node.outputs[0].uses():
                if q.op_type != "QuantizeLinear" or len(q.inputs) < 3:
                    continue
                tensor = const_tensor(q.inputs[2])
                if tensor is None:
                    continue
                zp = read_values(tensor)
                lowest = np.iinfo(tensor.dtype.numpy()).min
                if np.any(zp != lowest):
                    problems.append(
                        f"{_label(node)} feeds {_label(q)} whose range does not start at 0 (zero-point "
                        f"{zp.reshape(-1)[0]}); ONNX Runtime keeps the {node.op_type} and runs its producer in float. "
                        f"Quantize with Quantizer(target='onnxruntime')."
                    )
    return problems
