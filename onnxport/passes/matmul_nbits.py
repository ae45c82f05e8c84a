"""Write each int4 ``DequantizeLinear → MatMul`` as ONNX Runtime's ``com.microsoft.MatMulNBits``.

ONNX Runtime fuses the pair itself when it loads a file, but it keeps the file's int4 tensors and
the fused node's repacked copies both in memory (on a stack of int4 MatMuls the process held 0.67x
the int4 bytes more than with the same weights written as MatMulNBits), and its QDQ selectors miss
some pairs (:mod:`onnxport.passes.relu_as_max`). Written here, the node holds the very integers,
scales and zero-points: ``q + 8`` as unsigned 4-bit values, two to a byte, low nibble first, a
block's values together per output column; the default zero-point (8) stands for a symmetric
weight's zero. :func:`unpacked` reads one back as the ``DequantizeLinear`` layout it came from.
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
    is_default,
    pack_nibbles,
    register_constant,
    unpack_nibbles,
)

#: the packed weight's name: the dequantized weight's name and this suffix
PACKED_SUFFIX = ".nbits"
_INT4 = (ir.DataType.INT4, ir.DataType.UINT4)


def blocked_int4(dq: ir.Node, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, bool] | None:
    """(q, scales, zero-points or None, block, signed) of a constant int4 ``DequantizeLinear`` blocked
    along ``axis`` (of a 2-D weight: 0; of experts' 3-D one: 2) by a power of two from 16, with
    float32 scales shaped as its blocks; else None."""
    if dq.op_type != "DequantizeLinear" or not is_default(dq) or len(dq.inputs) < 2:
        return None
    q_value = dq.inputs[0]
    if q_value is None or q_value.const_value is None or q_value.const_value.dtype not in _INT4:
        return None
    q, scale = const_array(q_value), const_array(dq.inputs[1])
    zp = const_array(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] is not None else None
    block = dq.attributes.get_int("block_size", 0)
    if q is None or scale is None or scale.dtype != np.float32 or axis >= q.ndim:
        return None
    if dq.attributes.get_int("axis", 1) % q.ndim != axis:
        return None
    blocks = list(q.shape)
    blocks[axis] //= max(block, 1)
    if block < 16 or block & (block - 1) or q.shape[axis] % block or scale.shape != tuple(blocks):
        return None
    return q, scale, zp, block, q_value.const_value.dtype == ir.DataType.INT4


def _matmul_nbits_of(dq: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int] | None:
    """(q as unsigned [K, N], scales [K/block, N], unsigned zero-points or None, block) of an int4
    blocked DequantizeLinear MatMulNBits can hold, else None."""
    found = blocked_int4(dq, 0)
    if found is None or found[0].ndim != 2:
        return None
    q, scale, zp, block, signed = found
    shift = 8 if signed else 0  # MatMulNBits holds unsigned values
    if zp is None:
        # a signed weight's zero is MatMulNBits' default zero-point (8); an unsigned one's is 0
        unsigned_zp = None if signed else np.zeros(scale.shape, np.int16)
    elif zp.shape != scale.shape:
        return None
    else:
        unsigned_zp = zp.astype(np.int16) + shift
        if (unsigned_zp == 8).all():
            unsigned_zp = None
    return (q.astype(np.int16) + shift).astype(np.uint8), scale, unsigned_zp, block


class MatMulNBitsPass(ir.passes.InPlacePass):
    """Replace each MatMul whose weight is an int4, blocked (a power of two from 16), constant
    ``DequantizeLinear`` read by that MatMul alone with ``com.microsoft.MatMulNBits`` holding the same
    integers, scales and zero-points, at ``accuracy_level`` (4: int8 activations, what ONNX Runtime
    gives the pair it fuses itself by default; 0: float activations). The graph and its bodies;
    functions, which hold no initializers, are left as they are."""

    def __init__(self, accuracy_level: int = 4) -> None:
        super().__init__()
        self.accuracy_level = accuracy_level

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        # the model's graph and its bodies, not functions: the packed weights are initializers
        for matmul in list(graph_nodes(model)):
            graph = matmul.graph
            if matmul.op_type != "MatMul" or not is_default(matmul) or not isinstance(graph, ir.Graph):
                continue
            weight = matmul.inputs[1]
            dq = weight.producer() if weight is not None else None
            if dq is None or len(list(weight.uses())) != 1 or weight.is_graph_output():
                continue
            found = _matmul_nbits_of(dq)
            if found is None:
                continue
            q, scale, zp, block = found
            k, n = q.shape
            blocks = k // block
            name = weight.name or f"{matmul.name}.weight"
            inputs = [matmul.inputs[0],
                      # each column's blocks together, each block's values two to a byte
                      register_constant(graph, name + PACKED_SUFFIX, pack_nibbles(q.T).reshape(n, blocks, block // 2)),
                      register_constant(graph, name + PACKED_SUFFIX + "_scales", np.ascontiguousarray(scale.T).reshape(-1))]
            if zp is not None:
                padded = np.pad(zp.T, ((0, 0), (0, blocks % 2)), constant_values=8)
                inputs.append(register_constant(graph, name + PACKED_SUFFIX + "_zero_points", pack_nibbles(padded)))
            fused = ir.node("MatMulNBits", inputs, {"K": k, "N": n, "bits": 4, "block_size": block,
                                                    "accuracy_level": self.accuracy_level},
                            domain=CONTRIB_DOMAIN, name=matmul.name or None)
            dequantized = [v for v in dq.inputs if v is not None]  # the removal below detaches them
            ir.convenience.replace_nodes_and_values(graph, matmul, [dq, matmul], [fused], [matmul.outputs[0]],
                                                    [fused.outputs[0]])
            drop_unread_constants(dequantized)
            modified = True
        if modified and CONTRIB_DOMAIN not in model.opset_imports:
            model.opset_imports[CONTRIB_DOMAIN] = 1
        return ir.passes.PassResult(model, modified)


def unpacked(node: Any, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None) -> dict[str, Any]:
    """A 4-bit MatMulNBits' weight as the DequantizeLinear it stands for: signed int4 ``q`` [K, N],
    ``scale`` [K/block, N], signed ``zp`` (None when the node has none: 8, a signed zero),
    ``axis`` 0 and ``block_size``."""
    k, n, block = (node.attributes.get_int(key, 0) for key in ("K", "N", "block_size"))
    blocks = k // block
    q = unpack_nibbles(b.reshape(n, blocks, block // 2), block).reshape(n, k).T.astype(np.int8) - 8
    zp = None
    if zero_points is not None:
        zp = (unpack_nibbles(zero_points.reshape(n, -1), blocks).T.astype(np.int8) - 8)
    return {"q": q, "scale": scales.reshape(n, blocks).T.copy(), "zp": zp, "axis": 0, "block_size": block}
