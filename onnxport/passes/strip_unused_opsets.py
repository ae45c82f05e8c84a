"""Drop opset imports of domains that no node uses (ORT's pre-processing adds a dozen)."""

from __future__ import annotations

import onnx

from .._graph import walk_graphs


def _domains(graph: onnx.GraphProto, found: set[str]) -> set[str]:
    for inner in walk_graphs(graph):
        found.update(node.domain or "" for node in inner.node)
    return found


def strip_unused_opsets(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` importing only the domains its nodes and functions use.

    The default domain is always kept.
    """
    used = _domains(model.graph, {""})
    for function in model.functions:
        used.add(function.domain)
        for node in function.node:
            used.add(node.domain or "")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    keep = [e for e in result.opset_import if (e.domain or "") in used or e.domain == "ai.onnx"]
    del result.opset_import[:]
    result.opset_import.extend(keep)
    return result
