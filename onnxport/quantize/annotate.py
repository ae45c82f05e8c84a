"""Our pt2e annotation: which tensors of a captured graph get observers, and with which spec.

A table maps aten operators to annotator functions, filled by the ``@annotates`` decorator: a new
pattern is one new function. Every annotator reads the shared :class:`AnnotationContext` (the
activation and weight specs) and writes ``QuantizationAnnotation``s on the graph's nodes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

from ..targets import Annotation
from .decompose import ATTENTION_ROLE

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
    """What every annotator reads: the specs to give, and the target's :class:`Annotation` (which
    patterns its consumer runs in INT8, documented there) as the target declares it."""

    activation: QuantizationSpec
    weight: QuantizationSpec
    weight_transposed: QuantizationSpec  # axis 1: ConvTranspose weights are (in, out/groups, …)
    is_qat: bool
    #: Activations produced by a ReLU-like epilogue use this spec (the unsigned range for ORT).
    post_relu: QuantizationSpec | None = None
    annotation: Annotation = field(default_factory=Annotation)
    #: Activations are quantized at run time (``activation`` is a dynamic spec): only the inputs
    #: of linear layers (``nn.Linear``, addmm, a product with a parameter matrix) are quantized,
    #: nothing's output, and convolutions and everything else stay float.
    dynamic: bool = False


#: ``.padding`` is the overload a string padding (``'same'``, ``'valid'``) captures as.
CONV_OPS = (
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
)
CONV_TRANSPOSE_OPS = (
    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
)
RELU_OPS = (aten.relu.default, aten.relu_.default, aten.relu6.default, aten.hardtanh.default, aten.hardtanh_.default)
BATCH_NORM_OPS = (aten.batch_norm.default, aten._native_batch_norm_legit.default,
                  aten._native_batch_norm_legit_no_training.default)
ADD_OPS = (aten.add.Tensor, aten.add_.Tensor)
#: Identities at inference (dropout, copies).
IDENTITY_OPS = (
    aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default, aten.feature_dropout_.default,
    aten.alpha_dropout.default, aten.alpha_dropout_.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default,
)
#: Operators whose output takes its input's quantization parameters (no requantization).
SHARING_OPS = (
    aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default,
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
    aten.adaptive_avg_pool3d.default, aten.mean.dim, aten.mean.default,
    # identities at inference: with an observer of their own, the exported file would hold two
    # pairs back to back (Q·DQ·Q·DQ), which ONNX Runtime merges into one, computing something else
    *IDENTITY_OPS,
    # data movement: a slice, a row, or a nearest-neighbour upsampling holds only values of its
    # input (ONNX Runtime runs Slice and Resize on the integers between equal pairs)
    aten.slice.Tensor, aten.select.int, aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec,
    aten.upsample_nearest3d.vec, aten.upsample_nearest1d.default, aten.upsample_nearest2d.default,
    aten.upsample_nearest3d.default,
    *RELU_OPS,
)
#: Operators that return their input's values in pieces (read through ``getitem``).
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
#: Zero padding: 0 is exactly representable in every pt2e range (its zero-point), so the padded
#: tensor keeps its input's parameters; another fill value would need its own.
PAD_OPS = (aten.pad.default, aten.constant_pad_nd.default)
CAT_OPS = (aten.cat.default, aten.concat.default)


def is_annotated(node: Node) -> bool:
    annotation = node.meta.get(Q_ANNOTATION_KEY)
    return annotation is not None and annotation._annotated


def annotation_of(node: Node) -> QuantizationAnnotation | None:
    return node.meta.get(Q_ANNOTATION_KEY)


def has_pair(node: Node) -> bool:
    """Whether ``node``'s producer annotation quantizes its output (gives it a Q/DQ pair)."""
    annotation = annotation_of(node)
    return annotation is not None and annotation.output_qspec is not None


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


_CONSTANT = "onnxport_constant"


def mark_constants(model: GraphModule) -> None:
    """Record on every node whether it depends on no model input (parameters and literals only)."""
    for node in model.graph.nodes:
        if node.op == "placeholder":
            node.meta[_CONSTANT] = False
        elif node.op == "get_attr":
            node.meta[_CONSTANT] = True
        else:
            node.meta[_CONSTANT] = all(arg.meta.get(_CONSTANT, False) for arg in node.all_input_nodes)


def is_constant(node: Node) -> bool:
    """Whether ``node`` is computed from parameters and literals alone (see :func:`mark_constants`)."""
    return node.op == "get_attr" or node.meta.get(_CONSTANT, False)


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
    if node.target in (aten.relu.default, aten.relu_.default, aten.relu6.default):
        return True
    if node.target in (aten.hardtanh.default, aten.hardtanh_.default):
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
        return float(low) >= 0
    return False


def _value_source(node: Node) -> Node:
    """The node that decides ``node``'s sign: back through zero pads and the sharing ops (shapes,
    pools, means, identities), none of which can make a non-negative tensor negative."""
    while isinstance(node, Node) and node.op == "call_function" and node.args and (
            (node.target in SHARING_OPS and not _non_negative(node))
            or (node.target in PAD_OPS and is_zero_padding(node))):
        node = node.args[0]
    return node


def _output_spec(ctx: AnnotationContext, producer: Node) -> QuantizationSpec:
    if ctx.post_relu is not None and _non_negative(producer):
        return ctx.post_relu
    return ctx.activation


def input_spec(arg: Node, ctx: AnnotationContext) -> object:
    """The spec of an activation input: the producer's own parameters when it has them.

    Sharing the producer's observer means one Q/DQ pair per tensor, whatever spec (signed or
    unsigned) the producer chose.
    """
    if has_pair(arg):
        return SharedQuantizationSpec(arg)
    # A float producer may still hold no negatives: a ReLU after a norm (BiT's GroupNorm + ReLU),
    # seen through zero pads and pools. It gets the unsigned range a target asks for after a ReLU,
    # or ONNX Runtime keeps the ReLU in float and the conv before it too.
    return _output_spec(ctx, _value_source(arg))


def _annotate_with_epilogue(node: Node, inputs: dict[Node, object], ctx: AnnotationContext) -> None:
    chain = epilogue(node, ctx.is_qat)
    if not chain:
        _annotate(node, inputs, ctx.activation)
        return
    _annotate(node, inputs)
    for fused in chain[:-1]:
        _annotate(fused)
    _annotate(chain[-1], output=_output_spec(ctx, chain[-1]))


def _bias_qparams(observers: list) -> tuple[torch.Tensor, torch.Tensor]:
    (activation_scale, _), (weight_scale, _) = (o.calculate_qparams() for o in observers)
    scale = (activation_scale.to(torch.float32) * weight_scale.to(torch.float32)).reshape(-1)
    return scale, torch.zeros(scale.shape, dtype=torch.int32)


def _bias_spec(x: Node, weight: Node, node: Node, ctx: AnnotationContext) -> DerivedQuantizationSpec:
    per_channel = ctx.weight.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    return DerivedQuantizationSpec(
        derived_from=[(x, node), (weight, node)], derive_qparams_fn=_bias_qparams, dtype=torch.int32,
        quant_min=-(2**31), quant_max=2**31 - 1,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        ch_axis=0 if per_channel else None,
    )


def _with_bias(inputs: dict[Node, object], bias: object, x: Node, weight: Node, node: Node,
               ctx: AnnotationContext) -> dict[Node, object]:
    """Add the bias's int32 spec where the file will hold a Conv or Gemm (ORT rounds only those)."""
    if ctx.annotation.int32_bias and not ctx.is_qat and isinstance(bias, Node) and bias.op == "get_attr" \
            and weight.op == "get_attr":
        inputs[bias] = _bias_spec(x, weight, node, ctx)
    return inputs


@annotates(*CONV_OPS, aten.linear.default)
def _conv_or_linear(node: Node, ctx: AnnotationContext) -> None:
    x, weight = node.args[0], node.args[1]
    if not (is_float_tensor(x) and isinstance(weight, Node)):
        return
    inputs = {x: input_spec(x, ctx), weight: ctx.weight}
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    # a linear of a matrix is written as Gemm (bias included); of a batch, as MatMul then Add
    if node.target != aten.linear.default or x.meta["val"].dim() == 2:
        inputs = _with_bias(inputs, bias, x, weight, node, ctx)
    _annotate_with_epilogue(node, inputs, ctx)


@annotates(aten.addmm.default)
def _addmm(node: Node, ctx: AnnotationContext) -> None:
    """``bias + x @ w``: transformers' GPT-2 ``Conv1D`` stores ``w`` as (in, out), so its output
    channels run along axis 1, as a transposed conv's do."""
    bias, x, weight = node.args[:3]
    if not (is_float_tensor(x) and isinstance(weight, Node)):
        return
    weight_spec = ctx.weight_transposed if weight.op == "get_attr" else input_spec(weight, ctx)
    inputs = _with_bias({x: input_spec(x, ctx), weight: weight_spec}, bias, x, weight, node, ctx)
    _annotate_with_epilogue(node, inputs, ctx)


@annotates(*CONV_TRANSPOSE_OPS)
def _conv_transpose(node: Node, ctx: AnnotationContext) -> None:
    x, weight = node.args[0], node.args[1]
    if not (is_float_tensor(x) and isinstance(weight, Node)):
        return
    _annotate_with_epilogue(node, {x: input_spec(x, ctx), weight: ctx.weight_transposed}, ctx)


_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.mm.default)
#: A parameter read through one of these is the parameter laid out again (Falcon's and RWKV's
#: ``x @ self.weight.T``).
_TRANSPOSES = (aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default)
_WEIGHT_PRODUCT = "onnxport_weight_product"


def _product_weight(node: Node) -> Node | None:
    """The weight of a product that is a linear layer written by hand: ``x @ W`` where ``W`` is a
    matrix computed from parameters alone (a parameter, or one transposed). ``W`` is then (in, out),
    its output channels along axis 1, as addmm's are; ``None`` for a product of two activations."""
    if node.target not in _PRODUCTS or len(node.args) < 2:
        return None
    x, weight = node.args[:2]
    if not (is_float_tensor(x) and not is_constant(x) and is_float_tensor(weight) and is_constant(weight)):
        return None
    if weight.meta["val"].dim() != 2:
        return None
    source = weight
    while source.op == "call_function" and source.target in _TRANSPOSES:
        source = source.args[0]
    return weight if source.op == "get_attr" else None


def is_weight_product(node: Node) -> bool:
    """Whether the annotation took ``node`` as a linear layer (see :func:`_product_weight`)."""
    return bool(node.meta.get(_WEIGHT_PRODUCT))


def _reads_quantized_operands(node: Node) -> bool:
    """Both operands are activations that their producers already quantize."""
    operands = node.args[:2]
    return len(operands) == 2 and all(
        isinstance(a, Node) and not is_constant(a) and has_pair(a) for a in operands
    )


@annotates(*_PRODUCTS, aten.mul.Tensor, aten.mul_.Tensor, *ADD_OPS)
def _binary(node: Node, ctx: AnnotationContext) -> None:
    if not is_float_tensor(node):
        return
    weight = _product_weight(node)
    if weight is not None:
        # a linear layer written by hand: taken as a product of two tensors, its weight stayed
        # float and ONNX Runtime ran it in float (8 of Falcon's 13 MatMuls)
        x = node.args[0]
        node.meta[_WEIGHT_PRODUCT] = True
        _annotate_with_epilogue(node, {x: input_spec(x, ctx), weight: ctx.weight_transposed}, ctx)
        return
    if node.target in _PRODUCTS and ctx.annotation.float_activation_products:
        return
    # A parameter, or a tensor computed from parameters alone (a position embedding looked up by
    # an arange, a causal mask), stays float: it is no activation. Quantized as one, the exporter
    # folds it into a stored table with activation parameters, which OpenVINO cannot even load
    # beside an activation (transformers' GPT-2 and Whisper encoder).
    inputs = {a: input_spec(a, ctx) for a in node.args[:2] if is_float_tensor(a) and not is_constant(a)}
    if not inputs:
        return
    if ctx.annotation.elementwise_on_quantized and node.target not in _PRODUCTS and not _reads_quantized_operands(node):
        return
    # a ReLU after the product or sum is folded into its output pair, as after a conv (ReXNet's
    # ReLU6 after its squeeze-excite product)
    _annotate_with_epilogue(node, inputs, ctx)


@annotates(aten.sigmoid.default)
def _sigmoid(node: Node, ctx: AnnotationContext) -> None:
    x = node.args[0]
    if not (ctx.annotation.int8_sigmoid and is_float_tensor(x)):
        return
    # (0, 1): an unsigned range starting at 0 spends no code on negatives, where the consumer has one
    _annotate(node, {x: input_spec(x, ctx)}, ctx.post_relu or ctx.activation)


@annotates(aten.leaky_relu.default, aten.leaky_relu_.default)
def _leaky_relu(node: Node, ctx: AnnotationContext) -> None:
    x = node.args[0]
    # the consumer that runs Sigmoid from a table (ORT's QLinearSigmoid) runs LeakyReLU so too
    # (QLinearLeakyRelu); unannotated, a LeakyReLU whose reader is an Add (CSPDarknet's residual
    # blocks) left that Add, and itself, in float between pairs
    if ctx.annotation.int8_sigmoid and is_float_tensor(x):
        _annotate(node, {x: input_spec(x, ctx)}, ctx.activation)


@annotates(*CAT_OPS)
def _cat(node: Node, ctx: AnnotationContext) -> None:
    tensors = [t for t in node.args[0] if is_float_tensor(t)]
    if not tensors or len(tensors) != len(node.args[0]):
        return
    if ctx.post_relu is not None and len({_unsigned(t, ctx) for t in tensors}) > 1:
        # One observer for a ReLU output and a signed tensor would give the ReLU's pair a range
        # below 0, and ONNX Runtime would keep the ReLU, and the conv before it, in float
        # (DenseNet's stem ReLU meets its dense layers' conv outputs). Each input keeps its
        # producer's pair; the Concat requantizes them into a range of its own, as ORT's
        # QLinearConcat does with inputs of different scales.
        inputs = {t: input_spec(t, ctx) for t in tensors}
        _annotate(node, inputs, ctx.activation)
        return
    first = tensors[0]
    shared = SharedQuantizationSpec((first, node))
    inputs = {first: input_spec(first, ctx)}
    inputs.update({t: shared for t in tensors[1:] if t is not first})
    _annotate(node, inputs, shared)


def _unsigned(arg: Node, ctx: AnnotationContext) -> bool:
    """Whether ``arg`` is quantized on the unsigned range ``ctx.post_relu`` (a ReLU's, a sigmoid's)."""
    source = _value_source(arg)
    annotation = annotation_of(source)
    return _non_negative(source) or (annotation is not None and annotation.output_qspec is ctx.post_relu)


def is_zero_padding(node: Node) -> bool:
    """A ``F.pad``/``constant_pad_nd`` node (of ``PAD_OPS``) that fills with zeros."""
    if node.target == aten.constant_pad_nd.default:
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
        return not value
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
    return mode == "constant" and not value


@annotates(*SHARING_OPS, *PAD_OPS)
def _sharing(node: Node, ctx: AnnotationContext) -> None:
    x = node.args[0]
    if not is_float_tensor(x) or (node.target in PAD_OPS and not is_zero_padding(node)):
        return
    # Only continue a quantized tensor: a reshape of a float tensor needs no pair of its own.
    if not has_pair(x):
        return
    if ctx.post_relu is not None and _non_negative(node) and not _unsigned(x, ctx):
        # a ReLU no producer's epilogue took, after a signed pair (a pool's, a concat's): its own
        # unsigned pair, or ONNX Runtime keeps the ReLU in float before a range below 0
        _annotate(node, {x: SharedQuantizationSpec(x)}, ctx.post_relu)
        return
    _annotate(node, {x: SharedQuantizationSpec(x)}, SharedQuantizationSpec(x))


@annotates(*SPLIT_OPS)
def _split(node: Node, ctx: AnnotationContext) -> None:
    x = node.args[0]
    if not (is_float_tensor(x) and has_pair(x)):
        return
    # every piece keeps the whole's parameters (Res2Net's and CSPNet's channel splits), so that an
    # Add of a piece and a conv output runs in INT8 and ORT splits the integers
    _annotate(node, {x: SharedQuantizationSpec(x)})
    for piece in node.users:
        if piece.op == "call_function" and piece.target is operator.getitem:
            _annotate(piece, output=SharedQuantizationSpec((x, node)))


def _attention_part(node: Node, ctx: AnnotationContext) -> bool:
    """Annotate a node of a split attention; ``False`` for a node the generic table handles.

    Both products read quantized inputs; the scores stay float (ORT runs that product as
    MatMulIntegerToFloat, and no pair then has to hold the mask's -inf), the probabilities are
    quantized on their (0, 1) range, and the context is quantized like any product.
    """
    role = node.meta.get(ATTENTION_ROLE)
    if role is None or (role == "glue" and node.target in SHARING_OPS):
        return False
    if role == "scores":
        _annotate(node, {a: input_spec(a, ctx) for a in node.args[:2]})
    elif role == "softmax":
        _annotate(node, output=ctx.post_relu or ctx.activation)
    elif role == "context":
        _annotate(node, {a: input_spec(a, ctx) for a in node.args[:2]}, ctx.activation)
    else:  # the scale, the mask and the head repeat stay float
        _annotate(node)
    return True


def _dynamic_linear(node: Node, ctx: AnnotationContext) -> None:
    """The dynamic scheme: a linear layer's input quantized at run time, its weight per channel."""
    if node.target == aten.linear.default:
        x, weight, weight_spec = node.args[0], node.args[1], ctx.weight
    elif node.target == aten.addmm.default:
        x, weight, weight_spec = node.args[1], node.args[2], ctx.weight_transposed
    else:
        found = _product_weight(node) if is_float_tensor(node) else None
        if found is None:
            return
        x, weight, weight_spec = node.args[0], found, ctx.weight_transposed
        node.meta[_WEIGHT_PRODUCT] = True
    if is_float_tensor(x) and isinstance(weight, Node) and is_constant(weight):
        _annotate(node, {x: ctx.activation, weight: weight_spec})


def annotate_graph(model: GraphModule, ctx: AnnotationContext) -> GraphModule:
    """Annotate every supported operator of ``model`` in graph order (producers first)."""
    mark_constants(model)
    if ctx.dynamic:
        for node in model.graph.nodes:
            if node.op == "call_function" and not is_constant(node):
                _dynamic_linear(node, ctx)
        return model
    for node in model.graph.nodes:
        # a tensor computed from parameters alone (Funnel's sinusoid position table, a mask) is
        # folded into a stored constant at export; a pair inside that computation stops the folding,
        # and the file recomputes it at every run (Funnel: 2 Einsums and 2 GatherElements more)
        if node.op != "call_function" or is_annotated(node) or is_constant(node):
            continue
        if _attention_part(node, ctx):
            continue
        annotator = _ANNOTATORS.get(node.target)
        if annotator is not None:
            annotator(node, ctx)
    if ctx.annotation.float_linear_outputs:
        _leave_unread_concats_float(model)
        _leave_linear_outputs_float(model)
    if ctx.annotation.fused_sum:
        _leave_summed_outputs_float(model)
    return model


_LINEAR_OPS = (aten.linear.default, aten.addmm.default)


def _pieces(split: Node) -> list[Node]:
    return [u for u in split.users if u.op == "call_function" and u.target is operator.getitem]


def _read_quantized(node: Node) -> bool:
    """Whether any reader takes ``node`` through its pair. A parameter-sharing reader (a reshape,
    a slice, a split's pieces) counts by its own readers; a reader that requantizes ``node`` into
    another tensor's pair on entry (a Concat's later inputs) does not need ``node``'s."""
    for user in node.users:
        annotation = annotation_of(user)
        if annotation is None or node not in annotation.input_qspec_map:
            continue
        if user.target in SPLIT_OPS:
            if any(_read_quantized(piece) for piece in _pieces(user)):
                return True
            continue
        if user.target in SHARING_OPS and isinstance(annotation.output_qspec, SharedQuantizationSpec):
            if _read_quantized(user):
                return True
            continue
        spec = annotation.input_qspec_map[node]
        if isinstance(spec, SharedQuantizationSpec) and isinstance(spec.edge_or_node, tuple) \
                and spec.edge_or_node[0] is not node:
            continue
        return True
    return False


def _clear_sharing_readers(node: Node) -> None:
    for user in node.users:
        annotation = annotation_of(user)
        if annotation is None or node not in annotation.input_qspec_map:
            continue
        if user.target in SPLIT_OPS:
            for piece in _pieces(user):
                _clear_sharing_readers(piece)
                piece.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(_annotated=True)
        elif user.target not in SHARING_OPS:
            continue
        _clear_sharing_readers(user)
        user.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(_annotated=True)


def _leave_unread_concats_float(model: GraphModule) -> None:
    """Drop the annotation of every Concat that nothing reads quantized and that quantizes a float
    producer's output (CodeGen's rotary halves joined before a float product): its pairs would
    quantize that output on the way in and dequantize it on the way out, two passes for nothing.
    A Concat of tensors their producers quantize anyway keeps its pair (ORT's QLinearConcat, as in
    DenseNet's blocks). Readers first, so a Concat read only by another such Concat goes too."""
    for node in reversed(list(model.graph.nodes)):
        if node.target in CAT_OPS and has_pair(node) and not _read_quantized(node) \
                and not all(has_pair(t) for t in annotation_of(node).input_qspec_map):
            _clear_sharing_readers(node)
            node.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(_annotated=True)


def _leave_linear_outputs_float(model: GraphModule) -> None:
    """Drop the output pair of every linear layer that nothing reads quantized: a model output
    (the logits), or a tensor only float ops read (GELU's parts, a float residual Add)."""
    for node in model.graph.nodes:
        annotation = annotation_of(node)
        if not (node.target in _LINEAR_OPS or is_weight_product(node)) or annotation is None \
                or annotation.output_qspec is None:
            continue
        if not _read_quantized(node):
            _clear_sharing_readers(node)
            annotation.output_qspec = None


_SUM_PRODUCERS = (*CONV_OPS, aten.linear.default, aten.addmm.default)


def _leave_summed_outputs_float(model: GraphModule) -> None:
    """Drop the output pair of a conv or linear layer whose only reader is a quantized Add.

    OpenVINO's CPU plugin fuses such an Add into the layer (a sum post-op) and applies the layer's
    FakeQuantize there without its rounding, so a pair there promises a rounding the plugin does
    not do (docs/targets.md has the measurement). With the pair gone, the model adds the float
    output as the plugin does. Where both operands are such layers, only the later one loses its pair: the
    plugin adds the earlier, already computed (and quantized) one into it.
    """
    order = {node: i for i, node in enumerate(model.graph.nodes)}
    for node in model.graph.nodes:
        annotation = annotation_of(node)
        if node.target not in ADD_OPS or annotation is None:
            continue
        operands = [a for a in node.args[:2] if isinstance(a, Node) and a in annotation.input_qspec_map]
        summed = [a for a in operands if a.target in _SUM_PRODUCERS and len(a.users) == 1 and has_pair(a)]
        if len(operands) != 2 or not summed:
            continue
        fused = max(summed, key=order.__getitem__)
        annotation_of(fused).output_qspec = None
        del annotation.input_qspec_map[fused]


def supported_operators() -> list[str]:
    """The aten operators our annotation knows, for documentation and error messages."""
    return sorted({str(t) for t in _ANNOTATORS})
