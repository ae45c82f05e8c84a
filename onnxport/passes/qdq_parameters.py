"""Store the scales and zero-points that the exporter left as a ``Cast`` of a constant.

torch.onnx's constant folding stops at a size limit, so a per-channel DequantizeLinear over a
wide weight (a language model's 32,000-row head) reads its zero-point through ``Cast(int64 →
int8)`` computed at run time. ONNX Runtime folds it when it builds a session; readers that take
the parameters from the file (consumers' parsers, ``qdq_stats``, the faithfulness check) see no
zero-point at all. The cast values, stored as the constant they are, compute the same.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .._core.ir import const_array, is_default, nodes, taken_names, unique_name

_QDQ = ("QuantizeLinear", "DequantizeLinear")


class FoldQDQParameterCastsPass(ir.passes.InPlacePass):
    """Replace every Q/DQ scale or zero-point that is a ``Cast`` of a constant by the cast constant."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        taken: set[str] | None = None
        modified = False
        for node in list(nodes(model)):
            if node.op_type not in _QDQ or not is_default(node):
                continue
            for index in (1, 2):
                value = node.inputs[index] if index < len(node.inputs) else None
                cast = value.producer() if value is not None else None
                if cast is None or cast.op_type != "Cast" or not is_default(cast) or value.is_graph_output():
                    continue
                source = const_array(cast.inputs[0])
                if source is None:
                    continue
                dtype = ir.DataType(cast.attributes["to"].as_int())
                taken = taken_names(model) if taken is None else taken
                stored = ir.Value(name=unique_name(f"{value.name or 'qdq_parameter'}_stored", taken),
                                  const_value=ir.tensor(source.astype(dtype.numpy()), dtype=dtype))
                node.graph.register_initializer(stored)
                node.replace_input_with(index, stored)
                modified = True
        if modified:
            RemoveUnusedNodesPass()(model)  # the casts (and their sources) nothing reads any more
        return ir.passes.PassResult(model, modified)
