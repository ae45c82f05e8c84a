"""Run-time quantized linear layers as ``DynamicQuantizeLinear`` + ``MatMulInteger``.

pt2e's dynamic scheme (``Quantizer(activations='dynamic')``) captures each linear layer as
``choose_qparams → quantize → dequantize → MatMul(·, DequantizeLinear(W))``. Translated
(:func:`onnxport.exporters.translation.dynamic_table`), ``choose_qparams`` is a
``DynamicQuantizeLinear`` whose scale and zero-point a ``QuantizeLinear`` of the same tensor then
reads. Two passes make that the standard integer form that ONNX Runtime fuses into
``DynamicQuantizeMatMul`` (bias included):

- :class:`DynamicQuantizePass`: the ``QuantizeLinear`` goes, its readers take
  ``DynamicQuantizeLinear``'s own first output, which is that quantization by definition; the
  scale and zero-point get their real types (the exporter annotates them as torch held them,
  double and int64).
- :class:`MatMulIntegerPass`: ``MatMul(DQ(a), DQ(W))`` becomes ``MatMulInteger(a, W, a_zp[, W_zp])
  → Cast → Mul(a_scale · W_scale)``: the product of the integers is exact in int32, where the
  float graph rounds every term; what is left is one float product per output, within the
  model's rounding floor.

Both are ``onnx_ir`` passes over every graph (If/Loop/Scan bodies included).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from .._core.ir import unique_name

_DEFAULT = ("", "ai.onnx")


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in _DEFAULT


def _dynamic_source(value: ir.Value | None) -> ir.Node | None:
    """The ``DynamicQuantizeLinear`` whose scale or zero-point ``value`` is, else ``None``."""
    producer = value.producer() if value is not None else None
    return producer if _is(producer, "DynamicQuantizeLinear") else None


class DynamicQuantizePass(ir.passes.InPlacePass):
    """A ``QuantizeLinear`` of the tensor a ``DynamicQuantizeLinear`` reads, with that node's scale
    and zero-point, is that node's first output: readers move to it and the node goes."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if _is(node, "DynamicQuantizeLinear"):
                quantized, scale, zero_point = node.outputs
                if scale.dtype != ir.DataType.FLOAT or zero_point.dtype != ir.DataType.UINT8 or scale.shape != ir.Shape([]):
                    scale.type, scale.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([])
                    zero_point.type, zero_point.shape = ir.TensorType(ir.DataType.UINT8), ir.Shape([])
                    quantized.type = ir.TensorType(ir.DataType.UINT8)
                    modified = True
                continue
            if not _is(node, "QuantizeLinear") or len(node.inputs) < 3:
                continue
            source = _dynamic_source(node.inputs[1])
            if source is None or node.inputs[0] is not source.inputs[0] or node.inputs[1] is not source.outputs[1] \
                    or node.inputs[2] is not source.outputs[2] or node.outputs[0].is_graph_output():
                continue
            node.outputs[0].replace_all_uses_with(source.outputs[0])
            node.graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)

    def ensures(self, model: ir.Model) -> None:
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            source = _dynamic_source(node.inputs[1]) if _is(node, "QuantizeLinear") and len(node.inputs) > 1 else None
            if source is not None and node.inputs[0] is source.inputs[0] and not node.outputs[0].is_graph_output():
                raise ir.passes.PostconditionError(f"'{node.name}' still quantizes what DynamicQuantizeLinear does.")


def _weight(value: ir.Value | None, transposed: bool = False) -> tuple[ir.Value, ir.Value, ir.Value | None] | None:
    """(int8 weight, scale, zero-point) of ``DequantizeLinear`` of a stored matrix whose scale is
    one value or one per output column (axis 1; axis 0 for a ``transposed`` [N, K] weight), else
    ``None``."""
    dq = value.producer() if value is not None else None
    if not _is(dq, "DequantizeLinear") or dq is None:
        return None
    weight, scale = dq.inputs[0], dq.inputs[1]
    zero_point = dq.inputs[2] if len(dq.inputs) > 2 else None
    if weight is None or weight.const_value is None or scale is None or scale.const_value is None:
        return None
    if weight.const_value.dtype != ir.DataType.INT8 or len(weight.const_value.shape) != 2:
        return None
    if zero_point is not None and zero_point.const_value is None:
        return None
    if scale.const_value.size > 1:
        axis = dq.attributes.get("axis")
        wanted = 0 if transposed else 1
        if (axis.as_int() if axis is not None else 1) % 2 != wanted \
                or scale.const_value.size != weight.const_value.shape[wanted]:
            return None
    return weight, scale, zero_point


def _plain_gemm(node: ir.Node) -> bool:
    """A Gemm that is ``A @ op(B) + C``: alpha and beta 1, A not transposed."""
    def attribute(name: str, default: float) -> float:
        found = node.attributes.get(name)
        return found.value if found is not None else default

    return attribute("alpha", 1.0) == 1.0 and attribute("beta", 1.0) == 1.0 and attribute("transA", 0) == 0


def _stored_transposed(graph: ir.Graph, weight: ir.Value, taken: set[str]) -> ir.Value:
    """``weight`` ([N, K]) stored as [K, N], as MatMulInteger reads it, in the reader's graph."""
    name = unique_name(f"{weight.name}_kn", taken)
    array = weight.const_value.numpy().T.copy()
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name), shape=ir.Shape(array.shape),
                     type=ir.TensorType(ir.DataType.INT8))
    graph.register_initializer(value)
    return value


class MatMulIntegerPass(ir.passes.InPlacePass):
    """``MatMul(DequantizeLinear(DynamicQuantizeLinear(x)), DequantizeLinear(W))`` as
    ``MatMulInteger → Cast → Mul(a_scale · W_scale)`` (a plain ``Gemm`` too: its weight stored
    [K, N], its bias an ``Add`` after); ``modified`` says whether one was found."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        taken = {v.name for node in ir.traversal.RecursiveGraphIterator(model.graph)
                 for v in (*node.inputs, *node.outputs) if v is not None and v.name}
        taken |= set(model.graph.initializers)
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            gemm = _is(node, "Gemm") and _plain_gemm(node)
            if not (_is(node, "MatMul") or gemm):
                continue
            a_dq = node.inputs[0].producer() if node.inputs[0] is not None else None
            if not _is(a_dq, "DequantizeLinear") or a_dq is None or len(a_dq.inputs) < 3:
                continue
            source = _dynamic_source(a_dq.inputs[1])
            if source is None or a_dq.inputs[0] is not source.outputs[0] or a_dq.inputs[2] is not source.outputs[2]:
                continue
            trans_b = gemm and node.attributes.get("transB") is not None and node.attributes["transB"].value == 1
            weight = _weight(node.inputs[1], transposed=trans_b)
            if weight is None:
                continue
            w, w_scale, w_zero_point = weight
            if trans_b:
                w = _stored_transposed(node.graph, w, taken)
            bias = node.inputs[2] if gemm and len(node.inputs) > 2 else None
            inputs: list[ir.Value | None] = [source.outputs[0], w, source.outputs[2]]
            if w_zero_point is not None and w_zero_point.const_value.numpy().any():
                inputs.append(w_zero_point)
            name = node.name or "matmul"
            integer = ir.node("MatMulInteger", inputs, name=f"{name}_integer")
            cast = ir.node("Cast", [integer.outputs[0]], {"to": ir.DataType.FLOAT}, name=f"{name}_to_float")
            scales = ir.node("Mul", [source.outputs[1], w_scale], name=f"{name}_scales")
            scaled = ir.node("Mul", [cast.outputs[0], scales.outputs[0]], name=f"{name}_scaled")
            added = [ir.node("Add", [scaled.outputs[0], bias], name=f"{name}_bias")] if bias is not None else []
            node.graph.insert_before(node, [integer, cast, scales, scaled, *added])
            shape = node.outputs[0].shape
            integer.outputs[0].type, integer.outputs[0].shape = ir.TensorType(ir.DataType.INT32), shape
            for made in (cast, scaled, *added):
                made.outputs[0].type, made.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), shape
            scales.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
            scaled = added[0] if added else scaled
            output_name = node.outputs[0].name
            node.outputs[0].replace_all_uses_with(scaled.outputs[0], replace_graph_outputs=True)
            node.outputs[0].name = f"{name}_float"
            scaled.outputs[0].name = output_name  # a graph output keeps its name
            node.graph.remove(node, safe=True)
            modified = True
        if modified:
            RemoveUnusedNodesPass()(model)  # the dequantizers nothing reads any more
        return ir.passes.PassResult(model, modified)
