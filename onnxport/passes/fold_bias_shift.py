"""Fold a constant Add into the next constant Add downstream of it, through Adds and constant Muls.

``((y + b) + r) · g + β`` is ``(y + r) · g + (b · g + β)``: the bias ``b`` of a float-output linear
can ride on a later constant shift instead of costing a pass of its own. That is MobileBERT's
block: every bottleneck, attention-output and FFN-output linear feeds its NoNorm (an elementwise
``x · γ + β``), directly or through the residual Add. ONNX Runtime's static QDQ path runs such a
linear as ``MatMulIntegerToFloat`` without a bias input and its bias as an Add over the whole
output (the dynamic path's fused kernel takes the bias inside), so the file ran 31 bias Adds more
than ``quantize_dynamic``'s. Removed here, the constant is added once, where a constant is added
anyway.

The chain may pass only through default-domain Adds (of anything) and Muls by a constant, each
value on it read once and not a graph output; a QuantizeLinear, a GELU's two readers or a
normalisation ends it. The sums between move by ``b`` times the product of the Muls passed, so
each may round a last bit differently from the model's order: the exporter proves this step as a
last-bit step. Nothing is folded when the constant would widen a tensor's shape, or grow past the
larger of the two it replaces (a bias by head and one by window would make one by both).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import const_array, drop_unread_constants, graph_nodes, is_default, taken_names, unique_name


def _known(value: ir.Value | None) -> ir.Shape | None:
    """The value's shape when every dim is known, as a number or a name (a symbolic batch)."""
    shape = value.shape if value is not None else None
    if shape is None or any(d is None or (not isinstance(d, int) and d.value is None) for d in shape):
        return None
    return shape


def _broadcasts_into(small: tuple[int, ...], shape: ir.Shape) -> bool:
    """Whether a constant of shape ``small`` broadcast with ``shape`` leaves ``shape`` as it is
    (a named dim takes only a 1)."""
    dims = list(shape)
    return len(small) <= len(dims) and all(s == 1 or (isinstance(d, int) and s == d)
                                           for s, d in zip(reversed(small), reversed(dims)))


def _constant_addend(add: ir.Node) -> tuple[ir.Value, int, np.ndarray] | None:
    """(the computed input, the constant's input index, the constant) of ``x + constant``."""
    if add.op_type != "Add" or not is_default(add) or len(add.inputs) != 2:
        return None
    for index in (0, 1):
        constant, computed = const_array(add.inputs[index]), add.inputs[1 - index]
        if constant is not None and computed is not None and const_array(computed) is None \
                and np.issubdtype(constant.dtype, np.floating):
            return computed, index, constant
    return None


def _downstream_shift(start: ir.Value, graph: ir.Graph) -> tuple[ir.Node, int, np.ndarray, np.ndarray] | None:
    """(the constant Add the chain from ``start`` ends at, its constant's index, that constant, the
    product of the Muls' constants passed on the way) or None when the chain ends anywhere else
    (or leaves ``graph``: the folded constant is registered there)."""
    scale = np.ones((), dtype=np.float64)
    value = start
    while True:
        uses = list(value.uses())
        if len(uses) != 1 or value.is_graph_output():
            return None
        node, index = uses[0]
        if node.graph is not graph or not is_default(node) or len(node.inputs) != 2 or node.inputs[0] is node.inputs[1]:
            return None
        other = const_array(node.inputs[1 - index])
        if node.op_type == "Add" and other is not None:
            return node, 1 - index, other, scale
        if node.op_type == "Add":
            value = node.outputs[0]
            continue
        if node.op_type == "Mul" and other is not None and np.issubdtype(other.dtype, np.floating):
            scale = scale * other.astype(np.float64)
            value = node.outputs[0]
            continue
        return None


class FoldBiasIntoShiftPass(ir.passes.InPlacePass):
    """Remove each ``x + b`` (``b`` constant) whose sum reaches another constant Add only through
    Adds and constant Muls, adding ``b`` times those Muls' constants to that Add's constant."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        taken: set[str] | None = None
        for add in list(graph_nodes(model)):  # it adds initializers, which a function cannot hold
            graph = add.graph
            if not isinstance(graph, ir.Graph):  # removed by an earlier fold
                continue
            found = _constant_addend(add)
            shape = _known(add.outputs[0])
            if found is None or shape is None:
                continue
            computed, index, bias = found
            if _known(computed) != shape:  # the bias must not be what gives the sum its shape
                continue
            chain = _downstream_shift(add.outputs[0], graph)
            if chain is None:
                continue
            target, target_index, shift, scale = chain
            target_shape = _known(target.outputs[0])
            folded = (shift.astype(np.float64) + bias.astype(np.float64) * scale).astype(shift.dtype)
            if target_shape is None or not _broadcasts_into(folded.shape, target_shape) \
                    or folded.size > max(shift.size, bias.size):  # a file holds no constant larger than before
                continue
            taken = taken if taken is not None else taken_names(model)
            old = target.inputs[target_index]
            name = unique_name(f"{old.name or 'shift'}.folded", taken)
            value = ir.Value(name=name, shape=ir.Shape(folded.shape), type=ir.TensorType(ir.DataType.from_numpy(folded.dtype)),
                             const_value=ir.tensor(folded, name=name))
            graph.register_initializer(value)
            target.replace_input_with(target_index, value)
            ir.convenience.replace_all_uses_with(add.outputs[0], computed)
            constant = add.inputs[index]
            graph.remove(add, safe=True)
            drop_unread_constants([constant, old])
            modified = True
        return ir.passes.PassResult(model, modified)
