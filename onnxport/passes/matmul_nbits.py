"""Write a blocked int4/int8 weight's ``DequantizeLinear → MatMul`` as ONNX Runtime's ``MatMulNBits``.

ONNX Runtime fuses this pair into com.microsoft ``MatMulNBits`` when it loads a file (its
DQMatMulToMatMulNBits transformer, at accuracy level 4 unless the session says otherwise). For a
file meant for ONNX Runtime's CPU the pass writes that operator in the file itself, as
onnxruntime-genai's builder does, so the file holds what runs. The integers are the same: the
signed values are stored offset by 2^(bits-1) (MatMulNBits' default zero point, so a symmetric
weight needs none), column by column, blocks along the input features, two int4 values to a byte
with the first in the low nibble; scales are ``[N · blocks]``. Left as they are: per-channel
weights (no ``block_size``), blocks that are not a power of two from 16 or do not divide the
input features, and weights read by anything but a MatMul's second input.
:func:`unpacked` reads such a node's integers back, for the checks of the written file.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._ir import const_tensor, graphs, is_default, read_values

CONTRIB_DOMAIN = "com.microsoft"
_BITS = {ir.DataType.INT4: 4, ir.DataType.INT8: 8}


def _packed(q: np.ndarray, bits: int, block: int) -> np.ndarray:
    """``q`` ``[K, N]`` signed integers as MatMulNBits' ``B``: ``[N, K / block, block · bits / 8]`` uint8."""
    k, n = q.shape
    stored = (q.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).T.reshape(n, k // block, block)
    if bits == 8:
        return np.ascontiguousarray(stored)
    return np.ascontiguousarray((stored[..., 0::2] & 0x0F) | (stored[..., 1::2] << 4))


def _packed_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """``zp`` ``[blocks, N]`` signed as MatMulNBits' zero points: per column, offset, packed
    (int4: two to a byte, a column's last byte padded)."""
    stored = (zp.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).T  # [N, blocks]
    if bits == 8:
        return np.ascontiguousarray(stored.reshape(-1))
    if stored.shape[1] % 2:
        stored = np.concatenate([stored, np.full((stored.shape[0], 1), 1 << (bits - 1), np.uint8)], axis=1)
    return np.ascontiguousarray(((stored[:, 0::2] & 0x0F) | (stored[:, 1::2] << 4)).reshape(-1))


def unpacked(node: ir.Node) -> dict | None:
    """A ``MatMulNBits`` node's integers ``[K, N]`` (int8 values), scales ``[blocks, N]`` and zero
    points (``None`` when it has none), as the ``DequantizeLinear`` it replaced held them; None
    when its inputs are not constants."""
    k, n = node.attributes.get_int("K"), node.attributes.get_int("N")
    bits, block = node.attributes.get_int("bits", 4), node.attributes.get_int("block_size")
    tensors = [const_tensor(v) if v is not None else None for v in node.inputs[1:4]]
    if tensors[0] is None or tensors[1] is None:
        return None
    stored = read_values(tensors[0]).reshape(n, k // block, -1)
    if bits == 4:
        stored = np.stack([stored & 0x0F, stored >> 4], axis=-1).reshape(n, k // block, block)
    offset = 1 << (bits - 1)
    q = (stored.reshape(n, k).astype(np.int16) - offset).astype(np.int8).T
    scale = read_values(tensors[1]).reshape(n, k // block).T
    zp = None
    if len(tensors) > 2 and tensors[2] is not None:
        raw = read_values(tensors[2]).reshape(n, -1)
        if bits == 4:
            raw = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, -1)
        zp = (raw[:, : k // block].astype(np.int16) - offset).astype(np.int8).T
    return {"q": np.ascontiguousarray(q), "scale": np.ascontiguousarray(scale), "zp": zp, "block_size": block,
            "bits": bits}


class MatMulNBitsPass(ir.passes.InPlacePass):
    """Rewrite each blocked int4/int8 ``DequantizeLinear`` read only by MatMuls (as their weight)
    into one com.microsoft ``MatMulNBits`` per MatMul (see the module's text); ``rewritten``
    counts the weights. ``accuracy_level`` is MatMulNBits' (4: int8 activations, what ONNX
    Runtime's own fusion picks; 0: float)."""

    def __init__(self, accuracy_level: int = 4) -> None:
        super().__init__()
        self.accuracy_level = accuracy_level
        self.rewritten = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten = 0
        for graph in graphs(model):
            for dq in [n for n in graph if n.op_type == "DequantizeLinear" and is_default(n)]:
                if self._rewrite(graph, dq):
                    self.rewritten += 1
        if self.rewritten:
            model.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
        return ir.passes.PassResult(model, modified=self.rewritten > 0)

    def _rewrite(self, graph: ir.Graph, dq: ir.Node) -> bool:
        integers, scale = (const_tensor(v) if v is not None else None for v in dq.inputs[:2])
        zero_point = const_tensor(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] is not None else None
        if integers is None or scale is None or integers.dtype not in _BITS or len(integers.shape) != 2:
            return False
        if len(dq.inputs) > 2 and dq.inputs[2] is not None and zero_point is None:
            return False
        k, n = integers.shape
        block = dq.attributes.get_int("block_size", 0)
        if dq.attributes.get_int("axis", 1) not in (0, -2) or block < 16 or block & (block - 1) or k % block:
            return False
        if scale.dtype != ir.DataType.FLOAT or tuple(scale.shape) != (k // block, n):
            return False
        uses = list(dq.outputs[0].uses())
        if not uses or dq.outputs[0].is_graph_output() or any(
                u.node.op_type != "MatMul" or not is_default(u.node) or u.idx != 1 for u in uses):
            return False
        if any(u.node.inputs[0] is None or u.node.inputs[0].dtype != ir.DataType.FLOAT for u in uses):
            return False
        bits = _BITS[integers.dtype]
        name = dq.outputs[0].name
        packed = ir.Value(name=name, const_value=ir.tensor(_packed(read_values(integers), bits, block), name=name))
        scales = ir.Value(name=f"{name}.scales", const_value=ir.tensor(
            np.ascontiguousarray(read_values(scale).T.reshape(-1)), name=f"{name}.scales"))
        inputs = [packed, scales]
        if zero_point is not None:
            zp_name = f"{name}.zero_points"
            inputs.append(ir.Value(name=zp_name, const_value=ir.tensor(
                _packed_zero_points(read_values(zero_point), bits), name=zp_name)))
        dq.outputs[0].name = None  # the packed weight takes the dequantized weight's name
        for value in inputs:
            graph.register_initializer(value)
        for use in uses:
            matmul = use.node
            fused = ir.node("MatMulNBits", inputs=[matmul.inputs[0], *inputs], domain=CONTRIB_DOMAIN,
                            attributes={"K": k, "N": n, "bits": bits, "block_size": block,
                                        "accuracy_level": self.accuracy_level},
                            name=matmul.name or None)
            ir.convenience.replace_nodes_and_values(graph, matmul, [matmul], [fused], [matmul.outputs[0]], [fused.outputs[0]])
        graph.remove(dq, safe=True)
        for value in dq.inputs:
            if value is not None and value.is_initializer() and not value.uses():
                graph.initializers.pop(value.name)
        return True
