"""What the ``onnx_ir`` passes share: the default domain, constant lookup, fresh names, and the
one bridge for callers that still hold an ``onnx.ModelProto``."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from .._graph import DEFAULT_DOMAINS, PASS_THROUGH


def is_default(node: ir.Node) -> bool:
    return node.domain in DEFAULT_DOMAINS


def nodes(model: ir.Model):
    """Every node of the model: the main graph, If/Loop/Scan bodies, and function bodies."""
    yield from ir.traversal.RecursiveGraphIterator(model.graph)
    for function in model.functions.values():
        yield from ir.traversal.RecursiveGraphIterator(function)


def only_reader(value: ir.Value, op_type: str, input_index: int | None = None) -> ir.Node | None:
    """The one default-domain ``op_type`` node that reads ``value`` (at ``input_index``, when given),
    or None when anything else reads it too or it is a graph output: a rewrite may then own it."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    reader, index = uses[0]
    if reader.op_type != op_type or not is_default(reader) or (input_index is not None and index != input_index):
        return None
    return reader


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The values of a constant (initializer or ``Constant`` output), or None when computed."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def is_scalar(value: ir.Value | None, expected: float, tolerance: float = 0.0) -> bool:
    """Whether ``value`` is a one-element constant within ``tolerance`` of ``expected``."""
    values = const_array(value)
    return values is not None and values.size == 1 and abs(float(values.reshape(())) - expected) <= tolerance


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The input of a two-input node that is not ``value`` (None when ``value`` is neither)."""
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    return second if first is value else first if second is value else None


def constant_shape(value: ir.Value | None) -> list[int] | None:
    """Dims of the constant a value comes from through Q/DQ/Cast/Identity (data not loaded)."""
    seen: set[int] = set()
    while value is not None and id(value) not in seen:
        seen.add(id(value))
        tensor = value.const_value
        if tensor is None and (producer := value.producer()) is not None and producer.op_type == "Constant":
            tensor = ir.convenience.get_const_tensor(value)
        if tensor is not None:
            return [int(d) for d in tensor.shape]
        producer = value.producer()
        if producer is None or producer.op_type not in PASS_THROUGH or not is_default(producer) or not producer.inputs:
            return None
        value = producer.inputs[0]
    return None


def taken_names(model: ir.Model) -> set[str]:
    """Every value and node name used anywhere, so that a new name collides with none."""
    taken: set[str] = set(model.graph.initializers)
    for node in nodes(model):
        taken.update(v.name for v in (*node.inputs, *node.outputs) if v is not None and v.name)
        if node.name:
            taken.add(node.name)
    taken.update(v.name for v in (*model.graph.inputs, *model.graph.outputs) if v.name)
    return taken


def drop_unread_constants(values) -> None:
    """Remove those of ``values`` that are constants nothing reads any more, and nothing else."""
    for value in {id(v): v for v in values}.values():
        if value.uses() or value.is_graph_output() or value.is_graph_input():
            continue
        if (graph := value.graph) is not None and graph.initializers.get(value.name) is value:
            del graph.initializers[value.name]
        elif (producer := value.producer()) is not None and producer.op_type == "Constant" and producer.graph is not None:
            producer.graph.remove(producer, safe=True)


def on_proto(pass_: ir.passes.PassBase, model: onnx.ModelProto) -> onnx.ModelProto:
    """Run an ``onnx_ir`` pass on a proto and return a new proto; ``model`` is left as it was."""
    result = pass_(ir.from_proto(model))
    if not result.modified:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    return ir.to_proto(result.model)
