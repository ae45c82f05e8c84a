"""Move activation Q/DQ pairs from int8 zero-point 0 to uint8 zero-point 128, scales unchanged.

Exact, because a QuantizeLinear saturates to its type's full range:
``sat(round(x/s) + 128, 0, 255) == sat(round(x/s), -128, 127) + 128`` — the same integers read
unsigned. Weight pairs (a DequantizeLinear of a constant, or a Q→DQ of a constant as QAT graphs
write) keep their int8 zero-point.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .._graph import all_names, constants, consumers, is_default_domain, unique_name
from ..errors import ExportRefusedError
from .lower_opset import drop_unused_constants


def _refuse(what: str) -> ExportRefusedError:
    return ExportRefusedError(
        f"Cannot move the activation pairs to uint8: {what} Export with activation_dtype='int8' instead."
    )


def activation_quantizers(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """QuantizeLinear nodes that quantize an activation (their input is not a constant)."""
    consts = constants(graph)
    return [
        n for n in graph.node
        if n.op_type == "QuantizeLinear" and is_default_domain(n) and n.input[0] not in consts
    ]


def activations_to_uint8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` whose activation pairs read uint8 zero-point 128.

    Raises :class:`ExportRefusedError` when an activation zero-point is not 0 (an affine model),
    when a quantized activation is read without a DequantizeLinear, or is a graph output.
    Already-uint8 pairs are left alone, so the pass is idempotent.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    consts = constants(graph)
    readers = consumers(graph)
    outputs = {o.name for o in graph.output}
    taken = all_names(result)
    new_zero_points: dict[str, str] = {}
    moved: set[str] = set()
    replaced: set[str] = set()
    for q in activation_quantizers(graph):
        label = q.name or q.output[0]
        if len(q.input) < 3 or not q.input[2]:
            raise _refuse(f"node '{label}' omits its zero-point, and only zero-points that can be read are moved.")
        zp_name = q.input[2]
        if zp_name not in consts:
            raise _refuse(f"the zero-point of node '{label}' is not a graph constant.")
        zp = numpy_helper.to_array(consts[zp_name])
        if zp.dtype in (np.uint8, np.uint16):
            continue  # already unsigned (moved before, or quantized unsigned)
        if zp.dtype != np.int8 or np.any(zp != 0):
            raise _refuse(
                f"the zero-point of node '{label}' is {zp.dtype.name} {zp.reshape(-1)[:4].tolist()}, not int8 0 "
                f"(the model was quantized with symmetric=False)."
            )
        if q.output[0] in outputs:
            raise _refuse(f"the quantized output '{q.output[0]}' of node '{label}' is a graph output.")
        dqs = readers.get(q.output[0], [])
        for reader in dqs:
            if reader.op_type != "DequantizeLinear" or reader.input[0] != q.output[0]:
                raise _refuse(f"node '{reader.name or reader.op_type}' reads '{q.output[0]}' without dequantizing it.")
        if zp_name not in new_zero_points:
            name = unique_name(f"{zp_name}_uint8", taken)
            graph.initializer.append(numpy_helper.from_array(np.full(zp.shape, 128, dtype=np.uint8), name))
            new_zero_points[zp_name] = name
        for dq in dqs:
            dq_zp = dq.input[2] if len(dq.input) >= 3 else ""
            if dq_zp != zp_name and (
                dq_zp not in consts or np.any(numpy_helper.to_array(consts[dq_zp]).astype(np.int64) != 0)
            ):
                raise _refuse(f"node '{dq.name or dq.op_type}' dequantizes '{q.output[0]}' with another zero-point than 0.")
            replaced.add(dq_zp)
            while len(dq.input) < 3:
                dq.input.append("")
            dq.input[2] = new_zero_points[zp_name]
        q.input[2] = new_zero_points[zp_name]
        replaced.add(zp_name)
        moved.add(q.output[0])
    # The exporter typed the quantized values INT8 in value_info; drop those entries and let
    # consumers infer the type from the nodes.
    keep = [v for v in graph.value_info if v.name not in moved]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    drop_unused_constants(result, replaced - {''})
    return result
