"""``encodings_to_onnx_qdq``: an ONNX model plus AIMET encodings → an ONNX Q/DQ model, exactly."""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper
from onnx_ir.passes.common import TopologicalSortPass
from tqdm.auto import tqdm

from .._io import ScratchTensors, check_external_data, external_folder, external_source, read_onnx, walk_graphs
from .._ir import opset_of, unique_name
from ..errors import ExportRefusedError, InvalidArgumentError, OnnxportWarning
from .axes import TensorInfo, resolve
from .formats import (
    DTYPES,
    NUMPY_TYPES,
    Encoding,
    ScaleMeta,
    is_integer,
    layout_param,
    load_encodings,
    parse_encodings,
    signed_twin,
    smallest_integer_type,
    unsigned_twin,
)

#: metadata key under which a converted model remembers where its unloaded external weights live.
EXTERNAL_BASE_KEY = "onnxport.external_data_dir"
FORCE_CHOICES = ("unsigned", "signed", None)

_REJECTED_FLOATS = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
                    onnx.TensorProto.DOUBLE: "float64"}


class OmittedEncodingsWarning(OnnxportWarning):
    """float16/bfloat16 entries are plain casts with no Q/DQ form; they were left out."""


# -- the model -------------------------------------------------------------------------------------
def _load_model(model: Any) -> tuple[onnx.ModelProto, Path | None]:
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        base = next((p.value for p in model.metadata_props if p.key == EXTERNAL_BASE_KEY), None)
        return copy, Path(base) if base else None
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        # Weights in external data stay on disk: only their names and shapes are needed.
        loaded = read_onnx(path, "model")
        check_external_data(loaded, path.parent)  # a truncated .data file fails here, before any work
        return loaded, path.parent
    raise InvalidArgumentError(f"model must be an onnx.ModelProto or a path to an .onnx file, not {type(model).__name__}.")


def _float_gate(model: onnx.ModelProto) -> None:
    """Only float32 graphs: a float16/bfloat16/float64 tensor anywhere (subgraphs too) is refused."""

    def refuse(what: str, dtype: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"encodings_to_onnx_qdq converts float32 models, and {what} is {_REJECTED_FLOATS[dtype]}; "
            f"convert the model to float32 first."
        )

    for graph in walk_graphs(model.graph):
        for value in [*graph.input, *graph.output, *graph.value_info]:
            if value.type.tensor_type.elem_type in _REJECTED_FLOATS:
                raise refuse(f"tensor '{value.name}'", value.type.tensor_type.elem_type)
        for tensor in graph.initializer:
            if tensor.data_type in _REJECTED_FLOATS:
                raise refuse(f"initializer '{tensor.name}'", tensor.data_type)
        for node in graph.node:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i in _REJECTED_FLOATS:
                    raise refuse(f"the output of Cast node '{node.name or node.output[0]}'", attr.i)
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _REJECTED_FLOATS:
                    raise refuse(f"the value of {node.op_type} node '{node.name or node.output[0]}'", attr.t.data_type)


def _shape_of(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    return None if any(d < 0 for d in dims) else dims


def _index(
    model: onnx.ModelProto,
) -> tuple[dict[str, TensorInfo], dict[str, list[tuple[onnx.NodeProto, int]]], dict[str, list[TensorInfo]]]:
    """Every tensor the encodings may name (subgraphs included), who reads each one, and — for
    names computed in several bodies (an If's two branches may reuse a name) — every definition."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
        known = {v.name: v for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    except Exception:  # shape inference is a help for checks, never a requirement
        known = {}
    info: dict[str, TensorInfo] = {}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    defined: dict[str, list[TensorInfo]] = {}
    for graph in walk_graphs(model.graph):
        local = {v.name: v for v in [*graph.input, *graph.output, *graph.value_info]}
        for tensor in graph.initializer:
            info[tensor.name] = TensorInfo(tensor.name, graph, True, tuple(tensor.dims), tensor.data_type)
        for value in graph.input:
            if value.name not in info:
                info[value.name] = TensorInfo(value.name, graph, False, _shape_of(value), value.type.tensor_type.elem_type)
        for node in graph.node:
            for index, name in enumerate(node.input):
                if name:
                    readers.setdefault(name, []).append((node, index))
            if node.op_type == "Constant":
                value = next((a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
                if value is not None:
                    info[node.output[0]] = TensorInfo(node.output[0], graph, True, tuple(value.dims), value.data_type)
                    continue
            for name in node.output:
                if not name:
                    continue
                meta = local.get(name) or known.get(name)
                entry = TensorInfo(
                    name, graph, False, _shape_of(meta) if meta else None,
                    meta.type.tensor_type.elem_type if meta and meta.type.tensor_type.elem_type else None,
                )
                defined.setdefault(name, []).append(entry)
                info.setdefault(name, entry)
    return info, readers, defined


def _all_names(model: onnx.ModelProto) -> set[str]:
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


# -- force_activation_as -----------------------------------------------------------------------------
def _force(entry: Encoding, how: str | None) -> Encoding:
    if how is None or not is_integer(entry.dtype):
        return entry
    if entry.dtype == "int32":
        raise InvalidArgumentError(
            f"Encoding of '{entry.name}': an int32 activation has no QuantizeLinear (int32 is dequantize-only, "
            f"for biases); quantize that activation with 8 or 16 bits."
        )
    bits = int("".join(c for c in entry.dtype if c.isdigit()))
    shift = 2 ** (bits - 1)
    zero = np.zeros(np.shape(entry.scale if entry.scale is not None else entry.meta.x), np.int64)
    zp = entry.zero_point if entry.zero_point is not None else zero
    if how == "unsigned" and not entry.dtype.startswith("u"):
        return entry.with_(dtype=unsigned_twin(entry.dtype), zero_point=zp + shift)
    if how == "signed" and entry.dtype.startswith("u"):
        moved = zp - shift
        return entry.with_(dtype=signed_twin(entry.dtype), zero_point=moved if np.any(moved) else None)
    return entry


# -- values ------------------------------------------------------------------------------------------
#: Quantize this many elements at a time: bounds the float32 temporaries of a large weight.
_CHUNK_ELEMENTS = 1 << 22
#: New initializers at least this large go to scratch when the model's weights stay on disk.
_SCRATCH_BYTES = 1 << 16

RowReader = Callable[[int, int], np.ndarray]


def _find_constant(name: str, info: TensorInfo) -> onnx.TensorProto:
    for tensor in info.graph.initializer:
        if tensor.name == name:
            return tensor
    for node in info.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            return next(a.t for a in node.attribute if a.name == "value")
    raise InvalidArgumentError(f"'{name}' is not a constant.")


def _constant_rows(tensor: onnx.TensorProto, base: Path | None) -> RowReader:
    """A reader of rows ``[a, b)`` (along axis 0) of a constant, as float32.

    A float32 weight in external data is read straight from its file a slice at a time, so a
    weight never needs more than its own size in memory, and the model never needs its total.
    """
    if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.data_type == onnx.TensorProto.FLOAT and tensor.dims:
        file, offset, _ = external_source(tensor, base)
        row = int(np.prod(tensor.dims[1:], dtype=np.int64))
        shape = tuple(tensor.dims[1:])

        def read(a: int, b: int) -> np.ndarray:
            values = np.fromfile(file, dtype="<f4", count=(b - a) * row, offset=offset + a * row * 4)
            return values.reshape((b - a, *shape))

        return read
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        external_source(tensor, base)  # a named error when the data's folder is unknown
    folder = external_folder(tensor, base) if tensor.data_location == onnx.TensorProto.EXTERNAL else None
    values = numpy_helper.to_array(tensor, str(folder) if folder is not None else "").astype(np.float32, copy=False)
    return lambda a, b: values[a:b] if values.ndim else values


def _typed(values: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(values).astype(NUMPY_TYPES[dtype])


def _rows_of(param: np.ndarray | None, entry: Encoding, a: int, b: int) -> np.ndarray | None:
    """The part of a scale or zero-point that applies to rows ``[a, b)`` of the tensor."""
    if param is None or np.ndim(param) == 0 or (np.size(param) == 1 and not entry.block_size):
        return param
    if entry.block_size:
        if entry.axis == 0:
            return param[a // entry.block_size: -(-b // entry.block_size)]
        return param[a:b]
    return param[a:b] if entry.axis == 0 else param


def quantize_rows(read: RowReader, shape: tuple[int, ...], entry: Encoding, scale: np.ndarray) -> np.ndarray:
    """What ONNX QuantizeLinear computes, in float32 as it does: ``x / scale`` rounded half to even,
    plus the zero-point, saturated to the type — a slice of rows at a time."""
    scale = np.asarray(scale, np.float32)
    out = np.empty(shape, NUMPY_TYPES[entry.dtype])
    d = DTYPES[entry.dtype]
    rows = shape[0] if shape else 1
    step = max(1, _CHUNK_ELEMENTS // max(1, int(np.prod(shape[1:], dtype=np.int64)))) if shape else 1
    if entry.block_size and entry.axis == 0:
        step = max(entry.block_size, step // entry.block_size * entry.block_size)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        x = np.asarray(read(a, b), np.float32)
        s = layout_param(_rows_of(scale, entry, a, b), x.shape, entry.axis, entry.block_size)
        q = x / s
        if d.qmin is None:
            top = np.float32(ml_dtypes.finfo(NUMPY_TYPES[entry.dtype]).max)
            np.clip(q, -top, top, out=q)
        else:
            np.rint(q, out=q)
            if entry.zero_point is not None:
                zp = _rows_of(entry.zero_point, entry, a, b)
                q += layout_param(np.asarray(zp, np.float32), x.shape, entry.axis, entry.block_size)
            np.clip(q, d.qmin, d.qmax, out=q)
        if shape:
            out[a:b] = q.astype(out.dtype)
        else:
            out = q.astype(out.dtype).reshape(())
    return out


def quantize_array(x: np.ndarray, entry: Encoding, scale: np.ndarray) -> np.ndarray:
    """``quantize_rows`` of an array in memory."""
    x = np.asarray(x)
    return quantize_rows((lambda a, b: x[a:b]) if x.ndim else (lambda a, b: x), x.shape, entry, scale)


# -- rewriting -----------------------------------------------------------------------------------------
class _Rewriter:
    def __init__(
        self, model: onnx.ModelProto, info: dict[str, TensorInfo], defined: dict[str, list[TensorInfo]],
        base: Path | None, scratch: ScratchTensors | None,
    ) -> None:
        self.model = model
        self.info = info
        self.defined = defined
        self.base = base
        self.scratch = scratch
        self.taken = _all_names(model)
        self.dead_constants: set[str] = set()

    def name(self, base: str) -> str:
        return unique_name(base, self.taken)

    def add_init(self, graph: onnx.GraphProto, base: str, values: np.ndarray, *, replaces_external: bool = False) -> str:
        """A new initializer; on disk (scratch) when the model's weights are, for a weight that
        replaces one read from external data or any tensor of ``_SCRATCH_BYTES`` or more."""
        name = self.name(base)
        values = np.asarray(values)
        if self.scratch is not None and (replaces_external or values.nbytes >= _SCRATCH_BYTES):
            graph.initializer.append(self.scratch.put(name, values))  # stays on disk, like the weights
        else:
            graph.initializer.append(numpy_helper.from_array(values, name))
        return name

    def scale_input(self, graph: onnx.GraphProto, entry: Encoding, nodes: list[onnx.NodeProto]) -> str:
        if entry.meta is None:
            return self.add_init(graph, f"{entry.name}_scale", np.asarray(entry.scale, dtype=np.float32))
        meta: ScaleMeta = entry.meta
        x_dtype = meta.x_dtype or _narrowest(meta.x)
        x = self.add_init(graph, f"{entry.name}_scale_q", _typed(meta.x, x_dtype))
        x_scale = self.add_init(graph, f"{entry.name}_meta_scale", np.asarray(meta.x_scale, np.float32).reshape(
            () if meta.x_scale.size == 1 else (-1,) if meta.block_size is None else meta.x_scale.shape))
        zp_values = np.zeros(np.shape(meta.x_scale) if meta.x_scale.size > 1 else (), np.int64) if meta.x_zero_point is None else meta.x_zero_point
        if meta.x_scale.size > 1 and meta.block_size is None:
            zp_values = np.asarray(zp_values).reshape(-1)
        x_zp = self.add_init(graph, f"{entry.name}_meta_zero_point", _typed(zp_values, x_dtype))
        out = self.name(f"{entry.name}_scale")
        attrs = {}
        if meta.x_scale.size > 1:
            attrs["axis"] = meta.axis
        if meta.block_size:
            attrs["block_size"] = meta.block_size
        nodes.append(helper.make_node("DequantizeLinear", [x, x_scale, x_zp], [out], name=self.name(f"{entry.name}_scale_dq"), **attrs))
        return out

    def insert(self, entry: Encoding, prequantize: bool) -> None:
        for info in self.defined.get(entry.name) or [self.info[entry.name]]:
            self._insert_in(entry, info, prequantize)

    def _insert_in(self, entry: Encoding, info: TensorInfo, prequantize: bool) -> None:
        graph = info.graph
        nodes: list[onnx.NodeProto] = []
        scale = self.scale_input(graph, entry, nodes)
        zp_shape = np.shape(entry.scale) if entry.meta is None else entry.meta.x.shape
        zp_values = np.zeros(zp_shape, np.int64) if entry.zero_point is None else entry.zero_point
        zp = self.add_init(graph, f"{entry.name}_zero_point", _typed(zp_values, entry.dtype))
        attrs: dict[str, int] = {}
        if entry.axis is not None and (entry.block_size or np.size(zp_values) > 1):
            attrs["axis"] = entry.axis
        if entry.block_size:
            attrs["block_size"] = entry.block_size
        qdq_name = self.name(f"{entry.name}_qdq")
        outputs = {o.name for o in graph.output}
        source = entry.name
        if info.is_constant and (prequantize or entry.dtype == "int32"):
            tensor = _find_constant(entry.name, info)
            quantized = quantize_rows(_constant_rows(tensor, self.base), tuple(tensor.dims), entry, entry.effective_scale())
            external = tensor.data_location == onnx.TensorProto.EXTERNAL
            stored = self.add_init(graph, f"{entry.name}_q", quantized, replaces_external=external)
            nodes.append(helper.make_node("DequantizeLinear", [stored, scale, zp], [qdq_name],
                                          name=self.name(f"{entry.name}_dq"), doc_string=f"onnxport: encodes {entry.name}", **attrs))
            self.dead_constants.add(entry.name)
        else:
            if entry.dtype == "int32":
                raise InvalidArgumentError(
                    f"Encoding of '{entry.name}': int32 is dequantize-only (a bias stored prequantized), but "
                    f"'{entry.name}' is not a constant."
                )
            if entry.name in outputs:
                # Keep the graph's output names: the producer's value is renamed and the DQ takes the name.
                source = self.name(f"{entry.name}_float")
                for node in graph.node:
                    for i, out in enumerate(node.output):
                        if out == entry.name:
                            node.output[i] = source
                qdq_name = entry.name
            q_out = self.name(f"{entry.name}_q")
            nodes.append(helper.make_node("QuantizeLinear", [source, scale, zp], [q_out], name=self.name(f"{entry.name}_q"), **attrs))
            nodes.append(helper.make_node("DequantizeLinear", [q_out, scale, zp], [qdq_name],
                                          name=self.name(f"{entry.name}_dq"), doc_string=f"onnxport: encodes {entry.name}", **attrs))
        if qdq_name != entry.name:
            self.rewire(graph, entry.name, qdq_name, skip=nodes)
        graph.node.extend(nodes)

    def rewire(self, graph: onnx.GraphProto, old: str, new: str, skip: list[onnx.NodeProto]) -> None:
        for inner in walk_graphs(graph):
            for node in inner.node:
                if any(node is s for s in skip):
                    continue
                for i, name in enumerate(node.input):
                    if name == old:
                        node.input[i] = new

    def finish(self) -> None:
        """Drop the float constants the prequantized ones replaced (where nothing reads them any
        more) and put every graph in topological order — with onnx_ir as the index of the proto,
        so that no weight is copied."""
        for proto_graph, ir_graph in _ir_index(self.model)[1]:
            unread = {
                v.name for v in ir_graph.initializers.values()
                if v.name in self.dead_constants and not v.uses() and not v.is_graph_output()
            } | {
                n.outputs[0].name for n in ir_graph
                if n.op_type == "Constant" and n.outputs[0].name in self.dead_constants and not n.outputs[0].uses()
                and not n.outputs[0].is_graph_output()
            }
            # Deleted in place: re-adding the kept ones would copy every weight held in memory.
            for index in reversed(range(len(proto_graph.initializer))):
                if proto_graph.initializer[index].name in unread:
                    del proto_graph.initializer[index]
            for index in reversed(range(len(proto_graph.node))):
                node = proto_graph.node[index]
                if node.op_type == "Constant" and node.output[0] in unread:
                    del proto_graph.node[index]
        _sort_in_place(self.model)


def _ir_index(model: onnx.ModelProto) -> tuple[ir.Model, list[tuple[onnx.GraphProto, ir.Graph]]]:
    """Each graph of ``model`` (bodies too) beside its onnx_ir view, node for node.

    ``ir.from_proto`` wraps the tensors without copying them, so the view is cheap; the proto
    stays the model that is edited and returned.
    """
    pairs: list[tuple[onnx.GraphProto, ir.Graph]] = []

    def pair(proto_graph: onnx.GraphProto, ir_graph: ir.Graph) -> None:
        pairs.append((proto_graph, ir_graph))
        for proto_node, ir_node in zip(proto_graph.node, ir_graph):
            for attr in proto_node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    pair(attr.g, ir_node.attributes[attr.name].as_graph())
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for inner, ir_inner in zip(attr.graphs, ir_node.attributes[attr.name].as_graphs()):
                        pair(inner, ir_inner)

    view = ir.from_proto(model)
    pair(model.graph, view.graph)
    return view, pairs


def _sort_in_place(model: onnx.ModelProto) -> None:
    """Reorder every graph's nodes (bodies too) as onnx_ir's ``TopologicalSortPass`` orders them."""
    view, pairs = _ir_index(model)
    position = {id(node): index for _, ir_graph in pairs for index, node in enumerate(ir_graph)}
    TopologicalSortPass()(view)
    # Bodies before the graphs that hold them: replacing a graph's nodes copies each node, so a
    # body reordered after its If node moved would be edited on a copy the model no longer holds.
    for proto_graph, ir_graph in reversed(pairs):
        order = [position[id(node)] for node in ir_graph]
        if order != sorted(order):
            nodes = [proto_graph.node[i] for i in order]
            del proto_graph.node[:]
            proto_graph.node.extend(nodes)


def _narrowest(values: np.ndarray) -> str:
    dtype = smallest_integer_type(values)
    assert dtype is not None, "parse_encodings checks that a double-quantized scale fits an integer type"
    return dtype


# -- opset ---------------------------------------------------------------------------------------------
def required_opset(entries: list[Encoding]) -> int:
    """The oldest default-domain opset that can state every encoding."""
    need = 10
    for e in entries:
        need = max(need, DTYPES[e.dtype].opset)
        if e.axis is not None and (e.block_size or e.n_scales > 1):
            need = max(need, 13)
        if e.block_size or (e.meta is not None and e.meta.block_size):
            need = max(need, 21)
        if e.meta is not None:
            need = max(need, DTYPES[e.meta.x_dtype or _narrowest(e.meta.x)].opset)
    return need


def _raise_opset(model: onnx.ModelProto, need: int) -> onnx.ModelProto:
    current = opset_of(model)
    if current >= need:
        return model
    try:
        upgraded = onnx.version_converter.convert_version(model, need)
    except Exception as error:
        raise InvalidArgumentError(
            f"These encodings need opset {need}, and ONNX's version converter could not raise this model from "
            f"opset {current}: {error}"
        ) from error
    return upgraded


# -- the public function -----------------------------------------------------------------------------------
def encodings_to_onnx_qdq(
    model: onnx.ModelProto | str | os.PathLike,
    encodings: dict | str | os.PathLike,
    *,
    prequantize_constants: bool = False,
    force_activation_as: str | None = "unsigned",
    derive_data_movement: bool = True,
    allow_subnormal_scales: bool = False,
) -> onnx.ModelProto:
    """Convert an ONNX model and its AIMET encodings into an ONNX Q/DQ model.

    The encodings alone decide what is quantized and how; the translation is exact.

    Args:
        model: an ``onnx.ModelProto`` or a path to an ``.onnx`` file (external data welcome: from
            a path, weights stay on disk unless ``prequantize_constants`` needs them). The input
            is never modified.
        encodings: a dict, or a path to an AIMET ``.encodings`` JSON file, version 0.6.1, 1.0.0,
            2.0.0 or 2.1.0.
        prequantize_constants: store quantized constants as integer initializers followed by a
            DequantizeLinear (round half to even, saturating) instead of a Q/DQ pair.
        force_activation_as: ``'unsigned'`` (default, what QNN's converter expects), ``'signed'``
            or ``None`` (as written). Re-signing is lossless: the zero-point moves by 2^(N-1).
            Parameters keep their type.
        derive_data_movement: give data-movement operators (Reshape, Transpose, MaxPool, Concat…)
            the encoding of the tensor they move, as QNN-style consumers expect. A weight read
            through a Transpose/Reshape/Squeeze/Unsqueeze/Flatten passes its encoding to the moved
            tensor too (axis re-laid), so its consumer reads a quantized weight.
        allow_subnormal_scales: accept scales that are subnormal once stored as float32 (below
            about 1.18e-38). By default they are refused, like zero and infinite ones: runtimes
            that flush denormals to zero would divide by 0.

    Raises:
        InvalidArgumentError: naming the tensor, the field and the value as read, for any value
            that is invalid in the type it would be written in (before the graph is touched).

    Returns:
        A new ``onnx.ModelProto`` at the oldest opset that can state every encoding (never lower
        than the model's), which passes ``onnx.checker``. Save it with :func:`onnxport.save_model`
        (which also carries unloaded external weights across).
    """
    from .derive import derive_encodings

    if force_activation_as not in FORCE_CHOICES:
        raise InvalidArgumentError(
            f"force_activation_as must be 'unsigned', 'signed' or None, not {force_activation_as!r}."
        )
    # the whole file, before the graph
    data = load_encodings(encodings)
    work, base = _load_model(model)  # names and shapes only: weights stay on disk
    # the whole file before the graph is touched; a name the model lacks is refused before values
    parsed = parse_encodings(data, allow_subnormal_scales=allow_subnormal_scales, known=_all_names(work))
    _float_gate(work)
    info, readers, defined = _index(work)
    missing = sorted(e.name for e in parsed.entries if e.name not in info)
    if missing:  # a node's or an op's name, not a tensor's
        raise InvalidArgumentError(f"The encodings name tensor(s) the model does not have: {missing}.")
    entries: list[Encoding] = []
    read, parsed.entries = parsed.entries, []  # each entry is held once: resolved replaces read
    for entry in read:
        tensor = info[entry.name]
        if tensor.elem_type not in (None, 0, onnx.TensorProto.FLOAT):
            kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
            raise InvalidArgumentError(f"Encoding of '{entry.name}': the tensor is {kind}, and only float tensors can be quantized.")
        entry = resolve(entry, tensor, readers.get(entry.name, []), allow_subnormal=allow_subnormal_scales)
        is_param = tensor.is_constant or entry.section == "param"
        if not is_param:
            entry = _force(entry, force_activation_as)
        entries.append(entry)
    read = []
    if derive_data_movement:
        entries += derive_encodings(work, {e.name: e for e in entries}, info)
    upgraded = _raise_opset(work, required_opset(entries))
    if upgraded is not work:  # a new proto: index the graphs the rewrite will edit
        work = upgraded
        info, _, defined = _index(work)
    # A model whose weights stay on disk gets its new large tensors (prequantized weights, 7B-scale
    # scale grids) on disk too, in a scratch file that save_model streams from.
    scratch = ScratchTensors() if base is not None and _has_external(work) else None
    rewriter = _Rewriter(work, info, defined, base, scratch)
    try:
        with tqdm(total=len(entries), desc="encodings → Q/DQ", unit="tensor", leave=False, disable=None) as bar:
            queue = collections.deque(entries)
            del entries  # a 7B model's scale grids are GBs of Python-held arrays: drop each once written
            while queue:
                rewriter.insert(queue.popleft(), prequantize_constants)
                bar.update()
    finally:
        if scratch is not None:
            scratch.close()
    rewriter.finish()
    props = [p for p in work.metadata_props if p.key not in ("producer", EXTERNAL_BASE_KEY)]
    del work.metadata_props[:]
    work.metadata_props.extend(props)
    work.metadata_props.add(key="producer", value="onnxport")
    if base is not None and _has_external(work):
        work.metadata_props.add(key=EXTERNAL_BASE_KEY, value=str(base.resolve()))
    _check(work, base)
    if parsed.omitted:
        names = sorted(parsed.omitted)
        warnings.warn(
            f"float16/bfloat16 are plain casts, not quantization, and ONNX Q/DQ has no form for them: "
            f"omitted {len(names)} encoding(s): {names[:8]}{' …' if len(names) > 8 else ''}.",
            OmittedEncodingsWarning,
            stacklevel=2,
        )
    return work


def _check(model: onnx.ModelProto, base: Path | None) -> None:
    """onnx.checker on the result, without reading weights that were never loaded.

    The checker insists on reading an external file beside the model; unloaded weights are
    checked instead when the result is saved (``save_model`` checks the written file).
    """
    if not _has_external(model):
        _checked(model)
        return
    shell = onnx.ModelProto()
    shell.CopyFrom(model)
    for graph in walk_graphs(shell.graph):
        for tensor in graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.dims[:]
                tensor.dims.append(0)
                tensor.raw_data = b""
    _checked(shell)


def _checked(model: onnx.ModelProto) -> None:
    """onnx.checker, bodies included (their order too); a model it rejects is never returned.
    (Not its shape inference: a user's model need not pass that to be converted exactly.)"""
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ExportRefusedError(
            f"The converted model does not pass onnx.checker, so it was not returned: "
            f"{str(error).strip().splitlines()[0]} This is a defect in onnxport's conversion; please report it "
            f"with the model and encodings."
        ) from error


def _has_external(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for g in walk_graphs(model.graph) for t in g.initializer)
