"""Give the bias of a quantized linear with a float output the rank of its input, so ONNX Runtime
keeps the linear in INT8 when shapes are static.

ONNX Runtime's ``MatMulAddFusion`` (level 2, CPU) turns ``MatMul → Add(bias)`` into ``Reshape →
Gemm → Reshape`` whenever the MatMul's input shape is fully known, and it runs before the QDQ
fusions. A linear whose output a QuantizeLinear reads still becomes a QGemm; one whose output
stays float (the projections before attention's reshape, an MLP's first layer before GELU:
``float_linear_outputs``) is left as a float Gemm fed by two DequantizeLinears — the weight is
dequantized on every run and the product is float, several times slower than the same linear as
``MatMulIntegerToFloat``. With a dynamic axis the fusion does not apply, so only files with
static shapes need this.

The fusion accepts a bias of shape ``[N]`` only when it has to reshape a 3-D input; ``[1, 1, N]``
broadcasts to the very same sums, so the rewrite changes no value (proven by identical outputs)
and the QDQ fusion then sees its usual ``DQ → MatMul`` pattern.
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import constant_shape, is_default, nodes, taken_names, unique_name


def _from_dequantize(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.op_type == "DequantizeLinear" and is_default(producer)


def _static_rank(value: ir.Value) -> int | None:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return len(shape)


def _bias_to_reshape(matmul: ir.Node) -> tuple[ir.Node, int, ir.Value, int] | None:
    """(the Add, the bias's input index, the bias constant, the rank to give it) when ``matmul``
    is a quantized linear with a float output that ORT would turn into a float Gemm."""
    if matmul.op_type != "MatMul" or not is_default(matmul) or len(matmul.inputs) != 2:
        return None
    activation, weight = matmul.inputs
    rank = _static_rank(activation) if activation is not None else None
    if rank is None or rank < 3 or not (_from_dequantize(activation) and _from_dequantize(weight)):
        return None
    dims = constant_shape(weight)  # the weight's DQ output need not carry a shape; its constant does
    if dims is None or len(dims) != 2:
        return None
    out = matmul.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out.is_graph_output():
        return None
    add, index = uses[0]
    if add.op_type != "Add" or not is_default(add) or len(add.inputs) != 2:
        return None
    readers = list(add.outputs[0].uses())
    if readers and all(r.node.op_type == "QuantizeLinear" for r in readers):
        return None  # a quantized output: ORT makes the Gemm a QGemm, which is what it should be
    bias = add.inputs[1 - index]
    if bias is None or bias.const_value is None or bias.shape is None or len(bias.shape) != 1:
        return None
    return add, 1 - index, bias, rank


class LinearBiasRankPass(ir.passes.InPlacePass):
    """Reshape each such bias from ``[N]`` to ``[1, …, 1, N]`` (the input's rank)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        taken: set[str] | None = None
        for matmul in list(nodes(model)):
            found = _bias_to_reshape(matmul)
            if found is None or matmul.graph is None:
                continue
            add, index, bias, rank = found
            taken = taken if taken is not None else taken_names(model)
            values = bias.const_value.numpy().reshape((1,) * (rank - 1) + (-1,))
            name = unique_name(f"{bias.name}.rank{rank}", taken)
            reshaped = ir.Value(name=name, type=ir.TensorType(bias.dtype), shape=ir.Shape(values.shape),
                                const_value=ir.tensor(values, name=name))
            matmul.graph.register_initializer(reshaped)
            add.replace_input_with(index, reshaped)
            if not list(bias.uses()) and bias.is_initializer() and not bias.is_graph_output():
                bias.graph.initializers.pop(bias.name)
            modified = True
        return ir.passes.PassResult(model, modified)
