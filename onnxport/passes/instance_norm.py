"""Write an InstanceNormalization without scale and shift as the LayerNormalization it is.

torch.onnx writes ``GroupNorm(G, C)`` as Reshape to ``[N, G, -1]``, an InstanceNormalization with
scale 1 and shift 0, Reshape back, Mul and Add (``InstanceNorm`` without ``affine`` is the same
InstanceNormalization). ONNX Runtime's CPU InstanceNormalization sums its mean and variance in
float32 over the whole group, so its rounding error grows with the group's size: PoolFormer-v2's
``GroupNorm(1, 64)`` over 64×56×56 = 200,704 elements came out 28 times as far from a float64 run
as torch's own float32 group norm (ONNX Runtime 1.32, AMD EPYC), and the whole model's logits
4–7 times (sometimes past the float proof's bound of 8). Its LayerNormalization kernel
accumulates the statistics in double: the same normalization, over the same axes (every axis from
2 on), came out at 0.5 times torch's distance. Both are standard ONNX; LayerNormalization needs
opset 17, so a file of an older opset is left as it is. The scale and shift become one-element
tensors, which LayerNormalization broadcasts (unidirectionally, as its definition allows).

The normalization is the same; its rounding is not, so the step's proof is the checker's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import const_array, drop_unread_constants, graph_nodes, is_default, opset_of, taken_names, unique_name

#: LayerNormalization's first opset.
LAYER_NORM_OPSET = 17
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _is_identity(value: ir.Value | None, expected: float) -> bool:
    values = const_array(value)
    return values is not None and values.size > 0 and bool(np.all(values == expected))


def _plain(node: ir.Node) -> bool:
    """An InstanceNormalization of a float tensor with scale 1 and shift 0, its inputs constants."""
    if node.op_type != "InstanceNormalization" or not is_default(node) or len(node.inputs) != 3:
        return False
    x, scale, shift = node.inputs
    if x is None or _dtype(node) not in FLOAT_TYPES:
        return False
    return _is_identity(scale, 1.0) and _is_identity(shift, 0.0)


def _dtype(node: ir.Node) -> ir.DataType | None:
    """The input's type, or its scale's (the same type ``T`` by the operator's definition) where a
    value carries no type (a body without inferred types)."""
    x, scale = node.inputs[0], node.inputs[1]
    if x is not None and x.dtype is not None:
        return x.dtype
    tensor = ir.convenience.get_const_tensor(scale) if scale is not None else None
    return tensor.dtype if tensor is not None else None


class InstanceNormAsLayerNormPass(ir.passes.InPlacePass):
    """Replace every InstanceNormalization with scale 1 and shift 0 (in the main graph and its
    If/Loop/Scan bodies) by a LayerNormalization over axes 2 on, with the same epsilon; nothing
    in a model below opset 17."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if opset_of(model) < LAYER_NORM_OPSET:
            return ir.passes.PassResult(model, False)
        modified = False
        taken: set[str] | None = None
        # one scale and one shift per dtype, in the main graph: every body sees them
        identities: dict[ir.DataType, tuple[ir.Value, ir.Value]] = {}
        for node in list(graph_nodes(model)):
            if not _plain(node) or node.graph is None:
                continue
            x, scale, shift = node.inputs
            dtype = _dtype(node)
            assert x is not None and dtype is not None
            if dtype not in identities:
                taken = taken if taken is not None else taken_names(model)
                pair = []
                for role, fill in (("scale", 1.0), ("shift", 0.0)):
                    name = unique_name(f"layer_norm_{role}_{dtype.name.lower()}", taken)
                    taken.add(name)
                    tensor = ir.tensor(np.full(1, fill, dtype=dtype.numpy()), name=name)
                    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(dtype), const_value=tensor)
                    model.graph.register_initializer(value)
                    pair.append(value)
                identities[dtype] = (pair[0], pair[1])
            one, zero = identities[dtype]
            epsilon = node.attributes.get("epsilon")
            norm = ir.node("LayerNormalization", inputs=[x, one, zero], name=node.name,
                           attributes={"axis": 2, "epsilon": epsilon.as_float() if epsilon is not None else 1e-5})
            # the layer norm's output takes the instance norm's place (its name, shape and every reader)
            ir.convenience.replace_nodes_and_values(node.graph, node, [node], [norm], [node.outputs[0]],
                                                    [norm.outputs[0]])
            drop_unread_constants([scale, shift])
            modified = True
        return ir.passes.PassResult(model, modified)

    def ensures(self, model: ir.Model) -> None:
        if opset_of(model) < LAYER_NORM_OPSET:
            return
        left = [node.name for node in graph_nodes(model) if _plain(node)]
        if left:
            raise ir.passes.PostconditionError(f"InstanceNormalization nodes with scale 1 and shift 0 left: {left[:5]}")
