"""Lower a model to an older default-domain opset, where that is an exact relabelling.

``torch.onnx.export(dynamo=True)`` writes opset 18 at the least. Between 17 and 18 the Reduce
family moved ``axes`` from an attribute to an input, and a few operators gained options. This
pass moves constant ``axes`` back to the attribute, writes a Split's ``num_outputs`` as explicit
sizes when the split dimension is known, accepts the other operators when they use none of the
newer options, and refuses anything else with a message naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.defs
from onnx import numpy_helper

from .._graph import all_names, opset_of, unique_name, walk_graphs
from ..errors import ExportRefusedError

_REDUCE_OPS = {
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
    "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
}


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def _drop_attr(node: onnx.NodeProto, name: str) -> None:
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep)


def _describe(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node '{node.name or node.output[0]}'"


class _Lowering:
    def __init__(self, model: onnx.ModelProto, target: int, current: int) -> None:
        self.model = model
        self.target = target
        self.current = current
        self._dims: dict[str, list[int | None]] | None = None
        self.taken = all_names(model)
        self.constants: dict[str, onnx.TensorProto] = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                value = _attr(node, "value")
                if value is not None:
                    self.constants[node.output[0]] = value

    def refuse(self, node: onnx.NodeProto, why: str) -> ExportRefusedError:
        return ExportRefusedError(
            f"Cannot lower the graph from opset {self.current} to opset {self.target}: the "
            f"{_describe(node)} {why}. Ask for opset {self.current} or later instead."
        )

    def reduce(self, node: onnx.NodeProto) -> None:
        noop = _attr(node, "noop_with_empty_axes") or 0
        if len(node.input) >= 2 and node.input[1]:
            name = node.input[1]
            if name not in self.constants:
                raise self.refuse(node, f"takes its axes from '{name}', which is computed while the graph runs")
            axes = [int(a) for a in numpy_helper.to_array(self.constants[name]).reshape(-1)]
            if not axes and noop:
                raise self.refuse(node, "reduces over an empty axes list with noop_with_empty_axes=1")
            del node.input[1:]
            if axes:
                node.attribute.append(onnx.helper.make_attribute("axes", axes))
        elif len(node.input) >= 2:
            del node.input[1:]
        if noop and not any(a.name == "axes" for a in node.attribute):
            raise self.refuse(node, "reduces nothing (noop_with_empty_axes=1), which the older opset cannot say")
        _drop_attr(node, "noop_with_empty_axes")

    def dims(self, name: str) -> list[int | None] | None:
        """The shape of a value as shape inference knows it (None where a dim is symbolic)."""
        if self._dims is None:
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model, strict_mode=False).graph
            except Exception:  # noqa: BLE001 - inference only helps; without it Split stays refused
                inferred = self.model.graph
            self._dims = {}
            for value in [*inferred.input, *inferred.value_info, *inferred.output]:
                shape = value.type.tensor_type.shape
                if value.type.tensor_type.HasField("shape"):
                    self._dims[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]
            for tensor in self.model.graph.initializer:
                self._dims[tensor.name] = list(tensor.dims)
        return self._dims.get(name)

    def split(self, node: onnx.NodeProto) -> None:
        """``num_outputs`` (opset 18) back to explicit sizes, when the split dimension is known."""
        parts = _attr(node, "num_outputs")
        if parts is None:
            return
        shape = self.dims(node.input[0])
        axis = _attr(node, "axis") or 0
        length = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
        if length is None:
            raise self.refuse(node, "splits into num_outputs chunks along a dimension whose size is only known "
                                    "while the graph runs, which the older opset cannot say")
        chunk = -(-length // parts)  # opset 18: equal chunks, the last one smaller
        sizes = [chunk] * (parts - 1) + [length - chunk * (parts - 1)]
        if sizes[-1] <= 0:
            raise self.refuse(node, f"splits {length} elements into {parts} chunks, leaving an empty one")
        name = unique_name(f"{node.name or node.output[0]}_split_sizes", self.taken)
        self.model.graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), name))
        del node.input[1:]
        node.input.append(name)
        _drop_attr(node, "num_outputs")

    def lower_node(self, node: onnx.NodeProto) -> None:
        if node.domain not in ("", "ai.onnx"):
            return
        schema = onnx.defs.get_schema(node.op_type, self.current, node.domain)
        if schema.since_version <= self.target:
            return
        op = node.op_type
        older = _older_schema(op, self.target)
        if older is None:
            raise self.refuse(node, f"has no definition before opset {schema.since_version}")
        if op in _REDUCE_OPS and older.since_version >= 11:
            self.reduce(node)
        elif op == "Pad" and older.since_version >= 11 and len(node.input) <= 3:
            pass  # opset 18 only added the optional `axes` input
        elif op == "Resize" and older.since_version >= 13 and not any(
            _attr(node, a) for a in ("antialias", "axes")
        ) and (_attr(node, "keep_aspect_ratio_policy") in (None, b"stretch", "stretch")):
            _drop_attr(node, "keep_aspect_ratio_policy")
            _drop_attr(node, "antialias")
        elif op == "Split" and older.since_version >= 13:
            self.split(node)
        elif op in ("ScatterElements", "ScatterND") and older.since_version >= 16 and _attr(
            node, "reduction"
        ) not in (b"max", b"min", "max", "min"):
            pass
        elif op == "LpPool" and older.since_version >= 11 and not _attr(node, "ceil_mode"):
            _drop_attr(node, "ceil_mode")
        else:
            raise self.refuse(
                node, f"uses a form introduced in opset {schema.since_version} that the lowering does not rewrite"
            )

    def walk(self, graph: onnx.GraphProto) -> None:
        for inner in walk_graphs(graph):
            for node in inner.node:
                self.lower_node(node)


def _older_schema(op: str, target: int):
    try:
        return onnx.defs.get_schema(op, target, "")
    except onnx.defs.SchemaError:
        return None


def _used_names(graph: onnx.GraphProto, used: set[str]) -> set[str]:
    for inner in walk_graphs(graph):
        for node in inner.node:
            used.update(node.input)
    used.update(o.name for o in graph.output)
    return used


def drop_unused_constants(model: onnx.ModelProto, candidates: set[str]) -> int:
    """Remove the initializers and Constant nodes among ``candidates`` that nothing reads."""
    used = _used_names(model.graph, set())
    dead = candidates - used
    if not dead:
        return 0
    inits = [t for t in model.graph.initializer if t.name not in dead]
    nodes = [n for n in model.graph.node if not (n.op_type == "Constant" and n.output[0] in dead)]
    removed = len(model.graph.initializer) + len(model.graph.node) - len(inits) - len(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return removed


def lower_opset(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """Return a copy of ``model`` declaring default-domain opset ``target``.

    A model already at ``target`` or older comes back unchanged (a copy). Raises
    :class:`ExportRefusedError`, naming the node, when some operator cannot be expressed at
    ``target`` exactly. The result still needs checking (``onnx.checker`` and a run): this pass
    only rewrites.
    """
    current = opset_of(model)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    if target >= current:
        return lowered
    lowering = _Lowering(lowered, target, current)
    axes_inputs = {
        n.input[1] for n in lowered.graph.node if n.op_type in _REDUCE_OPS and len(n.input) >= 2 and n.input[1]
    }
    lowering.walk(lowered.graph)
    drop_unused_constants(lowered, axes_inputs)
    for entry in lowered.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = target
    return lowered
