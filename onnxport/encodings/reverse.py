"""``onnx_qdq_to_encodings``: a Q/DQ model back to AIMET-style encodings (version 2.0.0)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx

from .._graph import all_constants, producers, tensor_value, walk_graphs
from ..errors import InvalidArgumentError
from ..qdq.view import qdq_nodes
from .formats import DTYPES, layout_param

_MARK = "onnxport: encodes "
_BY_ONNX_TYPE = {d.onnx_type: name for name, d in DTYPES.items()}


def _plain(values: np.ndarray) -> Any:
    values = np.asarray(values)
    if values.dtype.kind == "f" or values.dtype.kind == "V" or str(values.dtype).startswith(("float", "bfloat")):
        values = values.astype(np.float64)
    else:
        values = values.astype(np.int64)
    return values.item() if values.ndim == 0 else values.tolist()


def onnx_qdq_to_encodings(model: onnx.ModelProto | str | os.PathLike) -> dict:
    """Read every Q/DQ pair of an ONNX model back into an encodings dict (version 2.0.0).

    Each DequantizeLinear gives one entry, named after the tensor it quantizes (the input of its
    QuantizeLinear, the graph output it restores, or — for a prequantized constant — the tensor
    the converter recorded). Double-quantized scales come back as 2.1.0 meta encodings, and the
    file then says version 2.1.0. ``encodings_to_onnx_qdq`` of the result gives the same pairs.
    """
    base = None
    if isinstance(model, (str, os.PathLike)):
        base = os.path.dirname(os.fspath(model))
        from .._io import read_onnx

        model = read_onnx(model, "model")
    if not isinstance(model, onnx.ModelProto):
        raise InvalidArgumentError(f"model must be an onnx.ModelProto or a path, not {type(model).__name__}.")
    consts = all_constants(model)
    entries: list[dict] = []
    version = "2.0.0"
    nodes = qdq_nodes(model, base)
    per_graph: dict[int, tuple[dict, set[str], set[str]]] = {}
    for q in nodes:
        node, graph = q.node, q.graph
        if id(graph) not in per_graph:
            scale_inputs = {other.node.input[1] for other in nodes if other.graph is graph}
            per_graph[id(graph)] = producers(graph), {o.name for o in graph.output}, scale_inputs
        made_by, outputs, scale_inputs = per_graph[id(graph)]
        if node.op_type != "DequantizeLinear" or node.output[0] in scale_inputs:
            continue  # a scale's own dequantizer is part of the meta encoding it serves
        source = made_by.get(node.input[0])
        if node.doc_string.startswith(_MARK):
            name = node.doc_string[len(_MARK):]
        elif source is not None and source.op_type == "QuantizeLinear":
            name = node.output[0] if node.output[0] in outputs else source.input[0]
        else:
            name = node.input[0]
        if any(e["name"] == name for e in entries):
            continue  # a second DQ reader of the same quantized tensor
        entry: dict[str, Any] = {"name": name}
        zp = q.zero_point
        entry["output_dtype"] = _BY_ONNX_TYPE.get(q.dtype, "uint8")
        scale_producer = made_by.get(node.input[1])
        if q.scale is not None:
            scale = q.scale_values()
            entry["y_scale"] = _plain(scale)
        elif scale_producer is not None and scale_producer.op_type == "DequantizeLinear":
            version = "2.1.0"
            meta_attrs = {a.name: a.i for a in scale_producer.attribute}
            meta: dict[str, Any] = {
                "x": _plain(tensor_value(consts[scale_producer.input[0]], base)),
                "x_scale": _plain(tensor_value(consts[scale_producer.input[1]], base)),
                "input_dtype": _BY_ONNX_TYPE[consts[scale_producer.input[0]].data_type],
            }
            if len(scale_producer.input) > 2 and scale_producer.input[2]:
                x_zp = tensor_value(consts[scale_producer.input[2]], base)
                if np.any(x_zp.astype(np.int64)):
                    meta["x_zero_point"] = _plain(x_zp)
            for key in ("axis", "block_size"):
                if key in meta_attrs and (key == "block_size" or np.size(meta["x_scale"]) > 1):
                    meta[key] = meta_attrs[key]
            entry["y_scale"] = meta
            scale = np.asarray(meta["x"])
        else:
            raise InvalidArgumentError(f"The scale of DequantizeLinear '{node.name}' is computed at run time; it has no encoding.")
        if zp is not None:
            values = q.zero_point_values()
            if DTYPES[entry["output_dtype"]].qmin is not None and np.any(values.astype(np.int64)):
                entry["y_zero_point"] = _plain(values)
        if q.block_size:
            entry["axis"] = q.axis
            entry["block_size"] = q.block_size
        elif np.size(scale) > 1:
            entry["axis"] = q.attributes.get("axis", 1)
        entries.append(entry)
    return {"version": version, "encodings": entries}


def strip_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float model a Q/DQ model was made from, as far as the file can tell.

    Every QuantizeLinear→DequantizeLinear pair is removed (its readers read the float tensor),
    and every DequantizeLinear of a constant becomes a float constant of the dequantized values,
    named after the constant it read. ``encodings_to_onnx_qdq(strip_qdq(m), onnx_qdq_to_encodings(m))``
    then rebuilds ``m``'s pairs.
    """
    from onnx import numpy_helper

    result = onnx.ModelProto()
    result.CopyFrom(model)
    for graph in walk_graphs(result.graph):
        consts = {t.name: t for t in graph.initializer}
        made_by = producers(graph)
        outputs = {o.name for o in graph.output}
        replace: dict[str, str] = {}
        drop: set[int] = set()
        new_inits: list[onnx.TensorProto] = []
        scale_values = {n.input[1] for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
        for index, node in enumerate(graph.node):
            if node.op_type != "DequantizeLinear" or node.output[0] in scale_values:
                continue
            source = made_by.get(node.input[0])
            if source is not None and source.op_type == "QuantizeLinear":
                replace[node.output[0]] = source.input[0]
                drop.add(index)
                drop.add(list(graph.node).index(source))
            elif node.input[0] in consts:
                zp_name = node.input[2] if len(node.input) > 2 else ""
                attrs = {a.name: a.i for a in node.attribute}
                q = tensor_value(consts[node.input[0]]).astype(np.float64)
                scale = tensor_value(consts[node.input[1]]).astype(np.float64)
                zp = tensor_value(consts[zp_name]).astype(np.float64) if zp_name else np.zeros(())
                axis, block = attrs.get("axis", 1) % max(q.ndim, 1), attrs.get("block_size")
                scale = layout_param(scale, q.shape, axis, block)
                zp = layout_param(zp, q.shape, axis, block)
                name = node.input[0]
                new_inits.append(numpy_helper.from_array(((q - zp) * scale).astype(np.float32), name))
                replace[node.output[0]] = name
                drop.add(index)
        for name in list(replace):
            target = replace[name]
            while target in replace:
                target = replace[target]
            replace[name] = target
        kept = [n for i, n in enumerate(graph.node) if i not in drop]
        for node in kept:
            for i, name in enumerate(node.input):
                if name in replace:
                    node.input[i] = replace[name]
        for name, target in replace.items():
            if name in outputs:
                kept.append(onnx.helper.make_node("Identity", [target], [name]))
        del graph.node[:]
        graph.node.extend(kept)
        used = {i for g in walk_graphs(graph) for n in g.node for i in n.input}
        stale = {n.name for n in new_inits}
        inits = [t for t in graph.initializer if t.name in used and t.name not in stale] + [t for t in new_inits if t.name in used]
        del graph.initializer[:]
        graph.initializer.extend(inits)
        for info in list(graph.value_info):
            if info.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
                graph.value_info.remove(info)
    return result
