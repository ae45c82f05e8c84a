"""Our pt2e annotation: which tensors of a captured graph get observers, and with which spec.

A table maps aten operators to annotator functions, filled by the ``@annotates`` decorator: a new
pattern is one new function. Every annotator reads the shared :class:`AnnotationContext` (the
activation and weight specs) and writes ``QuantizationAnnotation``s on the graph's nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

aten = torch.ops.aten

Annotator = Callable[[Node, "AnnotationContext"], None]
_ANNOTATORS: dict[object, Annotator] = {}


def annotates(*targets: object) -> Callable[[Annotator], Annotator]:
    """Register the decorated function as the annotator of these aten operators."""

    def register(fn: Annotator) -> Annotator:
        for target in targets:
            _ANNOTATORS[target] = fn
        return fn

    return register


@dataclass(frozen=True)
class AnnotationContext:
    activation: QuantizationSpec
    weight: QuantizationSpec
    weight_transposed: QuantizationSpec  # axis 1: ConvTranspose weights are (in, out/groups, …)
    is_qat: bool
    #: Activations produced by a ReLU-like epilogue use this spec (the unsigned range for ORT).
    post_relu: QuantizationSpec | None = None
    #: The consumer runs Sigmoid between Q/DQ pairs (ORT's QLinearSigmoid): quantize its input
    #: and output, and split SiLU into x·sigmoid(x) so that both halves run in INT8.
    int8_sigmoid: bool = False


#: ``.padding`` is the overload a string padding (``'same'``, ``'valid'``) captures as.
CONV_OPS = (
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
)
CONV_TRANSPOSE_OPS = (
    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
)
RELU_OPS = (aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default)
BATCH_NORM_OPS = (aten.batch_norm.default, aten._native_batch_norm_legit.default,
                  aten._native_batch_norm_legit_no_training.default)
ADD_OPS = (aten.add.Tensor, aten.add_.Tensor)
#: Operators whose output takes its input's quantization parameters (no requantization).
SHARING_OPS = (
    aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default,
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
    aten.adaptive_avg_pool3d.default, aten.mean.dim, aten.mean.default,
    *RELU_OPS,
)


def is_annotated(node: Node) -> bool:
    annotation = node.meta.get(Q_ANNOTATION_KEY)
    return annotation is not None and annotation._annotated


def annotation_of(node: Node) -> QuantizationAnnotation | None:
    return node.meta.get(Q_ANNOTATION_KEY)


def _annotate(node: Node, inputs: dict[Node, object] | None = None, output: object | None = None) -> None:
    annotation = node.meta.get(Q_ANNOTATION_KEY) or QuantizationAnnotation()
    if inputs:
        annotation.input_qspec_map.update(inputs)
    if output is not None:
        annotation.output_qspec = output
    annotation._annotated = True
    node.meta[Q_ANNOTATION_KEY] = annotation


def is_float_tensor(arg: object) -> bool:
    if not isinstance(arg, Node):
        return False
    value = arg.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _single_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def epilogue(node: Node, is_qat: bool) -> list[Node]:
    """The nodes fused after a conv/linear/add: a batch norm (QAT only), then a ReLU-like op."""
    chain: list[Node] = []
    current = node
    user = _single_user(current)
    if is_qat and user is not None and user.target in BATCH_NORM_OPS:
        chain.append(user)
        current = user
        user = _single_user(current)
    if user is not None and user.target in RELU_OPS and not is_annotated(user):
        chain.append(user)
    return chain


def _non_negative(node: Node) -> bool:
    """A ReLU, or a hardtanh/clamp whose lower bound is at least 0 (ReLU6)."""
    if node.target in (aten.relu.default, aten.relu_.default):
        return True
    if node.target in (aten.hardtanh.default, aten.hardtanh_.default):
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
        return float(low) >= 0
    return False


def _output_spec(ctx: AnnotationContext, producer: Node) -> QuantizationSpec:
    if ctx.post_relu is not None and _non_negative(producer):
        return ctx.post_relu
    return ctx.activation


def input_spec(arg: Node, ctx: AnnotationContext) -> object:
    """The spec of an activation input: the producer's own parameters when it has them.

    Sharing the producer's observer means one Q/DQ pair per tensor, whatever spec (signed or
    unsigned) the producer chose.
    """
    producer = annotation_of(arg)
    if producer is not None and producer.output_qspec is not None:
        return SharedQuantizationSpec(arg)
    return ctx.activation


def _annotate_with_epilogue(node: Node, inputs: dict[Node, object], ctx: AnnotationContext) -> None:
    chain = epilogue(node, ctx.is_qat)
    if not chain:
        _annotate(node, inputs, ctx.activation)
        return
    _annotate(node, inputs)
    for fused in chain[:-1]:
        _annotate(fused)
    _annotate(chain[-1], output=_output_spec(ctx, chain[-1]))


@annotates(*CONV_OPS, aten.linear.default)
def _conv_or_linear(node: Node, ctx: AnnotationContext) -> None:
    x, weight = node.args[0], node.args[1]
    if not (is_float_tensor(x) and isinstance(weight, Node)):
        return
    _annotate_with_epilogue(node, {x: input_spec(x, ctx), weight: ctx.weight}, ctx)


@annotates(aten.addmm.default)
def _addmm(node: Node, ctx: AnnotationContext) -> None:
    """``bias + x @ w``: transformers' GPT-2 ``Conv1D`` stores ``w`` as (in, out), so its output
    channels run along axis 1, as a transposed conv's do."""
    _bias, x, weight = node.args[:3]
    if not (is_float_tensor(x) and isinstance(weight, Node)):
        return
    weight_spec = ctx.weight_transposed if weight.op == "get_attr" else input_spec(weight, ctx)
    _annotate_with_epilogue(node, {x: input_spec(x, ctx), weight: weight_spec}, ctx)


@annotates(*CONV_TRANSPOSE_OPS)
def _conv_transpose(node: Node, ctx: AnnotationContext) -> None:
    x, weight = node.args[0], node.args[1]
    if not (is_float_tensor(x) and isinstance(weight, Node)):
        return
    _annotate_with_epilogue(node, {x: input_spec(x, ctx), weight: ctx.weight_transposed}, ctx)


@annotates(aten.matmul.default, aten.bmm.default, aten.mul.Tensor, aten.mul_.Tensor, *ADD_OPS)
def _binary(node: Node, ctx: AnnotationContext) -> None:
    if not is_float_tensor(node):
        return
    # A parameter added or multiplied in (a position embedding, a scale) stays float: it is no
    # activation, and quantizing it as one would store a weight with activation parameters.
    inputs = {a: input_spec(a, ctx) for a in node.args[:2] if is_float_tensor(a) and a.op != "get_attr"}
    if not inputs:
        return
    if node.target in ADD_OPS:
        _annotate_with_epilogue(node, inputs, ctx)
    else:
        _annotate(node, inputs, ctx.activation)


@annotates(aten.sigmoid.default)
def _sigmoid(node: Node, ctx: AnnotationContext) -> None:
    x = node.args[0]
    if not (ctx.int8_sigmoid and is_float_tensor(x)):
        return
    # (0, 1): an unsigned range starting at 0 spends no code on negatives, where the consumer has one
    _annotate(node, {x: input_spec(x, ctx)}, ctx.post_relu or ctx.activation)


def split_silu(model: GraphModule) -> GraphModule:
    """Rewrite every ``silu(x)`` as ``x * sigmoid(x)``, the form the ONNX file holds anyway.

    ``aten.silu`` is one node, so no pair can sit between its sigmoid and its product; split, the
    sigmoid and the product are each annotated like any other op. The new nodes keep the silu's
    metadata (its module path, which ``skip_activations`` matches names against).
    """
    graph = model.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.silu.default, aten.silu_.default):
            continue
        x = node.args[0]
        with graph.inserting_before(node):
            sigmoid = graph.call_function(aten.sigmoid.default, (x,))
            product = graph.call_function(aten.mul.Tensor, (x, sigmoid))
        for new in (sigmoid, product):
            new.meta.update(node.meta)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        model.recompile()
    return model


@annotates(aten.cat.default, aten.concat.default)
def _cat(node: Node, ctx: AnnotationContext) -> None:
    tensors = [t for t in node.args[0] if is_float_tensor(t)]
    if not tensors or len(tensors) != len(node.args[0]):
        return
    first = tensors[0]
    shared = SharedQuantizationSpec((first, node))
    inputs: dict[Node, object] = {first: input_spec(first, ctx)}
    inputs.update({t: shared for t in tensors[1:] if t is not first})
    _annotate(node, inputs, shared)


@annotates(*SHARING_OPS)
def _sharing(node: Node, ctx: AnnotationContext) -> None:
    x = node.args[0]
    if not is_float_tensor(x):
        return
    producer = annotation_of(x)
    # Only continue a quantized tensor: a reshape of a float tensor needs no pair of its own.
    if producer is None or producer.output_qspec is None:
        return
    _annotate(node, {x: SharedQuantizationSpec(x)}, SharedQuantizationSpec(x))


def annotate_graph(model: GraphModule, ctx: AnnotationContext) -> GraphModule:
    """Annotate every supported operator of ``model`` in graph order (producers first)."""
    for node in model.graph.nodes:
        if node.op != "call_function" or is_annotated(node):
            continue
        annotator = _ANNOTATORS.get(node.target)
        if annotator is not None:
            annotator(node, ctx)
    return model


def supported_operators() -> list[str]:
    """The aten operators our annotation knows, for documentation and error messages."""
    return sorted({str(t) for t in _ANNOTATORS})
