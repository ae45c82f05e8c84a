"""Give every Conv its ``kernel_shape``, read from the weight through the Q/DQ chain.

ONNX lets a consumer infer the attribute from the weight, but TensorRT's parser reads only
initializer shapes, and in a Q/DQ graph the weight is a DequantizeLinear output. ConvTranspose
and pooling are left as written.
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import constant_shape, is_default, nodes


def convs_missing_kernel_shape(graph: ir.Graph) -> list[str]:
    """Names of the Conv nodes of ``graph`` (not its bodies) without a ``kernel_shape`` attribute."""
    return [
        n.name or n.outputs[0].name
        for n in graph
        if n.op_type == "Conv" and is_default(n) and "kernel_shape" not in n.attributes
    ]


class AddConvKernelShapePass(ir.passes.InPlacePass):
    """Add ``kernel_shape`` to every Conv (in any body) whose weight is a constant.

    Existing attributes are never changed, and weights are not loaded (only their dims are read).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in nodes(model):
            if node.op_type != "Conv" or not is_default(node) or len(node.inputs) < 2 or "kernel_shape" in node.attributes:
                continue
            dims = constant_shape(node.inputs[1])
            if dims is not None and len(dims) >= 3:
                node.attributes["kernel_shape"] = ir.AttrInt64s("kernel_shape", dims[2:])
                modified = True
        return ir.passes.PassResult(model, modified)

    def ensures(self, model: ir.Model) -> None:
        missing = [node.name for node in nodes(model) if node.op_type == "Conv" and is_default(node)
                   and "kernel_shape" not in node.attributes and len(node.inputs) > 1
                   and (dims := constant_shape(node.inputs[1])) is not None and len(dims) >= 3]
        if missing:
            raise ir.passes.PostconditionError(f"Conv nodes with a constant weight and no kernel_shape: {missing[:5]}")
