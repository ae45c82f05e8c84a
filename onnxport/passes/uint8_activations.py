"""Move activation Q/DQ pairs from int8 zero-point 0 to uint8 zero-point 128, scales unchanged.

Exact, because a QuantizeLinear saturates to its type's full range:
``sat(round(x/s) + 128, 0, 255) == sat(round(x/s), -128, 127) + 128`` — the same integers read
unsigned. Weight pairs (a DequantizeLinear of a constant, or a Q→DQ of a constant as QAT graphs
write) keep their int8 zero-point.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import const_array, drop_unread_constants, is_default, nodes, taken_names, unique_name
from ..errors import ExportRefusedError


def _refuse(what: str) -> ExportRefusedError:
    return ExportRefusedError(
        f"Cannot move the activation pairs to uint8: {what} Export with activation_dtype='int8' instead."
    )


def _label(node: ir.Node) -> str:
    return node.name or node.outputs[0].name or node.op_type


class ActivationsToUint8Pass(ir.passes.InPlacePass):
    """Give every activation pair (in any body) uint8 zero-point 128; already-uint8 pairs stay.

    Raises :class:`ExportRefusedError` when an activation zero-point is not int8 0 (an affine
    model), when a quantized activation is read without a DequantizeLinear, or is a graph output.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        taken = taken_names(model)
        moved: dict[int, ir.Value] = {}  # id(old zero-point) -> its uint8 replacement
        replaced: list[ir.Value] = []
        for q in list(nodes(model)):
            if q.op_type != "QuantizeLinear" or not is_default(q) or const_array(q.inputs[0]) is not None:
                continue  # not a Q, or a weight's Q (QAT graphs quantize constants)
            if len(q.inputs) < 3 or q.inputs[2] is None:
                raise _refuse(f"node '{_label(q)}' omits its zero-point, and only zero-points that can be read are moved.")
            zp_value = q.inputs[2]
            zp = const_array(zp_value)
            if zp is None:
                raise _refuse(f"the zero-point of node '{_label(q)}' is not a graph constant.")
            if zp.dtype in (np.uint8, np.uint16):
                continue  # already unsigned (moved before, or quantized unsigned)
            if zp.dtype != np.int8 or np.any(zp != 0):
                raise _refuse(
                    f"the zero-point of node '{_label(q)}' is {zp.dtype.name} {zp.reshape(-1)[:4].tolist()}, not int8 0 "
                    f"(the model was quantized with symmetric=False)."
                )
            quantized = q.outputs[0]
            if quantized.is_graph_output():
                raise _refuse(f"the quantized output '{quantized.name}' of node '{_label(q)}' is a graph output.")
            readers = [user for user, _ in quantized.uses()]
            for reader, index in quantized.uses():
                if reader.op_type != "DequantizeLinear" or index != 0:
                    raise _refuse(f"node '{reader.name or reader.op_type}' reads '{quantized.name}' without dequantizing it.")
            for dq in readers:
                dq_zp = dq.inputs[2] if len(dq.inputs) >= 3 else None
                if dq_zp is None or dq_zp is zp_value:
                    continue  # an omitted zero-point is 0
                values = const_array(dq_zp)
                if values is None or np.any(values != 0):
                    raise _refuse(f"node '{dq.name or dq.op_type}' dequantizes '{quantized.name}' with another zero-point than 0.")
            if id(zp_value) not in moved:
                fresh = ir.Value(name=unique_name(f"{zp_value.name}_uint8", taken),
                                 const_value=ir.tensor(np.full(zp.shape, 128, dtype=np.uint8)))
                model.graph.register_initializer(fresh)  # outer scope: visible to every body
                moved[id(zp_value)] = fresh
            fresh = moved[id(zp_value)]
            replaced.append(zp_value)
            q.replace_input_with(2, fresh)
            for dq in readers:
                if len(dq.inputs) < 3:
                    dq.resize_inputs(3)
                elif dq.inputs[2] is not None:
                    replaced.append(dq.inputs[2])
                dq.replace_input_with(2, fresh)
            if "output_dtype" in q.attributes:
                q.attributes["output_dtype"] = ir.AttrInt64("output_dtype", ir.DataType.UINT8)
            # The exporter typed the quantized value INT8; let readers infer it from the nodes.
            quantized.type = None
            quantized.shape = None
        drop_unread_constants(replaced)
        return ir.passes.PassResult(model, bool(moved))
