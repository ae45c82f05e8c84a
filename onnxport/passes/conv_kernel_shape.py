"""Give every Conv its ``kernel_shape``, read from the weight through the Q/DQ chain.

ONNX lets a consumer infer the attribute from the weight, but TensorRT's parser reads only
initializer shapes, and in a Q/DQ graph the weight is a DequantizeLinear output. ConvTranspose
and pooling are left as written.
"""

from __future__ import annotations

import onnx

from .._graph import constant_dims, is_default_domain


def convs_missing_kernel_shape(graph: onnx.GraphProto) -> list[str]:
    """Names of the Conv nodes without a ``kernel_shape`` attribute."""
    return [
        n.name or n.output[0]
        for n in graph.node
        if n.op_type == "Conv" and is_default_domain(n) and not any(a.name == "kernel_shape" for a in n.attribute)
    ]


def add_conv_kernel_shape(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` in which every Conv whose weight is a constant has ``kernel_shape``.

    Existing attributes are never changed; weights are not loaded (only their dims are read).
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    for node in graph.node:
        if node.op_type != "Conv" or not is_default_domain(node) or len(node.input) < 2:
            continue
        if any(a.name == "kernel_shape" for a in node.attribute):
            continue
        dims = constant_dims(node.input[1], graph)
        if dims is not None and len(dims) >= 3:
            node.attribute.append(onnx.helper.make_attribute("kernel_shape", dims[2:]))
    return result
