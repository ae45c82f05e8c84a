"""Store a weight that is only ever read one fixed slice at a time as those slices.

A mixture's routed experts read each expert's matrix of a 3-D weight with ``Gather(W, e)``, ``e``
a constant: the graph holds ``[experts, out, in]`` and picks a slice of it at every step. At an
unoptimised level ONNX Runtime copies that slice on every run; optimised, it folds the Gather at
load, holding a copy beside the initializer while it does. Written as one initializer per slice,
the file says what it computes with nothing to fold, and every reader finds plain constant weights.

An ``onnx_ir`` pass: every graph is visited, If/Loop/Scan bodies included (they may read the main
graph's initializers); a weight with any other reader, or one that is a graph input or output, is
left whole. The slices are views of the weight's array, so nothing is copied while the model is
in memory.
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import is_default, unique_name


def _constant_index(node: ir.Node, size: int) -> int | None:
    """The index a ``Gather`` on axis 0 takes from ``size`` rows, if it is one constant scalar."""
    if node.op_type != "Gather" or not is_default(node) or node.attributes.get_int("axis", 0) != 0:
        return None
    indices = node.inputs[1] if len(node.inputs) > 1 else None
    if indices is None or indices.const_value is None:
        return None
    array = indices.const_value.numpy()
    if array.ndim != 0 or not -size <= int(array) < size:
        return None
    return int(array) % size


class SplitIndexedWeightPass(ir.passes.InPlacePass):
    """Split each initializer that only constant-index ``Gather`` nodes read into one initializer
    per index read; ``modified`` says whether one was split."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        taken = set(graph.initializers) | {v.name for node in ir.traversal.RecursiveGraphIterator(graph)
                                            for v in (*node.inputs, *node.outputs) if v is not None and v.name}
        modified = False
        for name, weight in list(graph.initializers.items()):
            if weight.const_value is None or weight.is_graph_input() or weight.is_graph_output():
                continue
            shape = weight.const_value.shape
            if len(shape) < 1 or not isinstance(shape[0], int):
                continue
            uses = list(weight.uses())
            picks = [(node, _constant_index(node, shape[0])) if index == 0 else (node, None) for node, index in uses]
            if not picks or any(pick is None or node.outputs[0].is_graph_output() for node, pick in picks):
                continue
            values = weight.const_value.numpy()
            slices: dict[int, ir.Value] = {}
            for node, pick in picks:
                assert pick is not None
                if pick not in slices:
                    part = ir.Value(name=unique_name(f"{name}.{pick}", taken), const_value=ir.tensor(values[pick]))
                    graph.register_initializer(part)
                    slices[pick] = part
                node.outputs[0].replace_all_uses_with(slices[pick])
                node.graph.remove(node, safe=True)
            graph.initializers.pop(name)
            modified = True
        return ir.passes.PassResult(model, modified)
