"""Clip a pooling window that exceeds its input to the input.

torch writes ``nn.AvgPool2d(k, ceil_mode=True)`` with ``k`` larger than the feature map (Hugging
Face's EfficientNet pools a 2×2 map with a 320-wide kernel) as an AveragePool whose kernel
exceeds its input. ONNX Runtime runs it, but the spec's output size for it is degenerate and
OpenVINO refuses the node. With no padding and a single output position per axis, the window is
clipped at the map's edge anyway: the same op with the map's size as kernel and stride, and no
``ceil_mode``, reads the same elements in the same order and divides by the same count.

A global pool would be the obvious spelling, but ONNX Runtime sums a GlobalAveragePool in
another order: a last-bit difference that a QuantizeLinear after it turns into a whole step
(the zoo's EfficientNet, under ``target='onnxruntime'``).
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import is_default, nodes

_POOLS = ("AveragePool", "MaxPool")


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else list(attr.as_ints())


def _oversized_window(node: ir.Node) -> list[int] | None:
    """The input's spatial size when ``node``'s single window spans (and exceeds) it."""
    x, y = node.inputs[0], node.outputs[0]
    if x is None or x.shape is None or y.shape is None or len(x.shape) < 3 or len(x.shape) != len(y.shape):
        return None
    dims, spatial_out = list(x.shape)[2:], list(y.shape)[2:]
    if not all(isinstance(d, int) for d in dims) or any(d != 1 for d in spatial_out):
        return None
    spatial_in = [int(d) for d in dims]
    kernel = _ints(node, "kernel_shape")
    pads = _ints(node, "pads") or [0] * (2 * len(spatial_in))
    dilations = _ints(node, "dilations") or [1] * len(spatial_in)
    auto_pad = node.attributes.get("auto_pad")
    if auto_pad is not None and auto_pad.as_string() not in ("NOTSET", ""):
        return None
    if (kernel is None or len(kernel) != len(spatial_in) or any(pads) or any(d != 1 for d in dilations)
            or not all(k >= d for k, d in zip(kernel, spatial_in)) or kernel == spatial_in):
        return None
    return spatial_in


class PoolWindowPass(ir.passes.InPlacePass):
    """Clip every AveragePool/MaxPool (in any body) whose single window exceeds its input."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in nodes(model):
            if node.op_type not in _POOLS or not is_default(node) or len(node.outputs) != 1:
                continue
            size = _oversized_window(node)
            if size is None:
                continue
            node.attributes["kernel_shape"] = ir.AttrInt64s("kernel_shape", size)
            node.attributes["strides"] = ir.AttrInt64s("strides", size)
            node.attributes["ceil_mode"] = ir.AttrInt64("ceil_mode", 0)
            modified = True
        return ir.passes.PassResult(model, modified)
