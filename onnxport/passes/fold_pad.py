"""Fold a zero ``Pad`` in front of a quantized Conv into the Conv's own ``pads``.

Model code that pads explicitly (TensorFlow-style "same" padding, as transformers' MobileNetV2
and EfficientNet write it) exports as ``DQ → Pad → Q → DQ → Conv``: the pad runs in float between
two pairs with the same parameters, and ONNX Runtime can fuse neither the pair nor the pad into
its QLinearConv. A Conv pads with zeros itself; the DequantizeLinear of a zero-point is exactly
zero, and re-quantizing a dequantized tensor with the same scale and zero-point gives back the
same integers, so ``DQ → Conv(pads + pad)`` computes the same tensor. A Pad of all zeros (the
stride-1 case of the same model code) is dropped the same way. A Pad that reads anything else (the
model's float input, in the same model code) moves behind the pair: a QuantizeLinear maps 0 to its
zero-point, which dequantizes to the Conv's own zero padding, so ``Q → DQ → Conv(pads + pad)`` is
exact too.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .._core.ir import const_array, is_default, nodes, only_reader


def _same_parameters(a: ir.Node, b: ir.Node) -> bool:
    """Two Q/DQ nodes with equal constant scale, zero-point, axis and block size."""
    for index in (1, 2):
        x = const_array(a.inputs[index]) if index < len(a.inputs) else None
        y = const_array(b.inputs[index]) if index < len(b.inputs) else None
        if x is None or y is None or x.dtype != y.dtype or not np.array_equal(x, y):
            return False
    return all(a.attributes.get(k) == b.attributes.get(k) for k in ("axis", "block_size"))


def _spatial_pads(pad: ir.Node, rank: int) -> list[int] | None:
    """The Pad's spatial begin/end amounts when it pads only spatial axes with constant zeros."""
    mode = pad.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return None
    found = const_array(pad.inputs[1]) if len(pad.inputs) > 1 else None
    fill = const_array(pad.inputs[2]) if len(pad.inputs) > 2 and pad.inputs[2] is not None else None
    if found is None or (fill is not None and np.any(fill != 0)) or (len(pad.inputs) > 3 and pad.inputs[3] is not None):
        return None
    amounts = [int(v) for v in found.reshape(-1)]
    if len(amounts) != 2 * rank or any(v < 0 for v in amounts):
        return None
    begins, ends = amounts[:rank], amounts[rank:]
    if begins[:2] != [0, 0] or ends[:2] != [0, 0]:
        return None
    return begins[2:] + ends[2:]


class FoldPadIntoConvPass(ir.passes.InPlacePass):
    """Fold every ``Pad(zeros) → Q → DQ → Conv`` into the Conv: ``DQ → Conv`` after a pair with the same
    parameters, ``Q → DQ → Conv`` after anything else."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for pad in list(nodes(model)):
            if pad.op_type != "Pad" or not is_default(pad) or pad.inputs[0] is None:
                continue
            q = only_reader(pad.outputs[0], "QuantizeLinear", 0)
            dq = q and only_reader(q.outputs[0], "DequantizeLinear", 0)
            conv = dq and only_reader(dq.outputs[0], "Conv", 0)
            if conv is None or not _same_parameters(q, dq):
                continue
            rank = len(pad.inputs[0].shape) if pad.inputs[0].shape is not None else None
            amounts = _spatial_pads(pad, rank) if rank else None
            auto_pad = conv.attributes.get("auto_pad")
            if amounts is None or (auto_pad is not None and auto_pad.as_string() not in ("NOTSET", "")):
                continue
            existing = conv.attributes.get("pads")
            current = list(existing.as_ints()) if existing is not None else [0] * len(amounts)
            conv.attributes["pads"] = ir.AttrInt64s("pads", [a + b for a, b in zip(current, amounts)])
            before = pad.inputs[0].producer()
            if before is not None and before.op_type == "DequantizeLinear" and is_default(before) \
                    and _same_parameters(before, q):
                conv.replace_input_with(0, before.outputs[0])  # the pair after the pad gave back these integers
            else:
                q.replace_input_with(0, pad.inputs[0])  # Q(0) is the zero-point: quantizing commutes with the pad
                q.outputs[0].shape = dq.outputs[0].shape = pad.inputs[0].shape  # the pair now holds the unpadded tensor
            modified = True
        if modified:
            RemoveUnusedNodesPass()(model)  # the Pads and the pairs after them
        return ir.passes.PassResult(model, modified)
