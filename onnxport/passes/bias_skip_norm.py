"""Write a linear's bias, the residual Add after it and the LayerNormalization of that sum as one
ONNX Runtime ``SkipLayerNormalization`` that takes the bias.

A post-norm encoder layer (BERT and its family) ends each block with ``LayerNorm((y + b) + x)``:
``y`` a linear's product, ``b`` its bias, ``x`` the residual. ONNX Runtime's load-time fusion
turns the residual Add and the norm into ``SkipLayerNormalization`` and takes the bias in too,
but only a 1-D bias; the bias of a quantized linear with a float output has its input's rank
(:mod:`onnxport.passes.linear_bias_rank`: a 1-D one would turn the linear into a float Gemm), so
the fusion leaves it an Add over the whole block output. Written as the fused op with the bias as
its fifth input, the bias is added in the norm's own pass: two of each BERT layer's five bias
Adds go (the sweep in docs/benchmarks.md measures it). The kernel adds the three terms in its own
order, so the step's proof is the checker.

A pre-norm layer's sum, which flows on as the next residual too, is left alone: written as the
kernel with its fourth output (the sum) it is no faster than the two Adds and the norm.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._core.ir import (
    CONTRIB_DOMAIN,
    const_array,
    drop_unread_constants,
    is_default,
    last_axis_bias,
    nodes,
    only_reader,
    taken_names,
    unique_name,
)


def _biased_sum(total: ir.Value, norm: ir.Node, hidden: int) -> tuple[ir.Node, ir.Node, ir.Value, ir.Value, np.ndarray] | None:
    """(the residual Add, the bias Add, the product, the residual, the 1-D bias) of
    ``total = (y + bias) + skip``, each sum read only on the way to ``norm``."""
    residual = total.producer()
    if residual is None or residual.op_type != "Add" or only_reader(total, "LayerNormalization") is not norm:
        return None
    for index in (0, 1):
        biased, skip = residual.inputs[index], residual.inputs[1 - index]
        add = biased.producer() if biased is not None else None
        found = add and only_reader(biased, "Add") is residual and last_axis_bias(add)
        if not found:
            continue
        y, bias = found
        shapes = [v.shape for v in (y, skip)]
        if any(s is None or s.rank() != 3 for s in shapes) or list(shapes[0]) != list(shapes[1]) or bias.size != hidden:
            continue
        return residual, add, y, skip, bias
    return None


class BiasSkipLayerNormPass(ir.passes.InPlacePass):
    """Rewrite every ``LayerNormalization((y + bias) + skip, γ, β)`` over the last axis of two
    same-shaped rank-3 operands, with a constant bias along that axis, as com.microsoft
    ``SkipLayerNormalization(y, skip, γ, β, bias)``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        taken: set[str] | None = None
        for norm in list(nodes(model)):
            graph = norm.graph
            if not isinstance(graph, ir.Graph) or norm.op_type != "LayerNormalization" or not is_default(norm):
                continue
            if any(o.uses() or o.is_graph_output() for o in norm.outputs[1:]) or len(norm.inputs) < 2:
                continue
            if norm.attributes.get_int("axis", -1) not in (-1, 2) or norm.attributes.get_int("stash_type", 1) != 1:
                continue
            gamma = norm.inputs[1]
            beta = norm.inputs[2] if len(norm.inputs) > 2 else None
            weights = [const_array(v) for v in (gamma, beta) if v is not None]
            if not weights or any(w is None or w.ndim != 1 for w in weights):
                continue
            found = _biased_sum(norm.inputs[0], norm, weights[0].size)
            if found is None:
                continue
            residual, add, y, skip, bias = found
            taken = taken if taken is not None else taken_names(model)
            name = unique_name("skip_layer_norm.bias", taken)
            bias_value = ir.Value(name=name, shape=ir.Shape(bias.shape), type=ir.TensorType(ir.DataType.FLOAT),
                                  const_value=ir.tensor(bias, name=name))
            graph.register_initializer(bias_value)
            fused = ir.node("SkipLayerNormalization", inputs=[y, skip, gamma, beta, bias_value],
                            attributes={"epsilon": norm.attributes.get_float("epsilon", 1e-5)},
                            domain=CONTRIB_DOMAIN, name=norm.name or None)
            old_bias = [v for v in add.inputs if v is not y]
            ir.convenience.replace_nodes_and_values(graph, norm, [add, residual, norm], [fused],
                                                    [norm.outputs[0]], [fused.outputs[0]])
            drop_unread_constants(old_bias)
            modified = True
        if modified and CONTRIB_DOMAIN not in model.opset_imports:
            model.opset_imports[CONTRIB_DOMAIN] = 1
        return ir.passes.PassResult(model, modified)
