"""Attention's key transposition in the layouts ONNX Runtime computes without a copy.

torch.onnx writes ``scaled_dot_product_attention``'s ``key.transpose(-2, -1)`` for any rank as
``Reshape(key, [-1, S, D]) → Transpose(perm=[0, 2, 1]) → Reshape([..., D, S])``. ONNX Runtime
folds a Transpose of a MatMul operand's last two axes into the product (``FusedMatMul`` reading
the key transposed in place), but not through the two Reshapes: every decoding step then copies
the whole key cache — in an encoder–decoder, every cross-attention key of the source — before
multiplying by it. :class:`SwapLastAxesPass` writes the three nodes as the one Transpose they are.

onnxscript's MultiHeadAttention fusion gives the kernel a cached cross-attention key and value as
``Reshape(Transpose(cache, [0, 2, 1, 3]), [B, S, N·H])``, and the kernel transposes them back to
its own ``(B, N, S, H)`` layout: two copies of the cache per step, which made the fused decoder
slower than the unfused one. The kernel takes a cache in that layout as it is;
:class:`MhaCacheLayoutPass` gives it the cache.

Both rewrites move values only, never compute them: the file's outputs stay bit for bit.
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import is_default, nodes, only_reader


def _same_dim(a: object, b: object) -> bool:
    """Two dims known to be equal: the same integer, or the same named symbolic dim."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    name_a, name_b = getattr(a, "value", None), getattr(b, "value", None)
    return name_a is not None and name_a == name_b


def _dims(value: ir.Value | None) -> list | None:
    shape = value.shape if value is not None else None
    return None if shape is None else list(shape.dims)


def _perm(node: ir.Node) -> list[int] | None:
    attribute = node.attributes.get("perm")
    return None if attribute is None else list(attribute.as_ints())


def _unread(value: ir.Value) -> bool:
    return not any(True for _ in value.uses()) and not value.is_graph_output()


def _drop_if_unread(node: ir.Node | None) -> None:
    """Remove ``node`` when nothing reads its outputs, and so on up through what computed its
    inputs (a Reshape's target built from Shape, Slice and Concat), constants included."""
    if node is None or node.graph is None or not all(_unread(out) for out in node.outputs):
        return
    inputs = [value for value in node.inputs if value is not None]
    node.graph.remove(node, safe=True)
    for value in inputs:
        _drop_value_if_unread(value)


def _drop_value_if_unread(value: ir.Value) -> None:
    if not _unread(value) or value.is_graph_input():
        return
    graph = value.graph
    if graph is not None and graph.initializers.get(value.name) is value:
        del graph.initializers[value.name]
    else:
        _drop_if_unread(value.producer())


def _shape_entries(value: ir.Value | None, source: ir.Value, rank: int, depth: int = 0) -> list | None:
    """The entries of a 1-D shape tensor, each an integer or ``("axis", k)`` (dim ``k`` of
    ``source``), as far as constants and ``Shape(source)``, ``Slice`` and ``Concat`` compute them —
    the way torch.onnx builds a Reshape's target at run time."""
    if value is None or depth > 8:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        array = tensor.numpy()
        return [int(v) for v in array.reshape(-1)] if array.ndim == 1 and array.dtype.kind == "i" else None
    node = value.producer()
    if node is None or not is_default(node):
        return None
    if node.op_type == "Shape" and node.inputs[0] is source:
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        return [("axis", k) for k in range(rank)][start:end]
    if node.op_type == "Concat" and node.attributes.get_int("axis", 0) in (0, -1):
        parts = [_shape_entries(part, source, rank, depth + 1) for part in node.inputs]
        return None if any(part is None for part in parts) else [entry for part in parts for entry in part]
    if node.op_type == "Slice" and len(node.inputs) in (3, 4, 5):
        data = _shape_entries(node.inputs[0], source, rank, depth + 1)
        bounds = [ir.convenience.get_const_tensor(v) if v is not None else None for v in node.inputs[1:]]
        if data is None or any(b is None or b.numpy().size != 1 for b in bounds[:2]):
            return None
        if any(b is not None and int(b.numpy().reshape(-1)[0]) != default for b, default in zip(bounds[2:], (0, 1))):
            return None  # another axis or step
        first, last = (int(b.numpy().reshape(-1)[0]) for b in bounds[:2])
        # ONNX clamps a bound beyond either end of the axis, as Python's slicing does
        return data[max(first, -(1 << 62)):min(last, 1 << 62)]
    return None


def _is_dim(entry: object, dims: list, axis: int) -> bool:
    """``entry`` of a computed shape is known to be dim ``axis`` of a tensor of ``dims``."""
    if entry == ("axis", axis):
        return True
    return isinstance(entry, int) and entry > 0 and _same_dim(entry, dims[axis])


def _swap_proven(first: ir.Node, second: ir.Node, dims: list) -> bool:
    """The two Reshapes' targets flatten a tensor of ``dims`` to its matrices and give back its
    leading axes with the last two swapped: by the shapes recorded on the values, or by the
    targets computed from the tensor's own shape."""
    rank, source = len(dims), first.inputs[0]
    flat, result = _dims(first.outputs[0]), _dims(second.outputs[0])
    if flat is not None and result is not None and len(flat) == 3 and len(result) == rank \
            and _same_dim(flat[1], dims[-2]) and _same_dim(flat[2], dims[-1]) \
            and all(_same_dim(a, b) for a, b in zip(result[:-2], dims[:-2])) \
            and _same_dim(result[-2], dims[-1]) and _same_dim(result[-1], dims[-2]):
        return True
    if any(reshape.attributes.get_int("allowzero", 0) for reshape in (first, second)):
        return False
    flat_target = _shape_entries(first.inputs[1], source, rank)
    result_target = _shape_entries(second.inputs[1], source, rank)
    if flat_target is None or result_target is None or len(flat_target) != 3 or len(result_target) != rank:
        return False
    axes = [*range(rank - 2), rank - 1, rank - 2]
    return (flat_target[0] == -1 and _is_dim(flat_target[1], dims, rank - 2) and _is_dim(flat_target[2], dims, rank - 1)
            and all(_is_dim(entry, dims, axis) for entry, axis in zip(result_target, axes)))


def _swapped(node: ir.Node) -> tuple[ir.Node, ir.Value] | None:
    """For a ``Transpose(perm=[0, 2, 1])`` between two Reshapes that together swap the last two
    axes of a tensor ``x``: the second Reshape and ``x``."""
    if node.op_type != "Transpose" or not is_default(node) or _perm(node) != [0, 2, 1]:
        return None
    first = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    if first is None or first.op_type != "Reshape" or not is_default(first):
        return None
    second = only_reader(node.outputs[0], "Reshape", 0)
    dims = _dims(first.inputs[0])
    if second is None or dims is None or len(dims) < 3 or not _swap_proven(first, second, dims):
        return None
    return second, first.inputs[0]


class SwapLastAxesPass(ir.passes.InPlacePass):
    """Rewrite ``Reshape → Transpose([0, 2, 1]) → Reshape`` that swaps the last two axes of a
    tensor as one ``Transpose`` of that tensor (in any body), when the shapes recorded on the
    values or the Reshapes' targets, computed from the tensor's own shape, prove it."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(nodes(model)):
            if node.graph is None:  # removed with an earlier match
                continue
            match = _swapped(node)
            if match is None:
                continue
            second, source = match
            rank = len(source.shape)
            perm = [*range(rank - 2), rank - 1, rank - 2]
            transpose = ir.node("Transpose", [source], attributes={"perm": perm}, name=second.name)
            target = second.inputs[1]
            # the one Transpose takes over the second Reshape's value: its name, type, shape and readers
            ir.convenience.replace_nodes_and_values(second.graph, second, [second], [transpose], [second.outputs[0]],
                                                   [transpose.outputs[0]])
            # the three-axis Transpose, the first Reshape, and what computed both targets
            _drop_if_unread(node)
            if target is not None:
                _drop_value_if_unread(target)
            modified = True
        return ir.passes.PassResult(model, modified)


def _cache_behind(value: ir.Value | None, heads: int) -> ir.Value | None:
    """The ``(B, N, S, H)`` tensor ``value`` is laid out from as ``(B, S, N·H)`` by a
    Transpose([0, 2, 1, 3]) and a Reshape, with N the attention's head count."""
    reshape = value.producer() if value is not None else None
    if reshape is None or reshape.op_type != "Reshape" or not is_default(reshape):
        return None
    transpose = reshape.inputs[0].producer()
    if transpose is None or transpose.op_type != "Transpose" or not is_default(transpose) \
            or _perm(transpose) != [0, 2, 1, 3]:
        return None
    cache = transpose.inputs[0]
    dims, flat = _dims(cache), _dims(value)
    if dims is None or flat is None or len(dims) != 4 or len(flat) != 3:
        return None
    if not (dims[1] == heads and isinstance(dims[3], int) and flat[2] == heads * dims[3]):
        return None
    return cache if _same_dim(flat[0], dims[0]) and _same_dim(flat[1], dims[2]) else None


class MhaCacheLayoutPass(ir.passes.InPlacePass):
    """Give ``com.microsoft.MultiHeadAttention`` a cached key and value in its own ``(B, N, S, H)``
    layout where the graph lays them out as ``(B, S, N·H)`` from that layout, and it takes no
    projection bias or past state (the kernel reads such a key and value as they are)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(nodes(model)):
            if node.op_type != "MultiHeadAttention" or node.domain != "com.microsoft" or len(node.inputs) < 3:
                continue
            extra = [node.inputs[i] for i in (3, 6, 7) if i < len(node.inputs)]  # bias, past key, past value
            heads = node.attributes.get_int("num_heads")
            if any(v is not None for v in extra) or heads is None:
                continue
            key, value = _cache_behind(node.inputs[1], heads), _cache_behind(node.inputs[2], heads)
            if key is None or value is None:
                continue
            old = [node.inputs[1].producer(), node.inputs[2].producer()]
            node.replace_input_with(1, key)
            node.replace_input_with(2, value)
            for reshape in old:  # and the Transpose before it, once nothing reads them
                _drop_if_unread(reshape)
            modified = True
        return ir.passes.PassResult(model, modified)
