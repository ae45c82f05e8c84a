"""``encodings_to_onnx_qdq``: an ONNX model plus AIMET encodings → an ONNX Q/DQ model, exactly."""

from __future__ import annotations

import collections
import copy
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import CheckerPass, TopologicalSortPass
from tqdm.auto import tqdm

from .._core.io import EXTERNAL_BASE_KEY, ScratchTensors, check_external_data, inside_folder, read_onnx
from .._core.ir import (
    const_tensor,
    drop_unread_constants,
    graphs,
    is_default,
    label,
    opset_of,
    read_model,
    read_values,
    taken_names,
    tensors,
    unique_name,
)
from ..errors import ExportRefusedError, InvalidArgumentError, OnnxportWarning
from .axes import TensorInfo, resolve
from .derive import Move, derive_encodings, moved_parameter
from .formats import (
    DTYPES,
    ENCODES_MARK,
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

FORCE_CHOICES = ("unsigned", "signed", None)

_REJECTED_FLOATS = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16", ir.DataType.DOUBLE: "float64"}


class OmittedEncodingsWarning(OnnxportWarning):
    """float16/bfloat16 entries are plain casts with no Q/DQ form; they were left out."""


# -- the model -------------------------------------------------------------------------------------
def _load_model(model: Any) -> tuple[ir.Model, onnx.ModelProto, Path | None]:
    """The model to rewrite (weights in external data stay on disk: only names and shapes are
    needed), the proto it was read from (for shape inference), and its external data's folder."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        proto = read_onnx(path, "model")  # read once: the ir model below wraps its tensors
        check_external_data(proto, path.parent)  # a truncated .data file fails here, before any work
        work, base = read_model(proto, "model", base=path.parent)
        return work, proto, base
    if isinstance(model, onnx.ModelProto):
        work, base = read_model(model, "model")  # wraps the proto's tensors; the proto is never edited
        return work, model, base
    raise InvalidArgumentError(f"model must be an onnx.ModelProto or a path to an .onnx file, not {type(model).__name__}.")


def _float_gate(model: ir.Model) -> None:
    """Only float32 graphs: a float16/bfloat16/float64 tensor anywhere (subgraphs too) is refused."""

    def refuse(what: str, dtype: ir.DataType) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"encodings_to_onnx_qdq converts float32 models, and {what} is {_REJECTED_FLOATS[dtype]}; "
            f"convert the model to float32 first."
        )

    for graph in graphs(model):
        computed = [v for node in graph for v in node.outputs]
        for value in [*graph.inputs, *graph.outputs, *computed]:
            if value.dtype in _REJECTED_FLOATS:
                raise refuse(f"tensor '{value.name}'", value.dtype)
        for value in graph.initializers.values():
            if value.const_value is not None and value.const_value.dtype in _REJECTED_FLOATS:
                raise refuse(f"initializer '{value.name}'", value.const_value.dtype)
        for node in graph:
            to = node.attributes.get_int("to") if node.op_type == "Cast" else None
            if to is not None and ir.DataType(to) in _REJECTED_FLOATS:
                raise refuse(f"the output of Cast node '{label(node)}'", ir.DataType(to))
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and attr.value.dtype in _REJECTED_FLOATS:
                    raise refuse(f"the value of {node.op_type} node '{label(node)}'", attr.value.dtype)


def _inferred(proto: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...] | None, int | None]]:
    """(static dims or None, element type) of the values onnx's shape inference can tell."""
    try:
        graph = onnx.shape_inference.infer_shapes(proto, strict_mode=False).graph
    except Exception:  # noqa: BLE001 -- shape inference is a help for checks, never a requirement
        return {}
    found = {}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        tensor_type = value.type.tensor_type
        dims = None
        if tensor_type.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
            dims = None if any(d < 0 for d in dims) else dims
        found[value.name] = (dims, tensor_type.elem_type or None)
    return found


def _static(value: ir.Value) -> tuple[int, ...] | None:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _index(
    model: ir.Model, inferred: dict[str, tuple[tuple[int, ...] | None, int | None]],
) -> tuple[dict[str, TensorInfo], dict[str, list[tuple[ir.Node, int]]], dict[str, list[TensorInfo]]]:
    """Every tensor the encodings may name (subgraphs included), who reads each one, and — for
    names computed in several bodies (an If's two branches may reuse a name) — every definition."""
    info: dict[str, TensorInfo] = {}
    readers: dict[str, list[tuple[ir.Node, int]]] = {}
    defined: dict[str, list[TensorInfo]] = {}
    for graph in graphs(model):
        for value in graph.initializers.values():
            tensor = value.const_value
            dims = tuple(int(d) for d in tensor.shape) if tensor is not None else _static(value)
            elem = int(tensor.dtype) if tensor is not None else (int(value.dtype) if value.dtype else None)
            info[value.name] = TensorInfo(value.name, value, graph, True, dims, elem)
        for value in graph.inputs:
            if value.name not in info:
                info[value.name] = TensorInfo(value.name, value, graph, False, _static(value),
                                              int(value.dtype) if value.dtype else None)
        for node in graph:
            for index, value in enumerate(node.inputs):
                if value is not None and value.name:
                    readers.setdefault(value.name, []).append((node, index))
            if node.op_type == "Constant" and is_default(node) and (tensor := const_tensor(node.outputs[0])) is not None:
                out = node.outputs[0]
                info[out.name] = TensorInfo(out.name, out, graph, True, tuple(int(d) for d in tensor.shape), int(tensor.dtype))
                continue
            for value in node.outputs:
                if not value.name:
                    continue
                dims, elem = _static(value), int(value.dtype) if value.dtype else None
                if value.shape is None or elem is None:
                    known_dims, known_elem = inferred.get(value.name, (None, None))
                    dims = dims if value.shape is not None else known_dims
                    elem = elem if elem is not None else known_elem
                entry = TensorInfo(value.name, value, graph, False, dims, elem)
                defined.setdefault(value.name, []).append(entry)
                info.setdefault(value.name, entry)
    return info, readers, defined


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


def _constant_rows(tensor: ir.TensorProtocol) -> RowReader:
    """A reader of rows ``[a, b)`` (along axis 0) of a constant, as float32.

    A float32 weight in external data is read straight from its file a slice at a time, so a
    weight never needs more than its own size in memory, and the model never needs its total.
    """
    if isinstance(tensor, ir.ExternalTensor) and tensor.dtype == ir.DataType.FLOAT and tensor.shape.rank():
        file = inside_folder(Path(tensor.base_dir), tensor.location, tensor.name)  # confined like every read
        offset = tensor.offset or 0
        shape = tuple(int(d) for d in tensor.shape[1:])
        row = int(np.prod(shape, dtype=np.int64))

        def read(a: int, b: int) -> np.ndarray:
            values = np.fromfile(file, dtype="<f4", count=(b - a) * row, offset=offset + a * row * 4)
            return values.reshape((b - a, *shape))

        return read
    values = read_values(tensor).astype(np.float32, copy=False)
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
    """Inserts each encoding's Q/DQ nodes into the ``ir.Model``: new constants as initializers of
    the graph that holds the tensor (on disk, in scratch, when the model's weights are), readers
    rewired through the value's uses (bodies included), graph outputs keeping their names."""

    def __init__(self, model: ir.Model, info: dict[str, TensorInfo], defined: dict[str, list[TensorInfo]],
                 scratch: ScratchTensors | None) -> None:
        self.model = model
        self.info = info
        self.defined = defined
        self.scratch = scratch
        self.taken = taken_names(model) | {v.name for g in graphs(model) for v in g.initializers.values()}
        self.replaced: list[ir.Value] = []

    def name(self, base: str) -> str:
        return unique_name(base, self.taken)

    def add_init(self, graph: ir.Graph, base: str, values: np.ndarray, *, replaces_external: bool = False) -> ir.Value:
        """A new initializer; on disk (scratch) when the model's weights are, for a weight that
        replaces one read from external data or any tensor of ``_SCRATCH_BYTES`` or more."""
        name = self.name(base)
        values = np.asarray(values)
        if self.scratch is not None and (replaces_external or values.nbytes >= _SCRATCH_BYTES):
            tensor = self.scratch.put(name, values)  # stays on disk, like the weights
        else:
            tensor = ir.tensor(values, name=name)
        value = ir.Value(name=name, shape=ir.Shape(values.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        graph.register_initializer(value)
        return value

    def scale_input(self, graph: ir.Graph, entry: Encoding, nodes: list[ir.Node]) -> ir.Value:
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
        attrs = {}
        if meta.x_scale.size > 1:
            attrs["axis"] = meta.axis
        if meta.block_size:
            attrs["block_size"] = meta.block_size
        out = ir.Value(name=self.name(f"{entry.name}_scale"))
        nodes.append(ir.node("DequantizeLinear", [x, x_scale, x_zp], attrs, outputs=[out],
                             name=self.name(f"{entry.name}_scale_dq")))
        return out

    def insert(self, entry: Encoding, prequantize: bool) -> None:
        for info in self.defined.get(entry.name) or [self.info[entry.name]]:
            self._insert_in(entry, info, prequantize)

    def _insert_in(self, entry: Encoding, info: TensorInfo, prequantize: bool) -> None:
        graph, value = info.graph, info.value
        nodes: list[ir.Node] = []
        scale = self.scale_input(graph, entry, nodes)
        zp_shape = np.shape(entry.scale) if entry.meta is None else entry.meta.x.shape
        zp_values = np.zeros(zp_shape, np.int64) if entry.zero_point is None else entry.zero_point
        zp = self.add_init(graph, f"{entry.name}_zero_point", _typed(zp_values, entry.dtype))
        attrs: dict[str, int] = {}
        if entry.axis is not None and (entry.block_size or np.size(zp_values) > 1):
            attrs["axis"] = entry.axis
        if entry.block_size:
            attrs["block_size"] = entry.block_size
        mark = f"{ENCODES_MARK}{entry.name}"
        if info.is_constant and (prequantize or entry.dtype == "int32"):
            tensor = const_tensor(value)
            shape = tuple(int(d) for d in tensor.shape)
            quantized = quantize_rows(_constant_rows(tensor), shape, entry, entry.effective_scale())
            stored = self.add_init(graph, f"{entry.name}_q", quantized, replaces_external=isinstance(tensor, ir.ExternalTensor))
            dequantized = ir.Value(name=self.name(f"{entry.name}_qdq"))
            nodes.append(ir.node("DequantizeLinear", [stored, scale, zp], attrs, outputs=[dequantized],
                                 name=self.name(f"{entry.name}_dq"), doc_string=mark))
            self.replaced.append(value)
            quantizer = None
        else:
            if entry.dtype == "int32":
                raise InvalidArgumentError(
                    f"Encoding of '{entry.name}': int32 is dequantize-only (a bias stored prequantized), but "
                    f"'{entry.name}' is not a constant."
                )
            # A graph output keeps its name: the producer's value is renamed and the DQ takes the name.
            output = value in graph.outputs
            out_name = entry.name if output else self.name(f"{entry.name}_qdq")
            if output:
                value.name = self.name(f"{entry.name}_float")
            quantized_value = ir.Value(name=self.name(f"{entry.name}_q"))
            quantizer = ir.node("QuantizeLinear", [value, scale, zp], attrs, outputs=[quantized_value],
                                name=self.name(f"{entry.name}_q"))
            # typed like the tensor it stands for: a graph output must say its type
            dequantized = ir.Value(name=out_name, type=value.type,
                                   shape=value.shape.copy() if value.shape is not None else None)
            nodes += [quantizer, ir.node("DequantizeLinear", [quantized_value, scale, zp], attrs, outputs=[dequantized],
                                         name=self.name(f"{entry.name}_dq"), doc_string=mark)]
        for user, index in list(value.uses()):
            if user is not quantizer:
                user.replace_input_with(index, dequantized)
        if quantizer is not None and dequantized.name == entry.name:
            for position, out in enumerate(graph.outputs):
                if out is value:
                    graph.outputs[position] = dequantized
        graph.extend(nodes)

    def finish(self) -> None:
        """Drop the float constants the prequantized ones replaced (where nothing reads them any
        more) and put every graph in topological order."""
        drop_unread_constants(self.replaced)
        TopologicalSortPass()(self.model)


def _narrowest(values: np.ndarray) -> str:
    dtype = smallest_integer_type(values)
    assert dtype is not None, "parse_encodings checks that a double-quantized scale fits an integer type"
    return dtype


# -- outlines --------------------------------------------------------------------------------------------
#: An entry whose values take more than this is held as an outline until it is written: a 7B
#: model's int4 block grids are 210 MB of float32, more than the rest of the conversion needs.
_OUTLINE_BYTES = 1 << 16


def _arrays(entry: Encoding) -> list[np.ndarray]:
    meta = [entry.meta.x, entry.meta.x_scale, entry.meta.x_zero_point] if entry.meta is not None else []
    return [np.asarray(a) for a in (entry.scale, entry.zero_point, *meta) if a is not None]


def _stand_in(values: np.ndarray | None) -> np.ndarray | None:
    """An array of ``values``' shape and type that holds one element (all strides 0)."""
    if values is None:
        return None
    values = np.asarray(values)
    return np.broadcast_to(np.zeros((), values.dtype), values.shape)


def _outline(entry: Encoding) -> Encoding:
    """``entry`` with every array replaced by its stand-in: what the opset, the derivation and the
    checks read (shapes, types, axes), without the values. A double-quantized scale's integer type
    is settled here, from the values, as ``required_opset`` needs it."""
    meta = entry.meta
    if meta is not None:
        meta = copy.copy(meta)
        # set directly: ScaleMeta's __post_init__ would make the stand-ins whole arrays again
        for key in ("x", "x_scale", "x_zero_point"):
            object.__setattr__(meta, key, _stand_in(getattr(entry.meta, key)))
        object.__setattr__(meta, "x_dtype", entry.meta.x_dtype or _narrowest(entry.meta.x))
    return entry.with_(scale=_stand_in(entry.scale), zero_point=_stand_in(entry.zero_point), meta=meta, outlined=True)


class _SetAside:
    """Large entries' values, written to an unnamed temporary file as the encodings are read, and
    read back one entry at a time when it is written (with the weights moved from it, by the same
    moves as its outline). The file's pages are the kernel's cache, not this process's memory."""

    def __init__(self) -> None:
        # held for the conversion's length and closed by __exit__: the class is the context manager
        self.file = tempfile.TemporaryFile(prefix="onnxport-encodings-")  # noqa: SIM115
        self.where: dict[str, dict[str, tuple[int, np.dtype, tuple[int, ...]]]] = {}
        self.moves: dict[str, list[Move]] = {}  # filled by the derivation

    def __enter__(self) -> _SetAside:  # noqa: PYI034 -- a private class with no subclasses
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def put(self, entry: Encoding) -> Encoding:
        """Write ``entry``'s arrays; its outline in return."""
        meta = entry.meta
        arrays = {"scale": entry.scale, "zero_point": entry.zero_point}
        if meta is not None:
            arrays.update(x=meta.x, x_scale=meta.x_scale, x_zero_point=meta.x_zero_point)
        record = {}
        for key, values in arrays.items():
            if values is not None:
                values = np.ascontiguousarray(values)
                record[key] = (self.file.tell(), values.dtype, values.shape)
                self.file.write(values.tobytes())
        self.where[entry.name] = record
        return _outline(entry)

    def _read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        raw = os.pread(self.file.fileno(), count * dtype.itemsize, offset)
        return np.frombuffer(bytearray(raw), dtype, count).reshape(shape)

    def values(self, outline: Encoding) -> list[Encoding]:
        """The entry ``outline`` stands for, then the weights moved from it."""
        self.file.flush()
        read = {key: self._read(*where) for key, where in self.where.pop(outline.name).items()}
        meta = outline.meta
        if meta is not None:
            meta = copy.copy(meta)
            for key in ("x", "x_scale", "x_zero_point"):
                object.__setattr__(meta, key, read.get(key))
        full = [outline.with_(scale=read.get("scale"), zero_point=read.get("zero_point"), meta=meta, outlined=False)]
        for source in full:  # grows as it goes: a moved weight can be moved again
            full += [moved_parameter(node, source, before, after, name)
                     for node, before, after, name in self.moves.get(source.name, ())]
        return full


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


class RaiseOpsetPass(ir.passes.InPlacePass):
    """Raise the default-domain opset to ``need`` with ONNX's version converter (on the model's
    header: weights left on disk stay there and keep their folder); the model takes the converted
    graph. A model already there is left alone. Never lowers (``passes.lower_opset`` does that,
    for exporters)."""

    def __init__(self, need: int) -> None:
        super().__init__()
        self.need = need

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        current = opset_of(model)
        if current >= self.need:
            return ir.passes.PassResult(model, False)
        folders = {t.name: t.base_dir for t in tensors(model) if isinstance(t, ir.ExternalTensor)}
        try:
            upgraded = ir.from_proto(onnx.version_converter.convert_version(ir.to_proto(model), self.need))
        except Exception as error:
            raise InvalidArgumentError(
                f"These encodings need opset {self.need}, and ONNX's version converter could not raise this model "
                f"from opset {current}: {error}"
            ) from error
        for tensor in tensors(upgraded):
            if isinstance(tensor, ir.ExternalTensor):
                tensor.base_dir = folders.get(tensor.name, "")
        model.graph, model.ir_version = upgraded.graph, upgraded.ir_version  # the opset imports are the graph's
        model.functions.clear()
        model.functions.update(upgraded.functions)
        return ir.passes.PassResult(model, True)

    def ensures(self, model: ir.Model) -> None:
        if opset_of(model) < self.need:
            raise ir.passes.PostconditionError(f"the model declares opset {opset_of(model)}, below {self.need}")


class InsertEncodingsPass(ir.passes.InPlacePass):
    """Insert the Q/DQ nodes of ``entries`` (resolved encodings, consumed as they are written:
    a 7B model's scale grids are GBs of arrays), each where its tensor is defined, and sort the
    graphs. A tensor already carrying its encoding (a DequantizeLinear marked as encoding it) is
    left alone, so a second run changes nothing. ``scratch`` holds new large constants on disk.
    ``values`` gives an outlined entry's values back (from where the converter set them aside)
    when its turn comes: only one large entry's values are held at a time."""

    def __init__(self, entries: collections.deque, *, prequantize: bool, scratch: ScratchTensors | None,
                 index: Callable[[ir.Model], tuple] | None = None,
                 values: Callable[[Encoding], list[Encoding]] | None = None) -> None:
        super().__init__()
        self.entries, self.prequantize, self.scratch, self.index = entries, prequantize, scratch, index
        self.values = values  # an outlined entry → its full entries to write (itself, then its moved weights)

    def requires(self, model: ir.Model) -> None:
        need = required_opset(list(self.entries))
        if opset_of(model) < need:
            raise ir.passes.PreconditionError(f"these encodings need opset {need}; run RaiseOpsetPass({need}) first")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        info, _, defined = self.index(model) if self.index is not None else _index(model, {})
        encoded = {n.doc_string[len(ENCODES_MARK):] for n in _all_nodes(model) if n.doc_string and n.doc_string.startswith(ENCODES_MARK)}
        rewriter = _Rewriter(model, info, defined, self.scratch)
        modified = False
        with tqdm(total=len(self.entries), desc="encodings → Q/DQ", unit="tensor", leave=False, disable=None) as bar:
            while self.entries:
                entry = self.entries.popleft()
                if entry.outlined and self.values is None:
                    raise ValueError(f"the encoding of '{entry.name}' is an outline, and the pass was given no values for it")
                for full in self.values(entry) if entry.outlined else [entry]:
                    if full.name not in encoded:
                        rewriter.insert(full, self.prequantize)
                        modified = True
                bar.update()
        if modified:
            rewriter.finish()
        return ir.passes.PassResult(model, modified)


def _all_nodes(model: ir.Model):
    for graph in graphs(model):
        yield from graph


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

    if force_activation_as not in FORCE_CHOICES:
        raise InvalidArgumentError(
            f"force_activation_as must be 'unsigned', 'signed' or None, not {force_activation_as!r}."
        )
    data = load_encodings(encodings)
    work, proto, base = _load_model(model)  # names and shapes only: weights stay on disk
    info, readers, defined = _index(work, _inferred(proto))

    def prepare(entry: Encoding) -> Encoding:
        """An entry as it will be written: its axis and blocks resolved against the graph, re-signed."""
        tensor = info.get(entry.name)
        if tensor is None:
            return entry  # a node's name: refused below, with every such name
        if tensor.elem_type not in (None, 0, onnx.TensorProto.FLOAT):
            kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
            raise InvalidArgumentError(f"Encoding of '{entry.name}': the tensor is {kind}, and only float tensors can be quantized.")
        entry = resolve(entry, tensor, readers.get(entry.name, []), allow_subnormal=allow_subnormal_scales)
        if not (tensor.is_constant or entry.section == "param"):
            entry = _force(entry, force_activation_as)
        return entry

    aside = _SetAside()

    def outline_large(entry: Encoding) -> Encoding:
        entry = prepare(entry)
        # a per-tensor entry is a few bytes, and the derivation compares its values
        large = entry.n_scales > 1 and sum(a.nbytes for a in _arrays(entry)) > _OUTLINE_BYTES
        return aside.put(entry) if large else entry

    with aside:
        # The whole file is read and checked before the graph is touched (a name the model lacks is
        # refused before values are read); large entries' values are set aside until written.
        _float_gate(work)
        parsed = parse_encodings(data, allow_subnormal_scales=allow_subnormal_scales, known=_names(work), prepare=outline_large)
        missing = sorted(e.name for e in parsed.entries if e.name not in info)
        if missing:  # a node's or an op's name, not a tensor's
            raise InvalidArgumentError(f"The encodings name tensor(s) the model does not have: {missing}.")
        entries, parsed.entries = parsed.entries, []
        if derive_data_movement:
            # a weight moved from an outline is an outline too: written from its source's values
            entries += [e for e in derive_encodings(work, {e.name: e for e in entries}, info, aside.moves) if not e.outlined]
        raised = RaiseOpsetPass(required_opset(entries))(work)
        # A model whose weights stay on disk gets its new large tensors (prequantized weights, 7B-scale
        # scale grids) on disk too, in a scratch file that save_model copies from.
        on_disk = base is not None and any(isinstance(t, ir.ExternalTensor) for t in tensors(work))
        scratch = ScratchTensors() if on_disk else None
        # the index of the model as read, unless the opset raise made a new one (its shapes inferred again)
        index = ((lambda m: _index(m, _inferred(ir.to_proto(m)))) if raised.modified else (lambda m: (info, readers, defined)))
        queue = collections.deque(entries)
        del entries  # each entry is held once: the pass drops it once written
        try:
            InsertEncodingsPass(queue, prequantize=prequantize_constants, scratch=scratch, index=index,
                                values=aside.values)(work)
        finally:
            if scratch is not None:
                scratch.close()
    work.metadata_props.pop(EXTERNAL_BASE_KEY, None)
    work.metadata_props.pop("producer", None)
    work.metadata_props["producer"] = "onnxport"
    on_disk = base is not None and any(isinstance(t, ir.ExternalTensor) for t in tensors(work))
    if on_disk:
        work.metadata_props[EXTERNAL_BASE_KEY] = str(base.resolve())
    _check(work)
    result = ir.to_proto(work)
    if scratch is not None:
        scratch.mark(result)
    if parsed.omitted:
        names = sorted(parsed.omitted)
        warnings.warn(
            f"float16/bfloat16 are plain casts, not quantization, and ONNX Q/DQ has no form for them: "
            f"omitted {len(names)} encoding(s): {names[:8]}{' …' if len(names) > 8 else ''}.",
            OmittedEncodingsWarning,
            stacklevel=2,
        )
    return result


def _names(model: ir.Model) -> set[str]:
    """Every value, node and initializer name used anywhere in the model."""
    names = taken_names(model) | {v.name for g in graphs(model) for v in g.initializers.values()}
    names.discard("")
    return names


def _check(model: ir.Model) -> None:
    """onnx.checker on the result, bodies included (their order too), without reading weights
    left on disk (onnx_ir's ``CheckerPass`` checks the graph with its initializers set aside;
    ``save_model`` checks the written file, weights and all). A model it rejects is never
    returned. (Not its shape inference: a user's model need not pass that to be converted exactly.)"""
    # Weights on disk are set aside as CheckerPass sets aside large ones: the checker would look
    # for their files beside the working directory.
    on_disk = [(v, v.const_value) for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    try:
        for value, _ in on_disk:
            value.const_value = None
        CheckerPass()(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise ExportRefusedError(
            f"The converted model does not pass onnx.checker, so it was not returned: "
            f"{str(error).strip().splitlines()[0]} This is a defect in onnxport's conversion; please report it "
            f"with the model and encodings."
        ) from error
    finally:
        for value, tensor in on_disk:
            value.const_value = tensor
