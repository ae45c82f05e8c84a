"""Post-conditions a Q/DQ export must meet, checked on the produced graph."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir
import torch

from .._core.ir import graphs, is_default, label
from ..errors import ExportRefusedError
from .view import qdq_nodes

QParams = tuple  # ("per_tensor", scale, zero_point, dtype) | ("per_channel", scales, zero_points, axis, dtype)

_TORCH_TO_ONNX = {torch.int8: onnx.TensorProto.INT8, torch.uint8: onnx.TensorProto.UINT8,
                  torch.int16: onnx.TensorProto.INT16, torch.uint16: onnx.TensorProto.UINT16,
                  torch.int32: onnx.TensorProto.INT32}


def _reaching_outputs(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes an output depends on. A pt2e graph can keep a branch nothing reads (a head whose
    output the model drops, ending in a dropout, which fx does not remove as it counts it
    impure); the exporter leaves it out of the file, so it is no part of what the file promises."""
    live: set[torch.fx.Node] = set()
    pending = [n for n in graph.nodes if n.op == "output"]
    while pending:
        node = pending.pop()
        if node not in live:
            live.add(node)
            pending.extend(node.all_input_nodes)
    return live


def pt2e_qdq_nodes(model: torch.nn.Module) -> list[torch.fx.Node]:
    """The quantized_decomposed nodes of a pt2e graph module that its outputs depend on (empty for
    anything else)."""
    graph = getattr(model, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return []
    live = _reaching_outputs(graph)
    return [
        n for n in graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "quantized_decomposed" and n in live
    ]


def _attr_tensor(model: torch.nn.Module, arg: object) -> torch.Tensor:
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        value = model
        for part in str(arg.target).split("."):
            value = getattr(value, part)
        return value
    return torch.as_tensor(arg)


def model_qparams(model: torch.nn.Module) -> tuple[set[QParams], set[QParams]]:
    """(activation quantizers, per-channel weight dequantizers) the PyTorch model carries."""
    activations: set[QParams] = set()
    weights: set[QParams] = set()
    for node in pt2e_qdq_nodes(model):
        name = node.target.__name__ if hasattr(node.target, "__name__") else str(node.target)
        if name.startswith("quantize_per_tensor"):
            if isinstance(node.args[1], torch.fx.Node):
                continue  # a scale computed at run time (activations='dynamic'): nothing stored to compare
            scale, zp, _, _, dtype = node.args[1:6]
            activations.add(("per_tensor", float(np.float32(scale)), int(zp), _TORCH_TO_ONNX[dtype]))
        elif name.startswith("dequantize_per_channel"):
            scales = _attr_tensor(model, node.args[1]).to(torch.float32).reshape(-1).tolist()
            zps = _attr_tensor(model, node.args[2]).reshape(-1).tolist()
            weights.add(("per_channel", tuple(scales), tuple(int(z) for z in zps), int(node.args[3]), _TORCH_TO_ONNX[node.args[6]]))
    return activations, weights


def file_qparams(model: ir.Model) -> tuple[set[QParams], set[QParams]]:
    """The same two sets, read from an ONNX graph's QuantizeLinear and per-channel DequantizeLinear."""
    activations: set[QParams] = set()
    weights: set[QParams] = set()
    for q in qdq_nodes(model):
        if q.scale is None or q.zero_point is None:
            continue
        values = q.scale_values()
        scale = values.astype(np.float32).reshape(-1)
        zp = q.zero_point_values().reshape(-1)
        if q.op_type == "QuantizeLinear" and scale.size == 1:
            activations.add(("per_tensor", float(scale[0]), int(zp[0]), int(q.zero_point.dtype)))
        elif q.op_type == "DequantizeLinear" and values.ndim == 1:
            # a 1-D scale is per-axis even with one element (ECA's Conv1d(1, 1, k) weight)
            axis = q.attributes.get("axis", 1)
            weights.add(("per_channel", tuple(scale.tolist()), tuple(int(z) for z in zp), axis, int(q.zero_point.dtype)))
    return activations, weights


def check_faithful(produced: ir.Model, expected: tuple[set[QParams], set[QParams]]) -> None:
    """Every scale, zero-point, type and axis of the model appears in the file, and nothing else."""
    got = file_qparams(produced)
    for kind, want, have in (("activation quantizer", expected[0], got[0]), ("per-channel weight", expected[1], got[1])):
        if want != have:
            missing, extra = len(want - have), len(have - want)
            raise ExportRefusedError(
                f"The exported file does not carry the model's {kind} parameters exactly: {missing} of the "
                f"model's {len(want)} are missing from the file and {extra} in the file are not the model's; "
                f"nothing was kept."
            )


def check_standard_qdq(produced: ir.Model) -> None:
    """Q/DQ must be the standard ONNX operators, and no custom domain may remain."""
    for graph in graphs(produced):
        for node in graph:
            if not is_default(node):
                raise ExportRefusedError(
                    f"The exported graph has a {node.domain}::{node.op_type} node ('{label(node)}'), not a standard "
                    f"ONNX operator; nothing was kept."
                )


def activation_zero_points(model: torch.nn.Module) -> Iterable[tuple[int, torch.dtype]]:
    """(zero-point, dtype) of every activation quantizer of a pt2e graph."""
    for node in pt2e_qdq_nodes(model):
        name = getattr(node.target, "__name__", str(node.target))
        if name.startswith("quantize_per_tensor"):
            yield int(node.args[2]), node.args[5]


def captured_symbolic_axes(model: torch.nn.Module) -> list[set[int]]:
    """Per input of a captured graph module, the axes torch.export kept symbolic."""
    out = []
    for node in (n for n in model.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("val")
        shape = value.shape if isinstance(value, torch.Tensor) else ()
        out.append({axis for axis, size in enumerate(shape) if isinstance(size, torch.SymInt)})
    return out


def captured_with_dynamic_batch(model: torch.nn.Module) -> bool:
    """True when every tensor input of the graph module has a symbolic first dimension."""
    placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
    dims = []
    for node in placeholders:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim():
            dims.append(value.shape[0])
    return bool(dims) and all(isinstance(d, torch.SymInt) for d in dims)
