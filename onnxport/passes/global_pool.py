"""Write a pooling whose one window covers its whole input as the global pooling it is.

torch writes ``nn.AvgPool2d(k, ceil_mode=True)`` with ``k`` larger than the feature map (Hugging
Face's EfficientNet pools a 2×2 map with a 320-wide kernel) as an AveragePool whose kernel
exceeds its input. ONNX Runtime runs it, but the spec's output size for it is degenerate and
OpenVINO refuses the node. With no padding and a single output position per axis, the window
is the whole map: GlobalAveragePool / GlobalMaxPool compute the same values.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ._ir import is_default, nodes, on_proto

_GLOBAL = {"AveragePool": "GlobalAveragePool", "MaxPool": "GlobalMaxPool"}


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else list(attr.as_ints())


def _covers_whole_input(node: ir.Node) -> bool:
    x, y = node.inputs[0], node.outputs[0]
    if x is None or x.shape is None or y.shape is None or len(x.shape) < 3 or len(x.shape) != len(y.shape):
        return False
    spatial_in, spatial_out = list(x.shape)[2:], list(y.shape)[2:]
    if not all(isinstance(d, int) for d in spatial_in) or any(d != 1 for d in spatial_out):
        return False
    kernel = _ints(node, "kernel_shape")
    pads = _ints(node, "pads") or [0] * (2 * len(spatial_in))
    dilations = _ints(node, "dilations") or [1] * len(spatial_in)
    auto_pad = node.attributes.get("auto_pad")
    if auto_pad is not None and auto_pad.as_string() not in ("NOTSET", ""):
        return False
    return (kernel is not None and len(kernel) == len(spatial_in) and not any(pads)
            and all(d == 1 for d in dilations) and all(k >= d for k, d in zip(kernel, spatial_in)))


class GlobalPoolPass(ir.passes.InPlacePass):
    """Replace every AveragePool/MaxPool (in any body) whose single window spans its whole input."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(nodes(model)):
            if node.op_type not in _GLOBAL or not is_default(node) or len(node.outputs) != 1:
                continue
            if not _covers_whole_input(node):
                continue
            pooled = ir.node(_GLOBAL[node.op_type], [node.inputs[0]], name=node.name)
            node.graph.insert_before(node, pooled)
            out = node.outputs[0]
            pooled.outputs[0].shape, pooled.outputs[0].type = out.shape, out.type
            ir.convenience.replace_all_uses_with(out, pooled.outputs[0], replace_graph_outputs=True)
            pooled.outputs[0].name, out.name = out.name, f"{out.name}__windowed"
            node.graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)


def global_pools(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` with :class:`GlobalPoolPass` applied (idempotent)."""
    return on_proto(GlobalPoolPass(), model)
