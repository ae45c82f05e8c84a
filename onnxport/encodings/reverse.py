"""``onnx_qdq_to_encodings``: a Q/DQ model back to AIMET-style encodings (version 2.0.0)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .._core.ir import const_array, const_tensor, is_default, nodes, on_proto, read_model, read_values
from ..errors import InvalidArgumentError
from ..inspection.view import qdq_nodes
from .formats import DTYPES, ENCODES_MARK, layout_param

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
    if not isinstance(model, (onnx.ModelProto, str, os.PathLike)):
        raise InvalidArgumentError(f"model must be an onnx.ModelProto or a path, not {type(model).__name__}.")
    work, _ = read_model(model, "model")
    entries: list[dict] = []
    version = "2.0.0"
    found = qdq_nodes(work)
    scale_inputs = {q.node.inputs[1] for q in found if len(q.node.inputs) > 1}
    for q in found:
        node = q.node
        if node.op_type != "DequantizeLinear" or q.output in scale_inputs:
            continue  # a scale's own dequantizer is part of the meta encoding it serves
        source = q.input.producer() if q.input is not None else None
        if node.doc_string and node.doc_string.startswith(ENCODES_MARK):
            name = node.doc_string[len(ENCODES_MARK):]
        elif source is not None and source.op_type == "QuantizeLinear":
            name = q.output.name if q.output.is_graph_output() else source.inputs[0].name
        else:
            name = q.input.name
        if any(e["name"] == name for e in entries):
            continue  # a second DQ reader of the same quantized tensor
        entry: dict[str, Any] = {"name": name}
        zp = q.zero_point
        entry["output_dtype"] = _BY_ONNX_TYPE.get(q.dtype, "uint8")
        scale_producer = node.inputs[1].producer() if node.inputs[1] is not None else None
        if q.scale is not None:
            scale = q.scale_values()
            entry["y_scale"] = _plain(scale)
        elif scale_producer is not None and scale_producer.op_type == "DequantizeLinear":
            version = "2.1.0"
            meta_attrs = {k: a.value for k, a in scale_producer.attributes.items() if a.type == ir.AttributeType.INT}
            x, x_scale = const_tensor(scale_producer.inputs[0]), const_tensor(scale_producer.inputs[1])
            meta: dict[str, Any] = {
                "x": _plain(read_values(x)),
                "x_scale": _plain(read_values(x_scale)),
                "input_dtype": _BY_ONNX_TYPE[int(x.dtype)],
            }
            if len(scale_producer.inputs) > 2 and (x_zp_tensor := const_tensor(scale_producer.inputs[2])) is not None:
                x_zp = read_values(x_zp_tensor)
                if np.any(x_zp.astype(np.int64)):
                    meta["x_zero_point"] = _plain(x_zp)
            for key in ("axis", "block_size"):
                if key in meta_attrs and (key == "block_size" or np.size(meta["x_scale"]) > 1):
                    meta[key] = meta_attrs[key]
            entry["y_scale"] = meta
            scale = np.asarray(meta["x"])
        else:
            raise InvalidArgumentError(f"The scale of DequantizeLinear '{q.name}' is computed at run time; it has no encoding.")
        if zp is not None:
            zero_points = q.zero_point_values()
            if DTYPES[entry["output_dtype"]].qmin is not None and np.any(zero_points.astype(np.int64)):
                entry["y_zero_point"] = _plain(zero_points)
        if q.block_size:
            entry["axis"] = q.axis
            entry["block_size"] = q.block_size
        elif np.size(scale) > 1:
            entry["axis"] = q.attributes.get("axis", 1)
        entries.append(entry)
    return {"version": version, "encodings": entries}


class StripQDQPass(ir.passes.InPlacePass):
    """Remove every Q→DQ pair and turn every DequantizeLinear of a constant into a float constant.

    Readers of a pair read the float tensor it quantized; a dequantized constant becomes the
    float values ``(q - zero_point) * scale``, named after the constant it read. A pair whose
    output is a graph output becomes an Identity, so the output keeps its name. Bodies included.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        floats: dict[int, ir.Value] = {}  # id(integer constant) -> its float replacement
        modified = False
        for node in list(nodes(model)):
            if node.op_type != "DequantizeLinear" or not is_default(node):
                continue
            out = node.outputs[0]
            if any(user.op_type in ("QuantizeLinear", "DequantizeLinear") and index == 1 for user, index in out.uses()):
                continue  # a double-quantized scale: stripped with the pair it serves
            source = node.inputs[0].producer()
            if source is not None and source.op_type == "QuantizeLinear" and is_default(source):
                replacement = source.inputs[0]
            elif const_array(node.inputs[0]) is not None:
                replacement = floats.get(id(node.inputs[0])) or self._float_constant(node)
                floats[id(node.inputs[0])] = replacement
            else:
                continue
            if out.is_graph_output():
                identity = ir.node("Identity", [replacement])
                node.graph.insert_after(node, identity)
                ir.convenience.replace_all_uses_with(out, identity.outputs[0], replace_graph_outputs=True)
                identity.outputs[0].type, identity.outputs[0].shape = out.type, out.shape
                identity.outputs[0].name, out.name = out.name, f"{out.name}__stripped"
            else:
                out.replace_all_uses_with(replacement)
            modified = True
        if modified:
            RemoveUnusedNodesPass()(model)  # the pairs, the integers, scales and zero-points nothing reads
            self._name_after_integers(floats)
        return ir.passes.PassResult(model, modified)

    @staticmethod
    def _float_constant(dq: ir.Node) -> ir.Value:
        integers = dq.inputs[0]
        q = const_array(integers).astype(np.float64)
        scale = const_array(dq.inputs[1]).astype(np.float64)
        zp_value = dq.inputs[2] if len(dq.inputs) > 2 else None
        zp = const_array(zp_value).astype(np.float64) if zp_value is not None else np.zeros(())
        axis_attr, block_attr = dq.attributes.get("axis"), dq.attributes.get("block_size")
        axis = (axis_attr.as_int() if axis_attr is not None else 1) % max(q.ndim, 1)
        block = block_attr.as_int() if block_attr is not None else None
        values = (q - layout_param(zp, q.shape, axis, block)) * layout_param(scale, q.shape, axis, block)
        value = ir.Value(name=f"{integers.name}__float", const_value=ir.tensor(values.astype(np.float32)))
        (integers.graph or dq.graph).register_initializer(value)
        value.meta["integers_name"] = integers.name
        return value

    @staticmethod
    def _name_after_integers(floats: dict[int, ir.Value]) -> None:
        """Give each float constant the name of the integers it replaced, now that those are gone."""
        for value in floats.values():
            graph, wanted = value.graph, value.meta["integers_name"]
            if graph is None or wanted in graph.initializers:
                continue  # the integers are still read elsewhere; the float keeps its own name
            graph.initializers.pop(value.name)
            value.name = wanted
            graph.register_initializer(value)


def strip_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float model a Q/DQ model was made from, as far as the file can tell.

    Every QuantizeLinear→DequantizeLinear pair is removed (its readers read the float tensor),
    and every DequantizeLinear of a constant becomes a float constant of the dequantized values,
    named after the constant it read. ``encodings_to_onnx_qdq(strip_qdq(m), onnx_qdq_to_encodings(m))``
    then rebuilds ``m``'s pairs. ``model`` is left as it was (:class:`StripQDQPass` on a copy).
    """
    return on_proto(StripQDQPass(), model)
