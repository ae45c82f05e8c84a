"""Deployment targets: the rules each consumer imposes on a Q/DQ file, checked on the file."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from .._graph import all_constants, consumers, is_default_domain, opset_of, tensor_value, walk_graphs
from ..errors import check_choice
from ..passes.conv_kernel_shape import convs_missing_kernel_shape
from .view import qdq_nodes

TARGETS = ("tensorrt", "onnxruntime", "qnn")

#: What each preset exports by default: (activation_dtype, opset_version).
TARGET_DEFAULTS = {"tensorrt": ("int8", 17), "onnxruntime": ("uint8", 18), "qnn": ("uint8", 18), None: ("int8", 18)}

_TENSORRT_MAX_OPSET = 17  # the opset every TensorRT 8.6+ parser reads
_ORT_INT8 = {"QLinearConv": "Conv", "QGemm": "Gemm", "QLinearMatMul": "MatMul", "MatMulIntegerToFloat": "MatMul",
             "QLinearAdd": "Add", "ConvInteger": "Conv", "MatMulInteger": "MatMul"}
_ORT_FLOAT = {"Conv": "Conv", "FusedConv": "Conv", "NchwcConv": "Conv", "Gemm": "Gemm", "FusedGemm": "Gemm",
              "MatMul": "MatMul", "FusedMatMul": "MatMul", "Add": "Add"}


def _label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} '{node.name or node.output[0]}'"


def check_target(onnx_path: str | os.PathLike | onnx.ModelProto, target: str) -> list[str]:
    """Every way the file breaks ``target``'s rules, in plain words; an empty list when none.

    ``'tensorrt'``: zero-points all 0 and signed, opset at most 17, ``kernel_shape`` on every
    Conv, no DequantizeLinear of an int32 bias. ``'onnxruntime'``: activations uint8 (U8S8),
    weights int8, no ReLU/Clip between a producer and a Q whose range does not start at 0 (ORT
    keeps such a ReLU and runs the conv in float). ``'qnn'``: activations uint8 or uint16, weights
    int8 with zero-point 0, uint16 only at opset 21 or later.
    """
    check_choice(target, TARGETS, "target")
    if isinstance(onnx_path, onnx.ModelProto):
        model, base = onnx_path, None
    else:
        from .._io import read_onnx

        model, base = read_onnx(onnx_path, "onnx_path"), Path(onnx_path).parent
    consts = all_constants(model)
    opset = opset_of(model)
    problems: list[str] = []
    activation_types: Counter[int] = Counter()
    for q in qdq_nodes(model, base):
        zp, dtype = q.zero_point_values(), q.dtype if q.zero_point is not None else None
        label = _label(q.node)
        if q.kind == "activation" and dtype is not None:
            activation_types[dtype] += 1
        if target == "tensorrt":
            if zp is not None and np.any(zp != 0):
                problems.append(f"{label} has a non-zero zero-point; TensorRT needs every zero-point 0.")
            if dtype in (onnx.TensorProto.UINT8, onnx.TensorProto.UINT16):
                problems.append(f"{label} is unsigned; TensorRT rejects UINT8 QuantizeLinear/DequantizeLinear.")
            if q.kind == "bias":
                problems.append(f"{label} dequantizes an int32 bias, which TensorRT's parser rejects.")
        elif q.kind == "weight" and dtype is not None and dtype != onnx.TensorProto.INT8:
            problems.append(f"{label} stores its weight as {onnx.TensorProto.DataType.Name(dtype)}; {target} wants int8 weights.")
        elif q.kind == "weight" and target == "qnn" and zp is not None and np.any(zp != 0):
            problems.append(f"{label} has a weight zero-point other than 0; QNN wants symmetric weights.")
    if target == "tensorrt":
        if opset > _TENSORRT_MAX_OPSET:
            problems.append(f"the file declares opset {opset}; export at opset {_TENSORRT_MAX_OPSET} for TensorRT's parser.")
        for graph in walk_graphs(model.graph):
            problems += [f"Conv '{n}' has no kernel_shape, which TensorRT's parser needs." for n in convs_missing_kernel_shape(graph)]
    elif target == "onnxruntime":
        if activation_types[onnx.TensorProto.INT8]:
            problems.append(
                f"{activation_types[onnx.TensorProto.INT8]} activation Q/DQ node(s) are int8; ONNX Runtime's CPU runs "
                f"U8S8 (uint8 activations) fastest: export with activation_dtype='uint8'."
            )
        problems += _ort_unfoldable_relus(model, consts, base)
    elif target == "qnn":
        if activation_types[onnx.TensorProto.INT8] or activation_types[onnx.TensorProto.INT16]:
            problems.append("some activation pairs are signed; QNN reads uint8 (or uint16) activations.")
        if activation_types[onnx.TensorProto.UINT16] and opset < 21:
            problems.append(f"uint16 activations need opset 21, and the file declares {opset}.")
    return problems


def _ort_unfoldable_relus(model: onnx.ModelProto, consts: dict, base: Path | None) -> list[str]:
    problems = []
    for graph in walk_graphs(model.graph):
        readers = consumers(graph)
        for node in graph.node:
            if node.op_type not in ("Relu", "Clip") or not is_default_domain(node):
                continue
            for q in readers.get(node.output[0], []):
                if q.op_type != "QuantizeLinear" or len(q.input) < 3 or q.input[2] not in consts:
                    continue
                tensor = consts[q.input[2]]
                zp = tensor_value(tensor, base)
                lowest = np.iinfo(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).min
                if np.any(zp != lowest):
                    problems.append(
                        f"{_label(node)} feeds {_label(q)} whose range does not start at 0 (zero-point "
                        f"{zp.reshape(-1)[0]}); ONNX Runtime keeps the {node.op_type} and runs its producer in float. "
                        f"Quantize with Quantizer(target='onnxruntime')."
                    )
    return problems


def ort_optimised_ops(onnx_path: str | os.PathLike) -> Counter[str]:
    """Operator counts of the graph ONNX Runtime actually runs (CPU provider, default level)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as scratch:
        optimised = Path(scratch) / "optimised.onnx"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(optimised)
        options.log_severity_level = 3  # saving an NCHWc-optimised graph warns that it is machine-specific
        # A model over 2 GB can only be saved with its weights outside the proto.
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimised.onnx.data")
        ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        return Counter(node.op_type for node in onnx.load_model(str(optimised), load_external_data=False).graph.node)


def ort_int8_counts(onnx_path: str | os.PathLike, optimised: Counter[str] | None = None) -> dict[str, dict[str, int]]:
    """How many Conv/Gemm/MatMul/Add ONNX Runtime runs in INT8 after its own optimisation.

    Read from the optimised graph ORT writes (default level, CPU provider), or from
    ``optimised`` (the counts :func:`ort_optimised_ops` returned) when given. Returns
    ``{op: {"int8": n, "float": m}}``; weight-only ``MatMulNBits`` is in neither.
    """
    counts: dict[str, dict[str, int]] = {op: {"int8": 0, "float": 0} for op in ("Conv", "Gemm", "MatMul", "Add")}
    for op, n in (ort_optimised_ops(onnx_path) if optimised is None else optimised).items():
        if op in _ORT_INT8:
            counts[_ORT_INT8[op]]["int8"] += n
        elif op in _ORT_FLOAT:
            counts[_ORT_FLOAT[op]]["float"] += n
    return counts
