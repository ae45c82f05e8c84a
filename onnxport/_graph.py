"""Read-only helpers over ONNX protos: constants, producers, consumers, names, the opset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ._io import external_folder, external_source, walk_graphs

DEFAULT_DOMAINS = ("", "ai.onnx")
#: Ops that carry a weight from its constant to its reader without changing its shape.
PASS_THROUGH = ("DequantizeLinear", "QuantizeLinear", "Cast", "Identity")


def constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and ``Constant`` node values, by output name (data not loaded)."""
    found = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    found[node.output[0]] = attr.t
    return found


def all_constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Constants of the main graph and every subgraph: a subgraph may read its parent's."""
    found: dict[str, onnx.TensorProto] = {}
    for graph in walk_graphs(model.graph):
        found.update(constants(graph))
    return found


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Value name → the nodes reading it (a node reading it twice appears twice)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                readers.setdefault(name, []).append(node)
    return readers


def opset_of(model: onnx.ModelProto) -> int:
    """The version of the default ONNX domain (``''`` or ``'ai.onnx'``) a model imports."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    from .errors import InvalidArgumentError

    raise InvalidArgumentError(
        "The model imports no default-domain (ai.onnx) opset, so none of its standard operators has a "
        "meaning; add an opset_import entry for domain ''."
    )


def is_default_domain(node: onnx.NodeProto) -> bool:
    return node.domain in DEFAULT_DOMAINS


def tensor_value(tensor: onnx.TensorProto, base_dir: str | Path | None = None) -> np.ndarray:
    """A constant's values, reading external data from ``base_dir`` when it lives there (or from
    the folder its own ``basepath`` entry names: a tensor a conversion spilled to scratch)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:

        external_source(tensor, base_dir)  # confined to the model's folder before a byte is read
        return numpy_helper.to_array(tensor, str(external_folder(tensor, base_dir)))
    return numpy_helper.to_array(tensor)


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``… — the first not in ``taken`` (which is updated)."""
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    taken.add(name)
    return name


def all_names(model: onnx.ModelProto) -> set[str]:
    """Every value, node and initializer name used anywhere in the model."""
    names: set[str] = set()
    for graph in walk_graphs(model.graph):
        names.update(t.name for t in graph.initializer)
        names.update(v.name for v in [*graph.input, *graph.output, *graph.value_info])
        for node in graph.node:
            names.update(node.input)
            names.update(node.output)
            if node.name:
                names.add(node.name)
    names.discard("")
    return names
