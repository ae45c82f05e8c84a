"""One read-side view of the Q/DQ nodes of an ONNX file: what every reader of a file needs.

``qdq_stats``, ``qdq_report``, ``check_target``, the export checks, the weight-only checks and
``onnx_qdq_to_encodings`` all read QuantizeLinear/DequantizeLinear nodes through
:func:`qdq_nodes`. Only the small tensors a caller asks for are read; weights in external data
stay on disk until :meth:`QDQNode.integer_values` is called for one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from .._core.ir import const_tensor, graphs, is_default, label, read_values

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
INT4_TYPES = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


@dataclass(frozen=True)
class QDQNode:
    """One standard-domain QuantizeLinear or DequantizeLinear, with its parameters.

    Attributes:
        node, graph: the ``onnx_ir`` node and the graph (main or a body) it sits in.
        scale: the scale constant; ``None`` when the scale is computed while the graph runs
            (a double-quantized scale is itself a DequantizeLinear output).
        zero_point: the zero-point constant; ``None`` when omitted or computed (see
            :attr:`zero_point_input`).
        integers: for a DequantizeLinear of a constant, the stored integers (a weight or bias).
        kind: ``'constant'`` (the pair quantizes a constant: a weight, or a table the exporter
            folded), ``'bias'`` (a DequantizeLinear of an int32 constant) or ``'activation'``.
    """

    node: ir.Node
    graph: ir.Graph
    scale: ir.TensorProtocol | None
    zero_point: ir.TensorProtocol | None
    integers: ir.TensorProtocol | None
    kind: str

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def name(self) -> str:
        return label(self.node)

    @property
    def input(self) -> ir.Value | None:
        """What the node quantizes or dequantizes."""
        return self.node.inputs[0]

    @property
    def output(self) -> ir.Value:
        return self.node.outputs[0]

    @property
    def zero_point_input(self) -> str:
        """The zero-point's value name; ``''`` when the node omits it."""
        value = self.node.inputs[2] if len(self.node.inputs) >= 3 else None
        return value.name or "" if value is not None else ""

    @property
    def attributes(self) -> dict[str, int]:
        return {name: a.value for name, a in self.node.attributes.items() if a.type == ir.AttributeType.INT}

    @property
    def dtype(self) -> int | None:
        """The ONNX type of the integers: the zero-point's, else the stored constant's, else
        ``output_dtype``; ``None`` when the file does not say."""
        if self.zero_point is not None:
            return int(self.zero_point.dtype)
        if self.integers is not None:
            return int(self.integers.dtype)
        return self.attributes.get("output_dtype") or None

    @property
    def n_scales(self) -> int:
        return int(np.prod(self.scale.shape.numpy(), dtype=np.int64)) if self.scale is not None else 0

    @property
    def per_channel(self) -> bool:
        """More than one scale: per-channel (per-axis) or blocked."""
        return self.n_scales > 1

    @property
    def axis(self) -> int | None:
        """The quantization axis, for per-channel and blocked nodes (``None`` per tensor)."""
        return self.attributes.get("axis", 1) if self.per_channel or self.block_size else None

    @property
    def block_size(self) -> int:
        return self.attributes.get("block_size", 0)

    @property
    def int4(self) -> bool:
        types = {self.dtype, int(self.integers.dtype) if self.integers is not None else None}
        return bool(types & set(INT4_TYPES))

    def scale_values(self) -> np.ndarray:
        assert self.scale is not None, "the scale is computed at run time"
        return read_values(self.scale)

    def zero_point_values(self) -> np.ndarray | None:
        return None if self.zero_point is None else read_values(self.zero_point)

    def integer_values(self) -> np.ndarray:
        assert self.integers is not None, "only a DequantizeLinear of a constant stores integers"
        return read_values(self.integers)


def qdq_nodes(model: ir.Model) -> list[QDQNode]:
    """Every standard-domain Q/DQ node of ``model``, If/Loop/Scan bodies included, in graph order."""
    found = []
    for graph in graphs(model):
        for node in graph:
            if node.op_type not in QDQ_OPS or not is_default(node):
                continue
            source = const_tensor(node.inputs[0])
            if source is None:
                quantizer = node.inputs[0].producer() if node.inputs[0] is not None else None
                of_constant = (quantizer is not None and quantizer.op_type == "QuantizeLinear"
                               and const_tensor(quantizer.inputs[0]) is not None)
                kind = "constant" if of_constant else "activation"  # Q(constant) -> DQ is how QAT graphs store weights
            elif node.op_type == "DequantizeLinear" and source.dtype == ir.DataType.INT32:
                kind = "bias"
            else:
                kind = "constant"
            zero_point = node.inputs[2] if len(node.inputs) >= 3 else None
            found.append(QDQNode(
                node, graph, _parameter(node.inputs[1] if len(node.inputs) > 1 else None),
                _parameter(zero_point), source if node.op_type == "DequantizeLinear" else None, kind,
            ))
    return found


def _parameter(value: ir.Value | None) -> ir.TensorProtocol | None:
    """A scale or zero-point constant, also when the exporter left it as a ``Cast`` of a constant
    (its constant folding stops at a size limit: a 32,000-channel weight's zero-points)."""
    tensor = const_tensor(value)
    if tensor is not None or value is None:
        return tensor
    cast = value.producer()
    if cast is None or cast.op_type != "Cast" or not is_default(cast) or (source := const_tensor(cast.inputs[0])) is None:
        return None
    to = ir.DataType(cast.attributes["to"].value)
    return ir.tensor(read_values(source).astype(to.numpy()), name=value.name)
