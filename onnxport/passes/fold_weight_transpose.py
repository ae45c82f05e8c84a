"""Fold ``Transpose(DequantizeLinear(W))`` of a constant weight into a transposed constant.

torch.onnx writes ``linear`` on a 3-D input as ``MatMul(x, Transpose(W))``; in a Q/DQ graph the
Transpose then sits between the weight's DequantizeLinear and the MatMul, where runtimes look for
a DQ feeding the MatMul directly. Storing the int8 weight transposed (and moving the DQ's axis
with it) computes exactly the same values.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .._graph import all_names, consumers, is_default_domain, producers, unique_name


def fold_weight_transpose(model: onnx.ModelProto, base_dir: str | None = None) -> onnx.ModelProto:
    """Return a copy of ``model`` with every foldable weight Transpose folded (idempotent)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    inits = {t.name: t for t in graph.initializer}
    made_by = producers(graph)
    readers = consumers(graph)
    taken = all_names(result)
    replaced: dict[int, onnx.NodeProto] = {}
    for index, node in enumerate(graph.node):
        if node.op_type != "Transpose" or not is_default_domain(node):
            continue
        dq = made_by.get(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        if len(readers.get(dq.output[0], [])) != 1 or dq.output[0] in {o.name for o in graph.output}:
            continue
        weight = numpy_helper.to_array(inits[dq.input[0]], base_dir or "")
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), list(range(weight.ndim))[::-1])
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        axis = axis % weight.ndim
        scale_size = int(np.prod(next(t.dims for t in graph.initializer if t.name == dq.input[1]))) if dq.input[1] in inits else None
        if scale_size is None:
            continue
        name = unique_name(f"{dq.input[0]}_transposed", taken)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.transpose(perm)), name))
        attrs = {"axis": perm.index(axis)} if scale_size > 1 else {}
        replaced[index] = helper.make_node(
            "DequantizeLinear", [name, *dq.input[1:]], [node.output[0]], name=f"{node.name or name}_dq", **attrs
        )
    if not replaced:
        return result
    nodes = [replaced.get(i, n) for i, n in enumerate(graph.node)]
    del graph.node[:]
    graph.node.extend(nodes)
    # The original DQ and weight now have no reader; drop them.
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    nodes = [n for n in graph.node if not (n.op_type == "DequantizeLinear" and n.output[0] not in used)]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return result
