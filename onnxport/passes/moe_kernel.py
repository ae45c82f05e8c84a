"""A mixture's experts in the layout ONNX Runtime's CPU kernels take.

The exporter writes a mixture of experts as ``com.microsoft.MoE`` with the model's own layout: the
gated SiLU's gate rows, then its up rows (``swiglu_fusion=2``). ONNX Runtime's CPU ``MoE`` takes
only the two interleaved (gate 0, up 0, gate 1, up 1, …: ``swiglu_fusion=1``), and it computes int4
experts without dequantizing them as ``QMoE``:

- :class:`MoEInterleavePass` interleaves a float ``MoE``'s constant gate/up weight (and bias);
- :class:`QMoEPass` writes a ``MoE`` whose two weights are int4, blocked, symmetric constant
  ``DequantizeLinear`` s as ``QMoE`` holding the same integers (interleaved, ``q + 8`` two to a byte,
  low nibble first, a row's blocks together) and scales, at ``accuracy_level``.
  :func:`unpacked_experts` reads one back as the ``DequantizeLinear`` it stands for.

Both keep the node's routing inputs and attributes; the sums are the same, in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from .._core.ir import (
    CONTRIB_DOMAIN,
    const_array,
    drop_unread_constants,
    graph_nodes,
    pack_nibbles,
    register_constant,
    unpack_nibbles,
)
from .matmul_nbits import blocked_int4

#: a packed weight's name: the dequantized weight's name and this suffix
PACKED_SUFFIX = ".qmoe"
#: where MoE reads its two weights (its biases follow each); QMoE reads each weight and its scales
_FC1, _FC2 = 2, 4
QMOE_WEIGHTS = {"fc1": (2, 3), "fc2": (5, 6)}


def interleave(rows: np.ndarray, axis: int = 1) -> np.ndarray:
    """[…, gate rows | up rows, …] along ``axis`` → […, gate 0, up 0, gate 1, up 1, …, …]."""
    moved = np.moveaxis(rows, axis, 0)
    half = moved.shape[0] // 2
    mixed = np.stack([moved[:half], moved[half:]], axis=1).reshape(moved.shape)
    return np.ascontiguousarray(np.moveaxis(mixed, 0, axis))


def deinterleave(rows: np.ndarray, axis: int = 1) -> np.ndarray:
    """The inverse of :func:`interleave`."""
    moved = np.moveaxis(rows, axis, 0)
    return np.ascontiguousarray(np.moveaxis(np.concatenate([moved[0::2], moved[1::2]]), 0, axis))


def _concatenated_moe(node: ir.Node) -> bool:
    return (node.op_type == "MoE" and node.domain == CONTRIB_DOMAIN and isinstance(node.graph, ir.Graph)
            and node.attributes.get_string("activation_type", "relu") == "swiglu"
            and node.attributes.get_int("swiglu_fusion", 0) == 2)


def _set_fusion(node: ir.Node) -> None:
    node.attributes["swiglu_fusion"] = ir.AttrInt64("swiglu_fusion", 1)


class MoEInterleavePass(ir.passes.InPlacePass):
    """Give each gated-SiLU ``MoE`` whose gate/up weight (and bias) are constants those constants
    interleaved, and say so (``swiglu_fusion=1``). The model's graph and its bodies."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(graph_nodes(model)):
            if not _concatenated_moe(node):
                continue
            graph: Any = node.graph
            weight, bias = node.inputs[_FC1], node.inputs[3] if len(node.inputs) > 3 else None
            arrays = [const_array(weight), None if bias is None else const_array(bias)]
            if arrays[0] is None or (bias is not None and arrays[1] is None):
                continue
            for index, (value, array) in enumerate(((weight, arrays[0]), (bias, arrays[1]))):
                if value is None or array is None:
                    continue
                mixed = register_constant(graph, f"{value.name}.interleaved", interleave(array))
                node.replace_input_with(_FC1 + index, mixed)
                drop_unread_constants([value])
            _set_fusion(node)
            modified = True
        return ir.passes.PassResult(model, modified)


def _int4_experts(value: ir.Value | None) -> tuple[np.ndarray, np.ndarray, int, ir.Node] | None:
    """(signed q [experts, out, in], scales [experts, out, in / block], block, the DequantizeLinear)
    of an int4 weight blocked along its input features, symmetric, that QMoE can hold; else None."""
    dq = value.producer() if value is not None else None
    if dq is None or len(list(value.uses())) != 1:
        return None
    found = blocked_int4(dq, 2)
    if found is None or found[0].ndim != 3 or not found[4]:
        return None
    q, scale, zp, block, _ = found
    if zp is not None and np.any(zp):
        return None  # QMoE's zero-points are unsigned; a symmetric weight's zero is its default (8)
    return q.astype(np.int8), scale, block, dq


class QMoEPass(ir.passes.InPlacePass):
    """Write each gated-SiLU ``MoE`` (gate and up concatenated) whose two weights are int4,
    blocked along their input features (one block size, a power of two from 16), symmetric
    constant ``DequantizeLinear`` s read by it alone, and without biases, as ``com.microsoft.QMoE``
    holding the same integers and scales at ``accuracy_level`` (4: int8 activations; 0: float).
    The model's graph and its bodies."""

    def __init__(self, accuracy_level: int = 4) -> None:
        super().__init__()
        self.accuracy_level = accuracy_level

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(graph_nodes(model)):
            if not _concatenated_moe(node) or any(len(node.inputs) > i and node.inputs[i] is not None for i in (3, 5)):
                continue
            found = [_int4_experts(node.inputs[i]) for i in (_FC1, _FC2)]
            if found[0] is None or found[1] is None or found[0][2] != found[1][2]:
                continue
            graph: Any = node.graph
            block = found[0][2]
            inputs: list[ir.Value | None] = [node.inputs[0], node.inputs[1]]
            for place, (q, scale, _, dq), mixed in zip((_FC1, _FC2), found, (True, False)):
                name = node.inputs[place].name
                if mixed:
                    q, scale = interleave(q), interleave(scale)
                experts, rows, width = q.shape
                packed = pack_nibbles((q.astype(np.int16) + 8).astype(np.uint8)).reshape(experts, rows, width // 2)
                inputs += [register_constant(graph, f"{name}{PACKED_SUFFIX}", packed),
                           register_constant(graph, f"{name}{PACKED_SUFFIX}_scales", scale), None]
            while inputs[-1] is None:
                inputs.pop()
            attributes = {a.name: a.value for a in node.attributes.values()}
            attributes.update({"swiglu_fusion": 1, "expert_weight_bits": 4, "block_size": block,
                               "accuracy_level": self.accuracy_level})
            fused = ir.node("QMoE", inputs, attributes, domain=CONTRIB_DOMAIN, name=node.name or None)
            dequantizers = [dq for *_, dq in found]
            dequantized = [v for dq in dequantizers for v in dq.inputs if v is not None]
            ir.convenience.replace_nodes_and_values(graph, node, [*dequantizers, node], [fused], [node.outputs[0]],
                                                    [fused.outputs[0]])
            drop_unread_constants(dequantized)
            modified = True
        return ir.passes.PassResult(model, modified)


def unpacked_experts(node: Any, packed: np.ndarray, scales: np.ndarray, gate_up: bool) -> dict[str, Any]:
    """One of a 4-bit QMoE's weights as the DequantizeLinear it stands for: signed int4 ``q``
    [experts, out, in], ``scale`` [experts, out, in / block] (a gate/up weight in the model's
    concatenated order), ``axis`` 2 and ``block_size``."""
    values = unpack_nibbles(packed).astype(np.int8) - 8
    if gate_up and node.attributes.get_int("swiglu_fusion", 0) == 1:
        values, scales = deinterleave(values), deinterleave(scales)
    return {"q": values, "scale": np.ascontiguousarray(scales), "zp": None, "axis": 2,
            "block_size": node.attributes.get_int("block_size", 0)}
