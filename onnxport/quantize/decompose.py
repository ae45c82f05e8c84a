"""Rewrites of a captured graph that run before annotation, for targets that run the parts of a
compound operator in INT8: a pair can only sit between two aten nodes, never inside one.

Each rewrite replaces one aten node by the aten ops it is defined as, gives every new node the
original's metadata (its module path, which ``skip_activations`` matches names against) and a
``val`` computed from its inputs' fake tensors, so the annotators read shapes and types as on any
captured node.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten

#: ``meta`` key naming a node's part in a split attention: ``'scores'`` (q·kᵀ), ``'softmax'``,
#: ``'context'`` (probabilities·v) or ``'glue'`` (transpose, scale, mask, head repeat).
ATTENTION_ROLE = "onnxport_attention"


def _val(target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    def value(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, Node) else a

    return target(*(value(a) for a in args), **{k: value(v) for k, v in (kwargs or {}).items()})


def call_like(graph: Graph, like: Node, target: Any, args: tuple, role: str | None = None, **kwargs: Any) -> Node:
    node = graph.call_function(target, args, kwargs or None)
    node.meta.update(like.meta)
    node.meta["val"] = _val(target, args, kwargs)
    if role is not None:
        node.meta[ATTENTION_ROLE] = role
    return node


def finish(model: GraphModule, changed: bool) -> GraphModule:
    if changed:
        model.graph.lint()
        model.recompile()
    return model


def split_silu(model: GraphModule) -> GraphModule:
    """Rewrite every ``silu(x)`` as ``x * sigmoid(x)``, the form the ONNX file holds anyway.

    ``aten.silu`` is one node, so no pair can sit between its sigmoid and its product; split, the
    sigmoid and the product are each annotated like any other op.
    """
    graph = model.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.silu.default, aten.silu_.default):
            continue
        x = node.args[0]
        with graph.inserting_before(node):
            sigmoid = call_like(graph, node, aten.sigmoid.default, (x,))
            product = call_like(graph, node, aten.mul.Tensor, (x, sigmoid))
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        changed = True
    return finish(model, changed)


def split_attention(model: GraphModule) -> GraphModule:
    """Rewrite ``scaled_dot_product_attention`` (without dropout) as its math definition:
    ``softmax(q·kᵀ·scale + mask)·v``, with the key/value heads repeated for grouped-query attention.

    The two products are then MatMuls of two activations, which a consumer with an INT8 MatMul
    (ONNX Runtime's QLinearMatMul, MatMulIntegerToFloat) runs in INT8 when their inputs are
    quantized. Every new node carries its role under :data:`ATTENTION_ROLE` for the annotator. A
    causal attention without an explicit mask is left whole (its mask would need the sequence
    lengths as graph values), as is one with dropout.
    """
    graph = model.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, node.args)) | dict(node.kwargs)
        q, k, v = given["query"], given["key"], given["value"]
        mask = given.get("attn_mask")
        if given.get("dropout_p", 0.0) or given.get("is_causal", False):
            continue
        if not all(isinstance(t, Node) and t.meta["val"].is_floating_point() for t in (q, k, v)):
            continue
        head_dim = q.meta["val"].shape[-1]
        scale = given.get("scale")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        with graph.inserting_before(node):
            if given.get("enable_gqa", False):
                repeats = q.meta["val"].shape[-3] // k.meta["val"].shape[-3]
                k = call_like(graph, node, aten.repeat_interleave.self_int, (k, repeats, -3), "glue")
                v = call_like(graph, node, aten.repeat_interleave.self_int, (v, repeats, -3), "glue")
            keys = call_like(graph, node, aten.transpose.int, (k, -2, -1), "glue")
            scores = call_like(graph, node, aten.matmul.default, (q, keys), "scores")
            if scale != 1.0:
                scores = call_like(graph, node, aten.mul.Tensor, (scores, scale), "glue")
            if isinstance(mask, Node):
                if mask.meta["val"].dtype == torch.bool:
                    hidden = call_like(graph, node, aten.logical_not.default, (mask,), "glue")
                    scores = call_like(graph, node, aten.masked_fill.Scalar, (scores, hidden, float("-inf")), "glue")
                else:
                    scores = call_like(graph, node, aten.add.Tensor, (scores, mask), "glue")
            probabilities = call_like(graph, node, aten.softmax.int, (scores, -1), "softmax")
            context = call_like(graph, node, aten.matmul.default, (probabilities, v), "context")
        node.replace_all_uses_with(context)
        graph.erase_node(node)
        changed = True
    return finish(model, changed)
