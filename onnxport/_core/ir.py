"""The one graph layer: ``onnx_ir`` helpers shared by the passes and the readers of files.

Reading a file goes through :func:`read_model` (weights stay on disk as lazy external tensors,
confined to the model's folder); passes and readers walk values and their producers and uses,
never protobuf fields. :func:`on_proto` is the one bridge for callers that hold an
``onnx.ModelProto``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from ..errors import InvalidArgumentError
from . import io as _io
from .io import (
    BASEPATH_KEY,
    EXTERNAL_BASE_KEY,
    EXTERNAL_SIZE_THRESHOLD,
    check_external_data,
    external_folder,
    has_unloaded_external_data,
    read_onnx,
)

DEFAULT_DOMAINS = ("", "ai.onnx")
#: ONNX Runtime's contrib operators (Gelu, GroupQueryAttention, SkipSimplifiedLayerNormalization, …).
CONTRIB_DOMAIN = "com.microsoft"
#: Ops that carry a weight from its constant to its reader without changing its shape.
PASS_THROUGH = ("DequantizeLinear", "QuantizeLinear", "Cast", "Identity")


def is_default(node: ir.Node) -> bool:
    return node.domain in DEFAULT_DOMAINS


def nodes(model: ir.Model):
    """Every node of the model: the main graph, If/Loop/Scan bodies, and function bodies."""
    yield from ir.traversal.RecursiveGraphIterator(model.graph)
    for function in model.functions.values():
        yield from ir.traversal.RecursiveGraphIterator(function)


def graph_nodes(model: ir.Model):
    """Every node of the main graph and its If/Loop/Scan bodies, not of functions: for a rewrite that
    adds initializers, which a function cannot hold (onnx_ir gives a function's nodes an
    ``ir.Graph`` too, so ``node.graph`` does not tell them apart)."""
    yield from ir.traversal.RecursiveGraphIterator(model.graph)


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


def last_axis_bias(add: ir.Node) -> tuple[ir.Value, np.ndarray] | None:
    """(``y``, the bias as 1-D) when ``add`` is a default-domain ``y + bias``: ``y`` computed with a
    known last dim, ``bias`` a float32 constant along that axis only (a linear's bias, at any rank)."""
    if add.op_type != "Add" or not is_default(add) or len(add.inputs) != 2:
        return None
    for index in (0, 1):
        y, values = add.inputs[1 - index], const_array(add.inputs[index])
        dims = y.shape.dims if y is not None and y.shape is not None else ()
        if values is None or values.ndim < 1 or values.dtype != np.float32 or not dims or const_array(y) is not None:
            continue
        last = dims[-1]
        if isinstance(last, int) and values.shape[-1] == last and values.size == last:
            return y, values.reshape(-1)
    return None


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


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values, two per byte, the first in the low nibble (ONNX's int4 layout and MatMulNBits'
    blobs alike), flat; an odd count is padded with a zero nibble."""
    flat = values.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_nibbles(packed: np.ndarray, count: int | None = None) -> np.ndarray:
    """The inverse of :func:`pack_nibbles` along the last axis: each byte's low nibble, then its
    high one, as unsigned values; the first ``count`` of each row (all when None)."""
    values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return values if count is None else values[..., :count]


def register_constant(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType | None = None) -> ir.Value:
    """A new initializer of ``graph`` holding ``array`` (as ``dtype`` when given)."""
    tensor: ir.TensorProtocol
    if dtype == ir.DataType.INT4:
        # Packed now: held one value per byte until saving, an LLM's weights would cost twice.
        tensor = ir.PackedTensor(pack_nibbles(array), dtype, shape=ir.Shape(array.shape), name=name)
    else:
        tensor = ir.tensor(array, dtype=dtype, name=name)
    value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
    graph.register_initializer(value)
    return value


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


# -- reading files -------------------------------------------------------------------------------
def read_model(
    source: str | os.PathLike | onnx.ModelProto, argument: str = "onnx_path", *, base: str | os.PathLike | None = None,
) -> tuple[ir.Model, Path | None]:
    """``source`` as an ``ir.Model`` for reading, and the folder its external data lives in.

    A path is read with :func:`onnxport._core.io.read_onnx` (named errors for missing, corrupt or
    unsafe files); a proto is wrapped without copying its tensors. Weights in external data stay
    on disk: an ``ir.ExternalTensor`` reads its bytes only when :func:`read_values` asks, from the
    model's folder or — for tensors a conversion spilled — onnxport's own scratch folder (any
    other ``basepath`` is refused here, before a byte is read). ``base``: the folder a proto's
    external data lives in, when the caller read it from a file (else the folder its
    ``onnxport.external_data_dir`` metadata names, if any).
    """
    if isinstance(source, onnx.ModelProto):
        if base is None:
            base = next((p.value for p in source.metadata_props if p.key == EXTERNAL_BASE_KEY), None)
        proto, base = source, Path(base) if base is not None else None
    else:
        proto, base = read_onnx(source, argument), Path(source).parent
    folders: dict[str, Path] = {}
    for tensor in onnx.external_data_helper._get_all_tensors(proto):  # initializers and attributes, bodies too
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            own = any(e.key == BASEPATH_KEY for e in tensor.external_data)
            if own or base is not None:
                folders[tensor.name] = external_folder(tensor, base)
    model = ir.from_proto(proto)
    for loaded in tensors(model):
        if isinstance(loaded, ir.ExternalTensor):
            folder = folders.get(loaded.name)
            loaded.base_dir = str(folder) if folder is not None else ""
    return model, base


def tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    """Every constant tensor: initializers and tensor attributes, bodies included (data not loaded)."""
    for graph in graphs(model):
        yield from (v.const_value for v in graph.initializers.values() if v.const_value is not None)
        for node in graph:
            yield from (a.as_tensor() for a in node.attributes.values() if a.type == ir.AttributeType.TENSOR)


def graphs(model: ir.Model) -> Iterator[ir.Graph]:
    """The main graph, then every If/Loop/Scan body (bodies of bodies too)."""
    yield model.graph
    yield from model.graph.subgraphs()


def const_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The constant behind ``value`` (an initializer or a ``Constant`` output), data not loaded;
    None when the value is computed or a graph input."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or not is_default(producer):
        return None
    try:
        return ir.convenience.get_const_tensor(value)
    except (ValueError, TypeError):  # a Constant without one value attribute: the checker's business
        return None


def read_values(tensor: ir.TensorProtocol) -> np.ndarray:
    """A constant's values; external data is read from the folder :func:`read_model` confined it to."""
    if isinstance(tensor, ir.ExternalTensor) and not tensor.base_dir:
        raise InvalidArgumentError(
            f"Tensor '{tensor.name}' refers to external data whose folder is unknown; load the model from its "
            f"path (or with onnx.load(path), weights included)."
        )
    if isinstance(tensor, ir.ExternalTensor):
        try:  # a copy, and the file's mapping closed at once: reading every weight holds one at a time
            return np.array(tensor.numpy())
        finally:
            tensor.release()
    return tensor.numpy()


def label(node: ir.Node) -> str:
    """How a node is named in messages: its name, else its op and first output."""
    return node.name or f"{node.op_type}->{node.outputs[0].name if node.outputs else ''}"


def opset_of(model: ir.Model | onnx.ModelProto) -> int:
    """The version of the default ONNX domain a model imports."""
    if isinstance(model, ir.Model):
        version = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    else:
        version = next((e.version for e in model.opset_import if e.domain in DEFAULT_DOMAINS), None)
    if version is None:
        raise InvalidArgumentError(
            "The model imports no default-domain (ai.onnx) opset, so none of its standard operators has a "
            "meaning; add an opset_import entry for domain ''."
        )
    return int(version)


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``… — the first not in ``taken`` (which is updated)."""
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    taken.add(name)
    return name


# -- writing protos ------------------------------------------------------------------------------
def write_model(model: onnx.ModelProto, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write ``model`` to ``path`` with ``ir.save`` (not atomic: use inside ``staged_output``).

    ``model`` is not modified and its weights are not copied in memory. Weights it left on disk
    (a converted model's: its folder is in the ``onnxport.external_data_dir`` metadata, or
    onnxport's scratch) are copied into the file's own data tensor by tensor, whatever their
    size. ``external_data=None`` stores weights in ``<name>.data`` beside the file only when
    they would not fit one protobuf (or are on disk already); ``True``/``False`` force it.
    """
    unloaded = has_unloaded_external_data(model)
    if unloaded:
        check_external_data(model, next((p.value for p in model.metadata_props if p.key == EXTERNAL_BASE_KEY), None))
    work, _ = read_model(model)
    work.metadata_props.pop(EXTERNAL_BASE_KEY, None)
    return save_ir(work, path, external_data=True if unloaded else external_data)


def save_ir(model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None) -> Path:
    """Write an ``onnx_ir`` model with ``ir.save`` (not atomic: use inside ``staged_output``).

    Tensors stream to the file one by one, including lazily loaded external ones, so writing
    costs no copy of the weights. ``external_data=None`` stores weights in ``<name>.data`` beside
    the file only when they would not fit one protobuf (or some are still on disk: they are
    copied into this file's own data, never left pointing elsewhere); ``True`` or ``False``
    forces the choice.
    """
    path = Path(path)
    if external_data is None:
        found = list(tensors(model))
        external_data = (any(isinstance(t, ir.ExternalTensor) for t in found)
                         or sum(t.nbytes for t in found) > _io.EXTERNAL_DATA_BYTES)  # _io's limit, read now
    if not external_data and sum(_inline_bytes(model)) >= STREAM_INLINE_BYTES:
        _save_inline_streamed(model, path)
        return path
    # ir.save moves the tensors above its threshold, onnx those at it too: the same files either way
    ir.save(model, path, external_data=path.name + ".data" if external_data else None,
            size_threshold_bytes=EXTERNAL_SIZE_THRESHOLD - 1)
    return path


#: A single-file model whose main graph's weights reach this is written a weight at a time.
STREAM_INLINE_BYTES = 64 * 2**20


def _inline_bytes(model: ir.Model) -> Iterator[int]:
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            yield value.const_value.nbytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class _NoSkipWarnings:
    """Silences serde's note that an initializer has no value while the weights are set apart."""

    def filter(self, record: object) -> bool:
        return "does not have a constant value set" not in str(getattr(record, "msg", ""))


def _save_inline_streamed(model: ir.Model, path: Path) -> None:
    """Write ``model`` as one protobuf file, its main graph's weights one at a time.

    ``ir.save`` builds the whole ``ModelProto`` and then its serialised bytes: with the model
    itself, three copies of the weights (2 GB at 1.1B int4 parameters). Here the model is written
    without its weights' values, then each weight as a further ``graph`` field holding that one
    initializer: protobuf merges a message field met twice (its repeated fields appended), so
    every reader parses the same model, and only one weight is ever serialised at a time.
    """
    import logging

    from onnx_ir import serde

    values = [v for v in model.graph.initializers.values() if v.const_value is not None]
    held = [v.const_value for v in values]
    quiet = _NoSkipWarnings()
    logger = logging.getLogger(serde.__name__)
    logger.addFilter(quiet)
    try:
        for value in values:
            value.const_value = None
        header = serde.serialize_model(model).SerializeToString()
    finally:
        logger.removeFilter(quiet)
        for value, tensor in zip(values, held):
            value.const_value = tensor
    graph_key, initializer_key = _varint(7 << 3 | 2), _varint(5 << 3 | 2)  # ModelProto.graph, GraphProto.initializer
    with open(path, "wb") as handle:
        handle.write(header)
        for value in values:
            tensor = serde.serialize_tensor(value.const_value)
            tensor.name = value.name
            data = tensor.SerializeToString()
            del tensor
            entry = initializer_key + _varint(len(data))
            handle.write(graph_key + _varint(len(entry) + len(data)) + entry)
            handle.write(data)
            del data
