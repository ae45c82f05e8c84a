"""Write a ReLU that follows a weight-only MatMul as ``Max(x, 0)``, so that ONNX Runtime fuses the MatMul.

ONNX Runtime's QDQ selectors look past a ReLU or Clip that is a node's only reader, for the
``QuantizeLinear`` that makes it redundant; when that ReLU has one reader and it is not a
``QuantizeLinear``, the selection fails, and so does ``DequantizeLinear → MatMul → MatMulNBits``
for the MatMul before it: the weight is dequantized on every run and the product is float. A
feed-forward block ``MatMul → ReLU → MatMul`` (T5 v1.0, OPT, many MLPs) hits it at every layer.
``Max(x, 0)`` computes every value ReLU computes (a negative zero may come out positive, which no
sum can tell apart), and the selectors do not look past it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import is_default, nodes

_WEIGHT_READERS = ("MatMul", "Gemm")


def _blocks_fusion(relu: ir.Node) -> bool:
    """Whether ``relu`` is the ReLU that stops ORT fusing the weight-only product it reads."""
    product = relu.inputs[0].producer() if relu.inputs and relu.inputs[0] is not None else None
    if product is None or product.op_type not in _WEIGHT_READERS or not is_default(product):
        return False
    weight = product.inputs[1].producer() if len(product.inputs) > 1 and product.inputs[1] is not None else None
    if weight is None or weight.op_type != "DequantizeLinear":
        return False
    # ORT's rule: the product's only reader is the ReLU, which has one reader that is not a Q and is
    # not a graph output
    out, readers = relu.outputs[0], list(relu.outputs[0].uses())
    sole = len(list(relu.inputs[0].uses())) == 1 and not relu.inputs[0].is_graph_output()
    return sole and len(readers) == 1 and not out.is_graph_output() and readers[0][0].op_type != "QuantizeLinear"


class ReluAfterWeightOnlyMatMulPass(ir.passes.InPlacePass):
    """Rewrite each ReLU that reads a ``DequantizeLinear``-weighted MatMul or Gemm as its only
    reader, and has one reader that is not a ``QuantizeLinear``, as ``Max(x, 0)`` (graphs, bodies
    and functions). Every other ReLU is left alone."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for relu in list(nodes(model)):
            if relu.op_type != "Relu" or not is_default(relu) or not _blocks_fusion(relu):
                continue
            dtype = relu.inputs[0].dtype or ir.DataType.FLOAT
            # a Constant node, not an initializer: the ReLU may sit in a function, which holds none
            constant = ir.node("Constant", [], attributes={"value": ir.tensor(np.zeros((), dtype=dtype.numpy()))},
                               name=f"{relu.name}.zero" if relu.name else None)
            relu.graph.insert_before(relu, constant)
            zero = constant.outputs[0]
            zero.name = f"{relu.outputs[0].name}.zero"
            graph = relu.graph
            maximum = ir.node("Max", [relu.inputs[0], zero], name=relu.name or None)
            ir.convenience.replace_nodes_and_values(graph, relu, [relu], [maximum], [relu.outputs[0]], [maximum.outputs[0]])
            modified = True
        return ir.passes.PassResult(model, modified)
