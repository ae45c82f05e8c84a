"""Fold ``Transpose(DequantizeLinear(W))`` of a constant weight into a transposed constant.

torch.onnx writes ``linear`` on a 3-D input as ``MatMul(x, Transpose(W))``; in a Q/DQ graph the
Transpose then sits between the weight's DequantizeLinear and the MatMul, where runtimes look for
a DQ feeding the MatMul directly. Storing the int8 weight transposed (and moving the DQ's axis
with it) computes exactly the same values.

An ``onnx_ir`` pass: every graph is visited, If/Loop/Scan bodies included, and a weight that
some other node (in any body) still reads is kept.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .._core.ir import unique_name

_DEFAULT = ("", "ai.onnx")


class FoldWeightTransposePass(ir.passes.InPlacePass):
    """Fold every foldable weight Transpose; ``modified`` says whether one was found."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        taken = {v.name for node in ir.traversal.RecursiveGraphIterator(model.graph) for v in (*node.inputs, *node.outputs)
                 if v is not None and v.name}
        taken |= set(model.graph.initializers)
        modified = False
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.op_type != "Transpose" or node.domain not in _DEFAULT:
                continue
            dq = node.inputs[0].producer() if node.inputs[0] is not None else None
            if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in _DEFAULT:
                continue
            weight, scale = dq.inputs[0], dq.inputs[1]
            if weight is None or weight.const_value is None or scale is None or scale.const_value is None:
                continue
            if len(dq.outputs[0].uses()) != 1 or dq.outputs[0].is_graph_output() or node.outputs[0].is_graph_output():
                continue
            values = weight.const_value.numpy()
            perm_attr = node.attributes.get("perm")
            perm = list(perm_attr.as_ints()) if perm_attr is not None else list(range(values.ndim))[::-1]
            axis_attr = dq.attributes.get("axis")
            axis = (axis_attr.as_int() if axis_attr is not None else 1) % values.ndim
            moved = ir.Value(name=unique_name(f"{weight.name}_transposed", taken),
                             const_value=ir.tensor(np.ascontiguousarray(values.transpose(perm))))
            graph = node.graph
            graph.register_initializer(moved)
            attributes = {"axis": perm.index(axis)} if scale.const_value.size > 1 else {}
            folded = ir.node("DequantizeLinear", [moved, *dq.inputs[1:]], attributes,
                             name=unique_name(f"{node.name or moved.name}_dq", taken))
            graph.insert_before(node, folded)
            node.outputs[0].replace_all_uses_with(folded.outputs[0])
            folded.outputs[0].name = node.outputs[0].name  # the value keeps its name for readers' sake
            node.outputs[0].name = unique_name(f"{node.outputs[0].name}_unfolded", taken)
            modified = True
        if modified:
            RemoveUnusedNodesPass()(model)  # the old Transpose, DQ and weight, wherever nothing reads them
        return ir.passes.PassResult(model, modified)



def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    result = onnx.ModelProto()
    result.CopyFrom(model)
    return result
