"""Fold a constant per-channel scale after a conv or linear layer into the layer's weights.

ConvNeXt, DINOv2, CaiT, PoolFormer and their kin scale a block's output by a learned vector
(layer scale, ``gamma * fc2(x)``). Left as it is, that multiplication is a float op beside a
constant between the layer and the residual Add: a consumer that runs elementwise ops in INT8
only between two quantized operands (ONNX Runtime) keeps the Mul and the Add after it in float,
and every consumer pays a pass over the tensor. Scaling output channel ``c`` of a layer by
``g[c]`` is the layer with weight row ``c`` and bias ``c`` scaled by ``g[c]``, so the fold runs
before annotation (after pt2e has folded batch norms), once, on a copy the caller never sees;
the quantized model is then the folded one, and the file carries exactly its parameters.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .annotate import CONV_OPS, IDENTITY_OPS, is_constant, mark_constants

aten = torch.ops.aten

_LINEAR = (aten.linear.default,)


def _value(model: GraphModule, node: Any) -> Any:
    """The value of a constant node (a parameter, or ops on parameters and literals)."""
    if not isinstance(node, Node):
        return node
    if node.op == "get_attr":
        return operator.attrgetter(str(node.target))(model).detach()
    args = [_value(model, a) for a in node.args]
    kwargs = {k: _value(model, v) for k, v in node.kwargs.items()}
    return node.target(*args, **kwargs)


def _layer_before(node: Node) -> Node | None:
    """The conv or linear layer whose output reaches ``node`` through single-reader identities."""
    while isinstance(node, Node) and node.op == "call_function" and len(node.users) == 1:
        if node.target == aten.convolution.default and len(node.args) > 6 and node.args[6]:
            return None  # transposed: its weight is (in, out/groups, …), rows are not outputs
        if node.target in CONV_OPS or node.target in _LINEAR:
            return node
        if node.target not in IDENTITY_OPS:  # a block's dropout or drop-path between layer and scale
            return None
        node = node.args[0]
    return None


def _channel_scale(scale: torch.Tensor, output: torch.Tensor, axis: int) -> torch.Tensor | None:
    """``scale`` as one factor per output channel, when it multiplies along ``axis`` only."""
    if not scale.is_floating_point() or scale.dim() > output.dim():
        return None
    channels = output.shape[axis]
    if scale.numel() == 1:
        return scale.reshape(()).expand(channels)
    shape = [1] * (output.dim() - scale.dim()) + list(scale.shape)
    wanted = [1] * output.dim()
    wanted[axis] = channels
    return scale.reshape(-1) if shape == wanted else None


def _parameter(model: GraphModule, like: Node, value: torch.Tensor, name: str) -> Node:
    """A new parameter of ``model`` read by a get_attr with ``like``'s metadata."""
    attr, index = name, 0
    while hasattr(model, attr):
        index += 1
        attr = f"{name}_{index}"
    model.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
    with model.graph.inserting_before(like):
        node = model.graph.get_attr(attr)
    node.meta.update(like.meta)
    return node


def fold_channel_scales(model: GraphModule) -> GraphModule:
    """Fold every ``layer(x) * g`` whose ``g`` is constant and per output channel (or one number)
    into the layer's weight and bias. The layer's weight and bias must be parameters that
    nothing else reads; anything else is left as it is."""
    graph = model.graph
    mark_constants(model)
    changed = False
    for mul in list(graph.nodes):
        if mul.op != "call_function" or mul.target not in (aten.mul.Tensor,) or len(mul.args) != 2:
            continue
        for source, scale in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
            if not (isinstance(source, Node) and isinstance(scale, Node)) or not is_constant(scale):
                continue
            layer = _layer_before(source)
            if layer is None:
                continue
            weight = layer.args[1]
            bias = layer.args[2] if len(layer.args) > 2 else layer.kwargs.get("bias")
            if not (isinstance(weight, Node) and weight.op == "get_attr" and len(weight.users) == 1):
                continue
            if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr" and len(bias.users) == 1):
                continue
            output = layer.meta.get("val")
            if not isinstance(output, torch.Tensor):
                continue
            factors = _channel_scale(_value(model, scale), output, -1 if layer.target in _LINEAR else 1)
            if factors is None:
                continue
            w = _value(model, weight)
            # a grouped conv's weight is (out, in/groups, …) too: output channel c is row c
            scaled = w * factors.to(w.dtype).reshape(-1, *([1] * (w.dim() - 1)))
            layer.replace_input_with(weight, _parameter(model, weight, scaled, f"{weight.name}_scaled"))
            if bias is not None:
                b = _value(model, bias)
                layer.replace_input_with(bias, _parameter(model, bias, b * factors.to(b.dtype), f"{bias.name}_scaled"))
            mul.replace_all_uses_with(source)
            graph.erase_node(mul)
            _erase_unread([weight, bias, scale])
            changed = True
            break
    if changed:
        graph.lint()
        model.recompile()
    return model


def _erase_unread(nodes: list[Any]) -> None:
    """Erase those of ``nodes`` nothing reads any more, and what only they read (the scale's
    reshape, then the scale itself)."""
    pending = [n for n in nodes if isinstance(n, Node)]
    while pending:
        node = pending.pop()
        if node.users or node.graph is None or node.op not in ("get_attr", "call_function"):
            continue
        inputs = list(node.all_input_nodes)
        node.graph.erase_node(node)
        pending.extend(inputs)
