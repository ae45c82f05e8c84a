"""``qdq_stats`` and ``qdq_report``: what a Q/DQ file actually contains (weights never loaded)."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from .._core.ir import const_tensor, graphs, is_default, label, opset_of, read_model
from ..errors import InvalidArgumentError
from ..passes.conv_kernel_shape import convs_missing_kernel_shape
from .view import QDQNode, qdq_nodes

#: Operators a convolution's result may pass through before its add (folded or fused epilogues).
_EPILOGUES = ("Relu", "Clip", "BatchNormalization", "HardSwish", "HardSigmoid", "LeakyRelu", "Sigmoid")
_COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass(frozen=True, slots=True)
class QDQStats:
    """Quantization nodes found in an ONNX graph, and the conv→add edges that carry no pair.

    Attributes:
        n_quantize: standard-domain QuantizeLinear nodes (subgraphs included).
        n_dequantize: standard-domain DequantizeLinear nodes.
        n_per_channel: Q/DQ nodes whose scale holds more than one element (per-channel or blocked).
        n_nonzero_zero_point: Q/DQ nodes whose zero-point has any element other than 0.
        n_unquantized_conv_add: Add inputs that read a Conv directly or through its own epilogue
            (ReLU, Clip, BatchNormalization, HardSwish…) — edges with no Q/DQ pair. 0 for a graph
            without any Q/DQ node.
        n_uint8: Q/DQ nodes whose zero-point is uint8.
        n_blocked: Q/DQ nodes with a ``block_size`` (blocked int4/int8 weights, opset 21).
        n_int4: Q/DQ nodes whose integers are int4 or uint4.
        n_dynamic_quantize: DynamicQuantizeLinear nodes (activations quantized at run time).
        n_integer_ops: MatMulInteger and ConvInteger nodes (integer products of run-time
            quantized activations and stored integer weights).
    """

    n_quantize: int
    n_dequantize: int
    n_per_channel: int
    n_nonzero_zero_point: int
    n_unquantized_conv_add: int
    n_uint8: int = 0
    n_blocked: int = 0
    n_int4: int = 0
    n_dynamic_quantize: int = 0
    n_integer_ops: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _producer(value: ir.Value | None) -> ir.Node | None:
    return None if value is None else value.producer()


def _conv_add_edges(graph: ir.Graph) -> int:
    count = 0
    for add in graph:
        if add.op_type != "Add" or not is_default(add):
            continue
        for value in add.inputs:
            node = _producer(value)
            while (node is not None and node.op_type in _EPILOGUES and node.inputs
                   and len(node.outputs[0].uses()) == 1):
                node = _producer(node.inputs[0])
            if node is not None and node.op_type == "Conv":
                count += 1
    return count


def qdq_stats(onnx_path: str | os.PathLike | onnx.ModelProto) -> QDQStats:
    """Count the Q/DQ nodes of an ONNX file and check their scales and zero-points.

    Only the small scale and zero-point tensors are read; weights in external data stay on disk.
    """
    return _stats(read_model(onnx_path)[0])


def _stats(model: ir.Model, nodes: list[QDQNode] | None = None) -> QDQStats:
    counts: Counter[str] = Counter()
    nodes = qdq_nodes(model) if nodes is None else nodes
    for q in nodes:
        counts["q" if q.op_type == "QuantizeLinear" else "dq"] += 1
        if q.scale is None:
            scale = q.node.inputs[1] if len(q.node.inputs) > 1 else None
            raise InvalidArgumentError(
                f"Cannot read the scale of node '{q.name}': '{scale.name if scale is not None else ''}' is not a graph constant."
            )
        counts["per_channel"] += q.per_channel
        counts["blocked"] += bool(q.block_size)
        counts["int4"] += q.int4
        if q.zero_point_input:
            if q.zero_point is None:
                raise InvalidArgumentError(
                    f"Cannot read the zero_point of node '{q.name}': '{q.zero_point_input}' is not a graph constant."
                )
            counts["uint8"] += q.zero_point.dtype == ir.DataType.UINT8
            counts["nonzero"] += bool(np.any(q.zero_point_values() != 0))
    # a float graph has no "unquantized" edges, only float ones
    conv_add = sum(_conv_add_edges(graph) for graph in graphs(model)) if nodes else 0
    ops = Counter(node.op_type for graph in graphs(model) for node in graph if is_default(node))
    return QDQStats(
        counts["q"], counts["dq"], counts["per_channel"], counts["nonzero"], conv_add, counts["uint8"],
        counts["blocked"], counts["int4"], ops["DynamicQuantizeLinear"], ops["MatMulInteger"] + ops["ConvInteger"],
    )


@dataclass(frozen=True)
class ComputeOp:
    """One Conv/ConvTranspose/Gemm/MatMul and whether it runs between Q/DQ pairs."""

    name: str
    op_type: str
    quantized: bool
    why_float: str | None = None


@dataclass(frozen=True)
class QDQReport:
    """What a deployment engineer reads to know why INT8 is slow or rejected."""

    opset: int | None
    stats: QDQStats
    compute_ops: tuple[ComputeOp, ...]
    zero_point_dtypes: dict[str, int]
    missing_kernel_shape: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def float_ops(self) -> tuple[ComputeOp, ...]:
        return tuple(op for op in self.compute_ops if not op.quantized)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stats"] = self.stats.as_dict()
        data["float_ops"] = [asdict(op) for op in self.float_ops]
        return data

    def __str__(self) -> str:
        quantized = sum(op.quantized for op in self.compute_ops)
        lines = [
            (
                f"opset {self.opset}; {self.stats.n_quantize} QuantizeLinear, {self.stats.n_dequantize} "
                f"DequantizeLinear ({self.stats.n_per_channel} per-channel or blocked"
                + (f", {self.stats.n_blocked} blocked" if self.stats.n_blocked else "")
                + (f", {self.stats.n_int4} int4" if self.stats.n_int4 else "") + ")"
                + (f"; run-time quantized: {self.stats.n_dynamic_quantize} DynamicQuantizeLinear, "
                   f"{self.stats.n_integer_ops} MatMulInteger/ConvInteger"
                   if self.stats.n_dynamic_quantize or self.stats.n_integer_ops else "")
            ),
            (f"zero-point types: {', '.join(f'{k} x{v}' for k, v in sorted(self.zero_point_dtypes.items())) or 'none'}; "
            f"non-zero zero-points: {self.stats.n_nonzero_zero_point}"),
            f"compute ops between Q/DQ pairs: {quantized} of {len(self.compute_ops)}",
        ]
        by_type = Counter(op.op_type for op in self.compute_ops if op.quantized)
        total = Counter(op.op_type for op in self.compute_ops)
        lines += [f"  {t:<14} {by_type[t]:>4} / {total[t]}" for t in sorted(total)]
        for op in self.float_ops[:20]:
            lines.append(f"  float: {op.op_type} '{op.name}' — {op.why_float}")
        if len(self.float_ops) > 20:
            lines.append(f"  … and {len(self.float_ops) - 20} more float ops")
        if self.stats.n_unquantized_conv_add:
            lines.append(f"conv→add edges without a pair: {self.stats.n_unquantized_conv_add}")
        if self.missing_kernel_shape:
            lines.append(
                f"Conv without kernel_shape (TensorRT's parser rejects these): {len(self.missing_kernel_shape)}"
            )
        for why, count in self.extra.get("float_elementwise", {}).items():
            lines.append(f"  float (no pair on both operands, so no QLinearAdd/QLinearMul): {why} x{count}")
        ort_counts = self.extra.get("ort_int8")
        if ort_counts:
            runs = ", ".join(f"{op} {c['int8']}/{c['int8'] + c['float']}" for op, c in ort_counts.items())
            lines.append(f"ONNX Runtime (CPU, default level) runs in INT8: {runs}")
        for pattern, count in self.extra.get("ort_costlier_than_float", {}).items():
            lines.append(f"  costlier quantized than in float on ORT's CPU: {pattern} x{count}")
        if self.extra.get("ort_matmul_nbits"):
            lines.append(
                f"ONNX Runtime runs {self.extra['ort_matmul_nbits']} MatMul as MatMulNBits (weight-only int4/int8)"
            )
        cpu = self.extra.get("cpu")
        if cpu:
            recorded = "recorded" if cpu["weight_range_recorded"] else "read from the weights"
            lines.append(f"this CPU: {cpu['machine']}")
            lines.append(f"weight rule: {cpu['weight_range']} ({recorded})")
            beyond = cpu["saturate_without_vnni"]
            if beyond:
                lines.append(f"  {len(beyond)} int8 weight(s) beyond [-64, 64], which x86 U8S8 kernels without VNNI may "
                             f"saturate on (exact with VNNI/AMX or on ARM): {', '.join(beyond[:5])}"
                             + (" …" if len(beyond) > 5 else ""))
        return "\n".join(lines)


def _dequantized(value: ir.Value | None) -> bool:
    producer = _producer(value)
    return producer is not None and producer.op_type == "DequantizeLinear"


def _why_float(node: ir.Node) -> str | None:
    if not _dequantized(node.inputs[0]):
        if len(node.inputs) > 1 and _dequantized(node.inputs[1]):
            return "weight-only: its weight is dequantized, its input stays float"
        if node.op_type == "MatMul" and len(node.inputs) > 1 and node.inputs[1] is not None \
                and const_tensor(node.inputs[1]) is None and _producer(node.inputs[1]) is not None:
            return ("a product of two activations (attention), left float: ONNX Runtime's INT8 form "
                    "(QLinearMatMul, u8 x u8) is not faster than its float MatMul on x86")
        return "its input is not dequantized"
    if len(node.inputs) > 1 and not _dequantized(node.inputs[1]):
        if node.op_type == "MatMul" and node.inputs[1] is not None and node.inputs[1].const_value is None:
            return "its second input is not dequantized"
        return "its weight is not dequantized"
    return None


_ELEMENTWISE = ("Add", "Mul")


def _why_elementwise_float(node: ir.Node) -> str | None:
    """Why an Add/Mul does not run between pairs (ORT's QLinearAdd/QLinearMul need a DQ on both
    operands), or None when it does."""
    reasons = []
    for value in node.inputs[:2]:
        producer = _producer(value)
        if producer is not None and producer.op_type == "DequantizeLinear":
            continue
        if const_tensor(value) is not None or (producer is not None and producer.op_type == "Constant"):
            reasons.append("a float constant operand")
        elif producer is None:
            reasons.append("a float graph input")
        else:
            reasons.append(f"an operand from {producer.op_type} (float)")
    return ", ".join(sorted(set(reasons))) if reasons else None


def qdq_report(onnx_path: str | os.PathLike | onnx.ModelProto, *, ort: bool = True) -> QDQReport:
    """Which Conv/Gemm/MatMul run between Q/DQ pairs and which stay float, zero-point types,
    the opset and the Convs missing ``kernel_shape``.

    With ``ort=True`` (and a file path) it also builds the file in ONNX Runtime and reads the
    graph ORT optimised: ``extra['ort_int8']`` says how many Conv/Gemm/MatMul/Add ORT actually
    runs in INT8 — the figure that explains a speed-up or its absence. ``extra['float_elementwise']``
    counts the Add/Mul left float and why (a float constant operand, an operand from a float op
    such as LayerNormalization): ONNX Runtime runs one in INT8 only with a pair on both operands.
    """
    model, _ = read_model(onnx_path)
    nodes = qdq_nodes(model)
    stats = _stats(model, nodes)
    ops: list[ComputeOp] = []
    zp_types: Counter[str] = Counter()
    missing: list[str] = []
    kept_float: Counter[str] = Counter()
    for graph in graphs(model):
        for node in graph:
            if not is_default(node):
                continue
            if node.op_type in _COMPUTE_OPS:
                why = _why_float(node)
                ops.append(ComputeOp(label(node), node.op_type, why is None, why))
            elif node.op_type in _ELEMENTWISE and (why := _why_elementwise_float(node)):
                kept_float[f"{node.op_type}: {why}"] += 1
        missing += convs_missing_kernel_shape(graph)
    for q in nodes:
        if q.zero_point is not None:
            zp_types[onnx.helper.tensor_dtype_to_np_dtype(int(q.zero_point.dtype)).name] += 1
    opset = opset_of(model)
    extra: dict[str, Any] = {"float_elementwise": dict(kept_float.most_common()), "cpu": _cpu_section(model, nodes)}
    if ort and not isinstance(onnx_path, onnx.ModelProto):
        graph = ort_optimised_graph(onnx_path)
        optimised = Counter(node.op_type for node in graph)
        counts = ort_int8_counts(onnx_path, optimised)
        extra["ort_int8"] = {op: c for op, c in counts.items() if c["int8"] or c["float"]}
        extra["ort_matmul_nbits"] = optimised.get("MatMulNBits", 0)
        extra["ort_costlier_than_float"] = ort_costlier_than_float(graph)
    return QDQReport(opset, stats, tuple(ops), dict(zp_types), tuple(missing), extra)


def _cpu_section(model: ir.Model, nodes: list) -> dict[str, Any]:
    """This CPU's U8S8 arithmetic, the weight rule the file records, and the weights that x86
    kernels without VNNI could saturate on (they compute something else there)."""
    from .._core.cpu import cpu_int8
    from .rules import file_weight_range, weights_beyond_portable

    cpu = cpu_int8()
    beyond = weights_beyond_portable(model, nodes)
    recorded = file_weight_range(model)
    return {
        "machine": cpu.describe(),
        "vnni": cpu.vnni,
        "weight_range": recorded or ("full" if beyond else "portable"),
        "weight_range_recorded": recorded is not None,
        "saturate_without_vnni": [f"{label} [{low}, {high}]" for label, low, high in beyond],
    }


# -- the graph ONNX Runtime actually runs ----------------------------------------------------
_ORT_INT8 = {"QLinearConv": "Conv", "QGemm": "Gemm", "QLinearMatMul": "MatMul", "MatMulIntegerToFloat": "MatMul",
             "QLinearAdd": "Add", "ConvInteger": "Conv", "MatMulInteger": "MatMul", "DynamicQuantizeMatMul": "MatMul"}
_ORT_FLOAT = {"Conv": "Conv", "FusedConv": "Conv", "NchwcConv": "Conv", "Gemm": "Gemm", "FusedGemm": "Gemm",
              "MatMul": "MatMul", "FusedMatMul": "MatMul", "Add": "Add"}


def ort_optimised_graph(onnx_path: str | os.PathLike) -> ir.Graph:
    """The main graph ONNX Runtime actually runs (CPU provider, default level), without weights."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as scratch:
        optimised = Path(scratch) / "optimised.onnx"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(optimised)
        options.log_severity_level = 3  # saving an NCHWc-optimised graph warns that it is machine-specific
        # A model over 2 GB can only be saved with its weights outside the proto.
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimised.onnx.data")
        ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        return ir.from_proto(onnx.load_model(str(optimised), load_external_data=False)).graph


def ort_optimised_ops(onnx_path: str | os.PathLike) -> Counter[str]:
    """Operator counts of the graph ONNX Runtime actually runs (CPU provider, default level)."""
    return Counter(node.op_type for node in ort_optimised_graph(onnx_path))


#: What ORT's CPU provider runs at more cost quantized than a float graph runs it, by the pattern
#: its optimised graph shows (measured on transformers' EfficientNet-B0 and timm's MobileNetV3 at
#: batch 1 on two cores; see docs/limitations.md). On 112x112x96: QLinearSigmoid
#: 171 us + QLinearMul 124 us against QuickGelu's 101; a broadcast QLinearMul 263 us on one thread.
COSTLIER_THAN_FLOAT = {
    "silu": "SiLU as QLinearSigmoid + QLinearMul: two INT8 passes where a float graph runs one fused QuickGelu",
    "gate": "a squeeze-excite gate as a broadcast QLinearMul, which ORT runs on one thread",
    "hardswish": "HardSwish in float between pairs (ORT has no INT8 kernel): a DequantizeLinear, "
                 "HardSigmoid, Mul and QuantizeLinear where a float graph fuses it into its conv",
}
_POOLS = {"QLinearGlobalAveragePool", "GlobalAveragePool", "ReduceMean"}


def _pooled(value: ir.Value | None, depth: int = 8) -> bool:
    """Whether ``value`` is computed from a global pool within ``depth`` producers (a gate)."""
    frontier = [value]
    for _ in range(depth):
        made = [p for v in frontier if (p := _producer(v)) is not None]
        if any(p.op_type in _POOLS for p in made):
            return True
        frontier = [p.inputs[0] for p in made if p.inputs]
    return False


def ort_costlier_than_float(graph: ir.Graph) -> dict[str, int]:
    """Count, in ORT's optimised ``graph``, the patterns of :data:`COSTLIER_THAN_FLOAT`."""
    found: Counter[str] = Counter()
    for node in graph:
        if node.op_type == "QLinearMul" and len(node.inputs) > 3:
            first, second = node.inputs[0], node.inputs[3]
            for x, s in ((first, second), (second, first)):
                sigmoid = _producer(s)
                if sigmoid is None or sigmoid.op_type != "QLinearSigmoid":
                    continue
                if sigmoid.inputs[0] is x:
                    found["silu"] += 1
                elif _pooled(sigmoid.inputs[0]):
                    found["gate"] += 1
                break
        elif node.op_type == "HardSigmoid" and _dequantized(node.inputs[0]):
            found["hardswish"] += 1
    return {COSTLIER_THAN_FLOAT[k]: found[k] for k in COSTLIER_THAN_FLOAT if found[k]}


def ort_int8_counts(onnx_path: str | os.PathLike, optimised: Counter[str] | None = None) -> dict[str, dict[str, int]]:
    """How many Conv/Gemm/MatMul/Add ONNX Runtime runs in INT8 after its own optimisation.

    Read from the optimised graph ORT writes (default level, CPU provider), or from
    ``optimised`` (the counts :func:`ort_optimised_ops` returned) when given. Returns
    ``{op: {"int8": n, "float": m}}``; weight-only ``MatMulNBits`` is in neither.
    """
    counts: dict[str, dict[str, int]] = {op: {"int8": 0, "float": 0} for op in ("Conv", "Gemm", "MatMul", "Add")}
    for op, n in (ort_optimised_ops(onnx_path) if optimised is None else optimised).items():
        if op in _ORT_INT8:
            counts[_ORT_INT8[op]]["int8"] += n
        elif op in _ORT_FLOAT:
            counts[_ORT_FLOAT[op]]["float"] += n
    return counts
