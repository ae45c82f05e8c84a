"""Write an exact GELU that reads a DequantizeLinear as ONNX Runtime's one-op ``Gelu``.

ONNX Runtime fuses the exporter's five-op GELU (``(x * (1 + erf(x / √2))) * 0.5``, in the order
:class:`~onnxport.passes.gelu_order.GeluOrderPass` writes) into one ``Gelu`` only when both of
its readers of ``x`` read the same value. When ``x`` is a DequantizeLinear's output (a GELU after
a quantized conv: timm's ConvNeXt MLP, SegFormer's Mix-FFN, Whisper's stem) ORT first gives each
reader its own copy of that DequantizeLinear, so the fusion never sees one ``x`` and the GELU
runs as five float passes over the widest tensor of the block. The standard single-op ``Gelu``
exists only from opset 20, so for files meant for ORT this pass writes the ``com.microsoft``
``Gelu`` that ORT's own fusion would have produced (OpenVINO reads it too). Its kernel computes
the same erf GELU in one pass; it may round a last bit differently from the five ops, so the
step's proof is the checker.

:class:`BiasGeluPass` and :class:`BiasFastGeluPass` do the same for a GELU (erf or tanh form) after
a float-output linear's bias, which ORT cannot take into its fused GELU either.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import (
    CONTRIB_DOMAIN,
    drop_unread_constants,
    graph_nodes,
    is_default,
    is_scalar,
    last_axis_bias,
    nodes,
    only_reader,
    other_input,
    taken_names,
    unique_name,
)
from .gelu_order import one_plus_erf


def _ordered_gelu(div: ir.Node) -> list[ir.Node] | None:
    """The five nodes of ``(x * (1 + erf(x / √2))) * 0.5`` that start at ``div``, or None."""
    start = one_plus_erf(div)
    if start is None:
        return None
    erf, add = start
    product = only_reader(add.outputs[0], "Mul")
    if product is None or other_input(product, add.outputs[0]) is not div.inputs[0]:
        return None
    half = only_reader(product.outputs[0], "Mul")
    if half is None or not is_scalar(other_input(half, product.outputs[0]), 0.5):
        return None
    return [div, erf, add, product, half]


def _dequantized(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.op_type == "DequantizeLinear" and is_default(producer)


class DequantizedGeluPass(ir.passes.InPlacePass):
    """Replace every ordered five-op GELU whose input is a DequantizeLinear's output by one
    ``com.microsoft.Gelu`` (and import that domain). GELUs ORT fuses itself are left standard."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for div in list(nodes(model)):
            if div.graph is None:
                continue
            found = _ordered_gelu(div)
            if found is None or not _dequantized(div.inputs[0]):
                continue
            last = found[-1]
            constants = [v for n in found for v in n.inputs if v is not None and v is not div.inputs[0]
                         and v.producer() not in found]
            gelu = ir.node("Gelu", inputs=[div.inputs[0]], domain=CONTRIB_DOMAIN, name=last.name)
            # the new node's output takes the GELU's output value's place (its name and every reader)
            ir.convenience.replace_nodes_and_values(div.graph, div, found, [gelu], [last.outputs[0]], [gelu.outputs[0]])
            drop_unread_constants(constants)
            modified = True
        if modified and CONTRIB_DOMAIN not in model.opset_imports:
            model.opset_imports[CONTRIB_DOMAIN] = 1
        return ir.passes.PassResult(model, modified)


def _bias_of(x: ir.Value, gelu: list[ir.Node]) -> tuple[ir.Node, ir.Value, np.ndarray] | None:
    """(the Add, its other input, the bias as 1-D) when ``x`` is ``y + bias`` for a constant bias
    along the last axis only, and the GELU's two readers of ``x`` are all it has."""
    add = x.producer()
    if add is None or x.is_graph_output() or {id(use.node) for use in x.uses()} - {id(n) for n in gelu}:
        return None
    found = last_axis_bias(add)
    return (add, *found) if found else None


class _BiasIntoGelu(ir.passes.InPlacePass):
    """Replace ``y + bias`` and the GELU after it with one ``com.microsoft`` op ``OP(y, bias)``."""

    #: the contrib op written, the name of its 1-D bias, and the matcher of the GELU's nodes
    #: (given the node that starts it; the GELU's input is that node's first input)
    OP: str
    BIAS_NAME: str

    @staticmethod
    def match(start: ir.Node) -> list[ir.Node] | None:
        raise NotImplementedError

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        taken: set[str] | None = None
        for start in list(graph_nodes(model)):  # it adds an initializer, which a function cannot hold
            graph = start.graph
            found = self.match(start) if isinstance(graph, ir.Graph) else None
            biased = found and _bias_of(start.inputs[0], found)
            if not biased:
                continue
            add, y, bias = biased
            taken = taken if taken is not None else taken_names(model)
            name = unique_name(self.BIAS_NAME, taken)
            bias_value = ir.Value(name=name, shape=ir.Shape(bias.shape), type=ir.TensorType(ir.DataType.FLOAT),
                                  const_value=ir.tensor(bias, name=name))
            graph.register_initializer(bias_value)
            last = found[-1]
            constants = [v for n in (add, *found) for v in n.inputs if v is not None and v is not y
                         and v is not start.inputs[0] and v.producer() not in found]
            node = ir.node(self.OP, inputs=[y, bias_value], domain=CONTRIB_DOMAIN, name=last.name)
            ir.convenience.replace_nodes_and_values(graph, add, [add, *found], [node], [last.outputs[0]], [node.outputs[0]])
            drop_unread_constants(constants)
            modified = True
        if modified and CONTRIB_DOMAIN not in model.opset_imports:
            model.opset_imports[CONTRIB_DOMAIN] = 1
        return ir.passes.PassResult(model, modified)


class BiasGeluPass(_BiasIntoGelu):
    """Replace ``y + bias`` followed by an ordered five-op GELU with one ``com.microsoft.BiasGelu``.

    A quantized linear whose output stays float runs in ONNX Runtime as ``MatMulIntegerToFloat``
    and a bias ``Add`` of its own: its QDQ fusion has no bias input there, and the bias has the
    input's rank (:mod:`onnxport.passes.linear_bias_rank`) so that ORT's MatMul+Add→Gemm fusion
    keeps the linear INT8 — which also keeps ORT's own Add+Gelu→BiasGelu fusion (a 1-D bias only)
    from taking it. Written as ``BiasGelu``, the bias is added inside the GELU's one pass, and the
    outputs are ORT's optimised run of the Add and Gelu, bit for bit. Against the five ops it may
    round a last bit differently, so the step's proof is the checker.
    """

    OP, BIAS_NAME = "BiasGelu", "bias_gelu.bias"
    match = staticmethod(_ordered_gelu)  # type: ignore[assignment]  # same signature, its own parameter name


def _tanh_gelu(pow_: ir.Node) -> list[ir.Node] | None:
    """The eight nodes of ``(x · 0.5) · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`` that start at
    ``pow_`` (transformers' ``gelu_new``, as the exporter writes it), or None."""
    if pow_.op_type != "Pow" or not is_default(pow_) or not is_scalar(pow_.inputs[1], 3.0):
        return None
    x = pow_.inputs[0]
    cube = only_reader(pow_.outputs[0], "Mul")
    inner = cube and only_reader(cube.outputs[0], "Add")
    if inner is None or not is_scalar(other_input(cube, pow_.outputs[0]), 0.044715, 1e-6) \
            or other_input(inner, cube.outputs[0]) is not x:
        return None
    scaled = only_reader(inner.outputs[0], "Mul")
    tanh = scaled and only_reader(scaled.outputs[0], "Tanh")
    if tanh is None or not is_scalar(other_input(scaled, inner.outputs[0]), float(np.sqrt(2 / np.pi)), 1e-6):
        return None
    one = only_reader(tanh.outputs[0], "Add")
    last = one and only_reader(one.outputs[0], "Mul")
    if last is None or not is_scalar(other_input(one, tanh.outputs[0]), 1.0):
        return None
    half = other_input(last, one.outputs[0])
    halving = half.producer() if half is not None else None
    if halving is None or halving.op_type != "Mul" or not is_default(halving) or len(half.uses()) != 1 \
            or other_input(halving, x) is None or not is_scalar(other_input(halving, x), 0.5):
        return None
    return [pow_, cube, inner, scaled, tanh, one, halving, last]


class BiasFastGeluPass(_BiasIntoGelu):
    """Replace ``y + bias`` followed by the tanh GELU with one ``com.microsoft.FastGelu(y, bias)``.

    The tanh form's counterpart of :class:`BiasGeluPass` (ALBERT's and GPT-2's ``gelu_new``):
    ORT fuses the eight ops into ``FastGelu`` itself, but takes the bias into it only when the
    bias is 1-D, which the rank-3 bias of a float-output INT8 linear is not. Its kernel is the
    one ORT's own fusion runs; against the eight ops it may round last bits differently, so the
    step's proof is the checker.
    """

    OP, BIAS_NAME = "FastGelu", "fast_gelu.bias"
    match = staticmethod(_tanh_gelu)  # type: ignore[assignment]  # same signature, its own parameter name
