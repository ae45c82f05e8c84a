"""Write a mean over every spatial axis as the ``GlobalAveragePool`` it is.

torch writes ``x.mean((2, 3), keepdim=True)`` (squeeze-excite blocks: EfficientNet, RegNetY,
MobileNetV3) and ``AdaptiveAvgPool2d(1)`` in some exporters as ``ReduceMean`` over the spatial
axes. Between a DequantizeLinear and a QuantizeLinear, ONNX Runtime fuses a GlobalAveragePool
into its integer ``QLinearGlobalAveragePool`` but leaves a ReduceMean in float with the pair
around it; on the zoo RegNetY-800MF that pair and mean were a fifth of the file's time. Both ops
average the same elements over the same axes (every axis after the channel axis, kept as size 1);
they may sum in another order, so a last bit can move and the step is proven by the checker after
every identical-outputs step.

Only a mean that reads a DequantizeLinear is rewritten: a float mean gains nothing, and a
ReduceMean is what ORT's norm fusions look for (an RMSNorm's mean of squares over the last axis of
a rank-3 tensor is "every axis after the channels" too).
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import const_array, drop_unread_constants, is_default, nodes


def _axes(node: ir.Node) -> list[int] | None:
    """The reduced axes, from the opset-18 input or the older attribute; None when unknown."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        values = const_array(node.inputs[1])
        return None if values is None else [int(v) for v in values.reshape(-1)]
    attr = node.attributes.get("axes")
    return None if attr is None else list(attr.as_ints())


def _is_spatial_mean(node: ir.Node) -> bool:
    x = node.inputs[0] if node.inputs else None
    if x is None or (reads := x.producer()) is None or reads.op_type != "DequantizeLinear" or not is_default(reads):
        # only between pairs does ORT gain (QLinearGlobalAveragePool); a float mean of a rank-3
        # tensor is a norm's statistic (Llama's RMSNorm), which ORT fuses only as a ReduceMean
        return False
    if x.shape is None or len(x.shape) < 3 or x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16,
                                                                            ir.DataType.DOUBLE, ir.DataType.BFLOAT16):
        return False
    keepdims = node.attributes.get("keepdims")
    if keepdims is not None and keepdims.as_int() != 1:
        return False
    axes = _axes(node)
    rank = len(x.shape)
    if not axes or any(not -rank <= a < rank for a in axes):
        return False
    return sorted(a % rank for a in axes) == list(range(2, rank))


class SpatialMeanToGlobalPoolPass(ir.passes.InPlacePass):
    """Replace every ReduceMean over all spatial axes (keepdims, in any body) by a GlobalAveragePool."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(nodes(model)):
            if node.op_type != "ReduceMean" or not is_default(node) or len(node.outputs) != 1:
                continue
            if not _is_spatial_mean(node):
                continue
            pool = ir.node("GlobalAveragePool", inputs=[node.inputs[0]], name=node.name)
            axes = node.inputs[1] if len(node.inputs) > 1 else None
            # the pool's output takes the mean's place (its name, shape and every reader)
            ir.convenience.replace_nodes_and_values(
                node.graph, node, [node], [pool], [node.outputs[0]], [pool.outputs[0]]
            )
            drop_unread_constants([axes] if axes is not None else [])
            modified = True
        return ir.passes.PassResult(model, modified)
