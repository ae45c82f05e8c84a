"""Write a group norm's normalization as the LayerNormalization it is.

Below opset 21 torch.onnx writes ``GroupNorm(G, C)`` as Reshape to ``[N, G, -1]``, an
InstanceNormalization with scale 1 and shift 0, Reshape back, Mul and Add (``InstanceNorm``
without ``affine`` is the same InstanceNormalization); from opset 21, as one GroupNormalization.
ONNX Runtime's CPU computes both with float32 sums over the whole group, so their rounding error
grows with the group's size: on PoolFormer-v2's ``GroupNorm(1, 64)`` over 64×56×56 = 200,704
values, 28 times (InstanceNormalization) and 9.5 times (GroupNormalization) as far from a float64
run as torch's own float32 group norm (ONNX Runtime 1.32, AMD EPYC), and the whole model's logits
4–7 times (sometimes past the float proof's bound of 8). Its LayerNormalization kernel accumulates
the statistics in double: the same normalization over the same values came out at 0.5–0.9 times
torch's distance. Every form is standard ONNX; LayerNormalization needs opset 17, so an older file
is left as it is. Its scale and shift become one-element tensors, which LayerNormalization
broadcasts (unidirectionally, as its definition allows); a GroupNormalization's own per-channel
scale and shift follow as the Mul and Add torch.onnx writes below opset 21.

The normalization is the same; its rounding is not, so the step's proof is the checker's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import const_array, drop_unread_constants, graph_nodes, is_default, opset_of, taken_names, unique_name

#: LayerNormalization's first opset.
LAYER_NORM_OPSET = 17
#: The fewest values per group rewritten. ONNX Runtime's LayerNormalization takes about 2.5 times
#: InstanceNormalization's time (single thread, EPYC AVX2), and InstanceNormalization's error grows
#: with the group (relative to float64: 8.6e-8 at 3,200 values, 2.1e-7 at 25k, 1.1e-6 at 200k, against
#: LayerNormalization's 2.5e-8): below this it stays within a few times torch's own rounding, which
#: the float proof allows, and a wav2vec2's per-channel GroupNorm keeps its speed. A group of
#: unknown size (a symbolic axis) is rewritten.
MIN_GROUP = 1 << 16
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _is_identity(value: ir.Value | None, expected: float) -> bool:
    values = const_array(value)
    return values is not None and values.size > 0 and bool(np.all(values == expected))


def _dtype(node: ir.Node) -> ir.DataType | None:
    """The input's type, or its scale's (the same type ``T`` by the operator's definition) where a
    value carries no type (a body without inferred types)."""
    x, scale = node.inputs[0], node.inputs[1]
    if x is not None and x.dtype is not None:
        return x.dtype
    tensor = ir.convenience.get_const_tensor(scale) if scale is not None else None
    return tensor.dtype if tensor is not None else None


def _small(dims: list | None) -> bool:
    """Whether ``dims`` (the values of one group) are all known and hold fewer than MIN_GROUP."""
    if dims is None or not all(isinstance(d, int) for d in dims):
        return False
    return int(np.prod(dims, dtype=np.int64)) < MIN_GROUP


def _plain_instance_norm(node: ir.Node) -> bool:
    """An InstanceNormalization of a float tensor with scale 1 and shift 0, its inputs constants,
    over MIN_GROUP values or more (or an unknown number)."""
    if node.op_type != "InstanceNormalization" or not is_default(node) or len(node.inputs) != 3:
        return False
    x, scale, shift = node.inputs
    if x is None or _dtype(node) not in FLOAT_TYPES:
        return False
    if _small(list(x.shape.dims[2:]) if x.shape is not None else None):
        return False
    return _is_identity(scale, 1.0) and _is_identity(shift, 0.0)


def _group_norm(node: ir.Node, opset: int) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(its input's rank, scale, shift) of an opset-21 GroupNormalization of a float tensor of
    known rank with constant per-channel scale and shift; None for anything else (opset 18's
    per-group form, since deprecated, included)."""
    if node.op_type != "GroupNormalization" or not is_default(node) or len(node.inputs) != 3:
        return None
    if (node.version if node.version is not None else opset) < 21:
        return None
    x, scale, shift = node.inputs
    if x is None or _dtype(node) not in FLOAT_TYPES or x.shape is None or len(x.shape) < 3:
        return None
    stash = node.attributes.get("stash_type")
    if stash is not None and stash.as_int() != ir.DataType.FLOAT:
        return None
    scale_values, shift_values = const_array(scale), const_array(shift)
    if scale_values is None or shift_values is None or scale_values.ndim != 1 or shift_values.shape != scale_values.shape:
        return None
    channels, groups = x.shape.dims[1], node.attributes["num_groups"].as_int()
    if isinstance(channels, int) and groups > 0 and _small([channels // groups, *x.shape.dims[2:]]):
        return None
    return len(x.shape), scale_values, shift_values


class GroupNormAsLayerNormPass(ir.passes.InPlacePass):
    """Replace every InstanceNormalization with scale 1 and shift 0, and every opset-21
    GroupNormalization with constant scale and shift (in the main graph and its If/Loop/Scan
    bodies), whose groups hold :data:`MIN_GROUP` values or more (or an unknown number), by a
    LayerNormalization over the same values with the same epsilon; nothing in a model below
    opset 17."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = opset_of(model)
        if opset < LAYER_NORM_OPSET:
            return ir.passes.PassResult(model, False)
        self._taken: set[str] | None = None
        # one scale and one shift per dtype, in the main graph: every body sees them
        self._identities: dict[ir.DataType, tuple[ir.Value, ir.Value]] = {}
        modified = False
        for node in list(graph_nodes(model)):
            if node.graph is None:
                continue
            if _plain_instance_norm(node):
                self._instance_norm(model, node)
                modified = True
            elif (found := _group_norm(node, opset)) is not None:
                self._group_norm(model, node, *found)
                modified = True
        return ir.passes.PassResult(model, modified)

    def _name(self, model: ir.Model, base: str) -> str:
        self._taken = self._taken if self._taken is not None else taken_names(model)
        return unique_name(base, self._taken)

    def _constant(self, model: ir.Model, graph: ir.Graph, base: str, array: np.ndarray) -> ir.Value:
        name = self._name(model, base)
        tensor = ir.tensor(array, name=name)
        value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
        graph.register_initializer(value)
        return value

    def _identity(self, model: ir.Model, dtype: ir.DataType) -> tuple[ir.Value, ir.Value]:
        if dtype not in self._identities:
            one = self._constant(model, model.graph, f"layer_norm_scale_{dtype.name.lower()}",
                                 np.ones(1, dtype=dtype.numpy()))
            zero = self._constant(model, model.graph, f"layer_norm_shift_{dtype.name.lower()}",
                                  np.zeros(1, dtype=dtype.numpy()))
            self._identities[dtype] = (one, zero)
        return self._identities[dtype]

    @staticmethod
    def _epsilon(node: ir.Node) -> float:
        epsilon = node.attributes.get("epsilon")
        return epsilon.as_float() if epsilon is not None else 1e-5

    def _instance_norm(self, model: ir.Model, node: ir.Node) -> None:
        x, scale, shift = node.inputs
        dtype = _dtype(node)
        assert x is not None and dtype is not None
        one, zero = self._identity(model, dtype)
        norm = ir.node("LayerNormalization", inputs=[x, one, zero], name=node.name,
                       attributes={"axis": 2, "epsilon": self._epsilon(node)})
        # the layer norm's output takes the instance norm's place (its name, shape and every reader)
        ir.convenience.replace_nodes_and_values(node.graph, node, [node], [norm], [node.outputs[0]],
                                                [norm.outputs[0]])
        drop_unread_constants([scale, shift])

    def _group_norm(self, model: ir.Model, node: ir.Node, rank: int, scale: np.ndarray, shift: np.ndarray) -> None:
        x, scale_value, shift_value = node.inputs
        dtype = _dtype(node)
        assert x is not None and dtype is not None and node.graph is not None
        graph = node.graph
        groups = node.attributes["num_groups"].as_int()
        one, zero = self._identity(model, dtype)
        # per channel, broadcast over the spatial axes: [C, 1, ..., 1]
        per_channel = (len(scale),) + (1,) * (rank - 2)
        scale_c = self._constant(model, graph, f"{node.name or 'group_norm'}_scale",
                                 scale.reshape(per_channel).astype(dtype.numpy()))
        shift_c = self._constant(model, graph, f"{node.name or 'group_norm'}_shift",
                                 shift.reshape(per_channel).astype(dtype.numpy()))
        grouping = self._constant(model, graph, f"{node.name or 'group_norm'}_groups",
                                  np.array([0, groups, -1], dtype=np.int64))
        shape = ir.node("Shape", inputs=[x])
        grouped = ir.node("Reshape", inputs=[x, grouping])
        norm = ir.node("LayerNormalization", inputs=[grouped.outputs[0], one, zero], name=node.name,
                       attributes={"axis": 2, "epsilon": self._epsilon(node)})
        back = ir.node("Reshape", inputs=[norm.outputs[0], shape.outputs[0]])
        scaled = ir.node("Mul", inputs=[back.outputs[0], scale_c])
        shifted = ir.node("Add", inputs=[scaled.outputs[0], shift_c])
        new = [shape, grouped, norm, back, scaled, shifted]
        for index, made in enumerate(new):
            made.name = self._name(model, f"{node.name or 'group_norm'}_{made.op_type.lower()}_{index}")
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, [node.outputs[0]], [shifted.outputs[0]])
        drop_unread_constants([scale_value, shift_value])

    def ensures(self, model: ir.Model) -> None:
        opset = opset_of(model)
        if opset < LAYER_NORM_OPSET:
            return
        left = [node.name for node in graph_nodes(model) if _plain_instance_norm(node) or _group_norm(node, opset)]
        if left:
            raise ir.passes.PostconditionError(f"group norms not written as layer norms: {left[:5]}")
