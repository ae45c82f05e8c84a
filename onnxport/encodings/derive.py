"""Data-movement derivation: operators that only move values take the encoding of what they move.

QNN-style consumers expect a Reshape, Transpose, MaxPool, Concat… to sit between identical Q/DQ
pairs; without them a backend may treat the tensor as float. Between activations only per-tensor
encodings travel, and only onto computed tensors (a constant such as a Clip bound is never given
an activation's encoding). A weight moved by a Transpose/Reshape/Squeeze/Unsqueeze/Flatten passes
its encoding forward to the moved tensor, per-channel axis and (through a Transpose) block grid
re-laid, so the consumer reads a quantized weight.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.defs
import onnx_ir as ir

from .._core.ir import graphs, is_default, opset_of
from .axes import TensorInfo
from .formats import Encoding, ScaleMeta

DATA_MOVEMENT = {
    "Col2Im", "Compress", "DepthToSpace", "Dropout", "Expand", "Flatten", "Gather", "GatherElements",
    "GatherND", "Identity", "MaxPool", "MaxRoiPool", "Pad", "ReduceMax", "ReduceMin", "Reshape", "Slice",
    "SpaceToDepth", "Split", "Squeeze", "Tile", "TopK", "Transpose", "Unsqueeze", "Concat",
    "ScatterElements", "ScatterND", "Clip", "Max", "Min", "Where",
}


def _float_slots(node: ir.Node, opset: int) -> tuple[list[int], list[int]]:
    """Indices of the inputs and outputs whose type can be float, from the operator's schema."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except onnx.defs.SchemaError:
        return [], []
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}

    def floaty(formal) -> bool:
        types = allowed.get(formal.type_str, [formal.type_str])
        return "tensor(float)" in types

    def slots(formals, actual: list[str]) -> list[int]:
        result = []
        for i, name in enumerate(actual):
            if not name:
                continue  # an omitted optional input
            formal = formals[min(i, len(formals) - 1)] if formals else None
            if formal is not None and floaty(formal):
                result.append(i)
        return result

    return slots(schema.inputs, _names(node.inputs)), slots(schema.outputs, _names(node.outputs))


def _names(values) -> list[str]:
    return [v.name or "" if v is not None else "" for v in values]


def _per_tensor(e: Encoding | None) -> bool:
    return e is not None and e.meta is None and e.block_size is None and np.ndim(e.scale) == 0 and e.dtype != "int32"


def _same(a: Encoding, b: Encoding) -> bool:
    za = 0 if a.zero_point is None else int(a.zero_point)
    zb = 0 if b.zero_point is None else int(b.zero_point)
    return a.dtype == b.dtype and float(a.scale) == float(b.scale) and za == zb


#: Operators through which a weight keeps its values: the moved weight takes the weight's encoding,
#: so its consumer (a MatMul reading ``Transpose(W)``) reads a quantized weight.
PARAMETER_MOVERS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def _moved_axis(node: ir.Node, axis: int, before: tuple[int, ...], after: tuple[int, ...] | None) -> int | None:
    """Where axis ``axis`` of the input lands in the output, or None when it does not survive whole."""
    if node.op_type == "Transpose":
        return _perm(node, len(before)).index(axis)
    if after is None:
        return None
    prefix, size = int(np.prod(before[:axis])), before[axis]
    found = [b for b in range(len(after)) if after[b] == size and int(np.prod(after[:b])) == prefix]
    return found[0] if len(found) == 1 else None


def moved_parameter(node: ir.Node, e: Encoding, before: tuple[int, ...] | None,
                     after: tuple[int, ...] | None, name: str) -> Encoding | None:
    """The encoding of a weight moved by ``node``, re-laid for the moved tensor, or None."""
    if e.dtype == "int32":
        return None  # dequantize-only: it has no Q/DQ form on a computed tensor
    moved = e.with_(name=name, section="param")
    if e.axis is None:
        return moved
    if before is None:
        return None
    axis = _moved_axis(node, e.axis, before, after)
    if axis is None:
        return None
    if e.block_size is None:  # per-channel: one scale (or meta scale) per channel, whatever the layout
        return moved.with_(axis=axis)
    if node.op_type != "Transpose":
        return None  # a block grid survives only a permutation
    perm = _perm(node, len(before))

    def grid(values: np.ndarray | None) -> np.ndarray | None:
        return None if values is None or np.ndim(values) == 0 else np.transpose(values, perm)

    if e.meta is None:
        return moved.with_(axis=axis, scale=grid(e.scale), zero_point=grid(e.zero_point))
    meta = e.meta
    if meta.block_size is not None:
        return None
    new_meta = ScaleMeta(grid(meta.x), meta.x_scale, meta.x_zero_point, meta.x_dtype,
                          None if meta.axis is None else perm.index(meta.axis), None)
    return moved.with_(axis=axis, meta=new_meta, zero_point=grid(e.zero_point))


def _perm(node: ir.Node, rank: int) -> list[int]:
    return list(node.attributes.get_ints("perm") or ()) or list(range(rank))[::-1]


Move = tuple[ir.Node, "tuple[int, ...] | None", "tuple[int, ...] | None", str]


def derive_encodings(model: ir.Model, known: dict[str, Encoding], info: dict[str, TensorInfo],
                     moves: dict[str, list[Move]] | None = None) -> list[Encoding]:
    """New encodings for data-movement tensors, from their neighbours (two sweeps, both ways).

    ``moves``, when given, collects each weight move as ``source → [(node, dims before, dims
    after, moved name)]``, in the order they were derived, so that an encoding whose values were
    set aside (an outline) can have its moved encodings computed again from its values."""
    opset = opset_of(model)
    encodings = dict(known)
    derived: dict[str, Encoding] = {}
    for graph in graphs(model):
        readers: dict[str, int] = {}
        for node in graph:
            for name in _names(node.inputs):
                if name:
                    readers[name] = readers.get(name, 0) + 1
        outputs = {o.name for o in graph.outputs}
        movers = [n for n in graph if n.op_type in DATA_MOVEMENT and is_default(n)]

        def computed(name: str) -> bool:
            t = info.get(name)
            return t is not None and not t.is_constant and t.elem_type in (None, 0, onnx.TensorProto.FLOAT)

        def give(name: str, source: Encoding) -> None:
            new = source.with_(name=name, section="activation")
            encodings[name] = derived[name] = new

        moved_weights: set[str] = set()
        for node in movers:  # graph order, so chains (Transpose then Reshape) follow
            source = _names(node.inputs[:1])[0] if node.inputs else ""
            tensor = info.get(source)
            weight = tensor is not None and (tensor.is_constant or source in moved_weights)
            if (node.op_type in PARAMETER_MOVERS and weight and source in encodings
                    and computed(node.outputs[0].name) and node.outputs[0].name not in encodings):
                after = info[node.outputs[0].name].dims
                derived_entry = moved_parameter(node, encodings[source], tensor.dims, after, node.outputs[0].name)
                if derived_entry is not None:
                    encodings[node.outputs[0].name] = derived[node.outputs[0].name] = derived_entry
                    moved_weights.add(node.outputs[0].name)
                    if moves is not None:
                        moves.setdefault(source, []).append((node, tensor.dims, after, node.outputs[0].name))

        for order in (movers, list(reversed(movers))):
            for node in order:
                ins, outs = _float_slots(node, opset)
                in_names = [n for n in (_names(node.inputs)[i] for i in ins) if computed(n)]
                out_names = [n for n in (_names(node.outputs)[i] for i in outs) if computed(n)]
                if not in_names or not out_names:
                    continue
                out_encs = [encodings.get(n) for n in out_names]
                # backward: a tensor read only here takes the (shared) encoding of the outputs
                if all(_per_tensor(e) for e in out_encs) and all(_same(out_encs[0], e) for e in out_encs):
                    for name in in_names:
                        if name not in encodings and readers.get(name, 0) == 1 and name not in outputs:
                            give(name, out_encs[0])
                # forward: outputs take the inputs' encoding when every moved input agrees
                first = encodings.get(in_names[0])
                movers_in = in_names[:1] if node.op_type == "Pad" else in_names
                if _per_tensor(first) and all(
                    _per_tensor(encodings.get(n)) and _same(first, encodings[n]) for n in movers_in
                ):
                    for name in out_names:
                        if name not in encodings:
                            give(name, first)
    return list(derived.values())
