"""One read-side view of the Q/DQ nodes of an ONNX file: what every reader of a file needs.

``qdq_stats``, ``qdq_report``, ``check_target``, the export checks, the weight-only checks and
``onnx_qdq_to_encodings`` all read QuantizeLinear/DequantizeLinear nodes through
:func:`qdq_nodes`. Only the small tensors a caller asks for are read; weights in external data
stay on disk until :meth:`QDQNode.integer_values` is called for one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .._graph import all_constants, is_default_domain, producers, tensor_value, walk_graphs

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
INT4_TYPES = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


@dataclass(frozen=True)
class QDQNode:
    """One standard-domain QuantizeLinear or DequantizeLinear, with its parameters.

    Attributes:
        node, graph: the node and the graph (main or a body) it sits in.
        scale: the scale constant; ``None`` when the scale is computed while the graph runs
            (a double-quantized scale is itself a DequantizeLinear output).
        zero_point: the zero-point constant; ``None`` when omitted or computed (see
            :attr:`zero_point_input`).
        integers: for a DequantizeLinear of a constant, the stored integers (a weight or bias).
        kind: ``'constant'`` (the pair quantizes a constant: a weight, or a table the exporter
            folded), ``'bias'`` (a DequantizeLinear of an int32 constant) or ``'activation'``.
        base: the folder external data is read from.
    """

    node: onnx.NodeProto
    graph: onnx.GraphProto
    scale: onnx.TensorProto | None
    zero_point: onnx.TensorProto | None
    integers: onnx.TensorProto | None
    kind: str
    base: Path | None = None

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def name(self) -> str:
        return self.node.name or f"{self.node.op_type}->{self.node.output[0]}"

    @property
    def zero_point_input(self) -> str:
        """The zero-point's value name; ``''`` when the node omits it."""
        return self.node.input[2] if len(self.node.input) >= 3 else ""

    @property
    def attributes(self) -> dict[str, int]:
        return {a.name: a.i for a in self.node.attribute if a.type == onnx.AttributeProto.INT}

    @property
    def dtype(self) -> int | None:
        """The ONNX type of the integers: the zero-point's, else the stored constant's, else
        ``output_dtype``; ``None`` when the file does not say."""
        if self.zero_point is not None:
            return self.zero_point.data_type
        if self.integers is not None:
            return self.integers.data_type
        return self.attributes.get("output_dtype") or None

    @property
    def n_scales(self) -> int:
        return int(np.prod(self.scale.dims)) if self.scale is not None else 0

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
        types = {self.dtype, self.integers.data_type if self.integers is not None else None}
        return bool(types & set(INT4_TYPES))

    def scale_values(self) -> np.ndarray:
        assert self.scale is not None, "the scale is computed at run time"
        return tensor_value(self.scale, self.base)

    def zero_point_values(self) -> np.ndarray | None:
        return None if self.zero_point is None else tensor_value(self.zero_point, self.base)

    def integer_values(self) -> np.ndarray:
        assert self.integers is not None, "only a DequantizeLinear of a constant stores integers"
        return tensor_value(self.integers, self.base)


def qdq_nodes(model: onnx.ModelProto, base: str | Path | None = None) -> list[QDQNode]:
    """Every standard-domain Q/DQ node of ``model``, If/Loop/Scan bodies included, in graph order."""
    consts = all_constants(model)
    base = Path(base) if base is not None else None
    found = []
    for graph in walk_graphs(model.graph):
        made_by = producers(graph)
        for node in graph.node:
            if node.op_type not in QDQ_OPS or not is_default_domain(node):
                continue
            source = consts.get(node.input[0])
            zp_name = node.input[2] if len(node.input) >= 3 else ""
            if source is None:
                quantizer = made_by.get(node.input[0])
                of_constant = quantizer is not None and quantizer.op_type == "QuantizeLinear" and quantizer.input[0] in consts
                kind = "constant" if of_constant else "activation"  # Q(constant) -> DQ is how QAT graphs store weights
            elif node.op_type == "DequantizeLinear" and source.data_type == onnx.TensorProto.INT32:
                kind = "bias"
            else:
                kind = "constant"
            found.append(QDQNode(
                node, graph, _parameter(node.input[1], consts, made_by, base),
                _parameter(zp_name, consts, made_by, base) if zp_name else None,
                source if node.op_type == "DequantizeLinear" else None, kind, base,
            ))
    return found


def _parameter(name: str, consts: dict, made_by: dict, base: Path | None) -> onnx.TensorProto | None:
    """A scale or zero-point constant, also when the exporter left it as a ``Cast`` of a constant
    (its constant folding stops at a size limit: a 32,000-channel weight's zero-points)."""
    if name in consts:
        return consts[name]
    cast = made_by.get(name)
    if cast is None or cast.op_type != "Cast" or not is_default_domain(cast) or cast.input[0] not in consts:
        return None
    to = next(a.i for a in cast.attribute if a.name == "to")
    values = tensor_value(consts[cast.input[0]], base)
    return onnx.numpy_helper.from_array(values.astype(onnx.helper.tensor_dtype_to_np_dtype(to)), name)
