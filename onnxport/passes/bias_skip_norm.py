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

import onnx_ir as ir
from onnxscript.rewriter import pattern

from .._core.ir import CONTRIB_DOMAIN, const_array, last_axis_bias


class _BiasSkipLayerNorm(pattern.RewriteRuleClassBase):
    """``LayerNormalization((y + bias) + skip, γ, β)`` → ``SkipLayerNormalization(y, skip, γ, β, bias)``.

    The matcher refuses a match whose inner sums are read outside it, so a pre-norm layer's sum
    (read again as the next residual) is left alone.
    """

    def pattern(self, op, y, bias, skip, gamma):
        # β is optional in LayerNormalization: read from the node when there
        return op.LayerNormalization(op.Add(op.Add(y, bias), skip), gamma, _allow_other_inputs=True,
                                     _allow_other_attributes=True, _outputs=["normed"])

    def check(self, context, y, bias, skip, gamma, normed, **_):
        result = pattern.MatchResult()
        norm = normed.producer()
        if norm.attributes.get_int("axis", -1) not in (-1, 2) or norm.attributes.get_int("stash_type", 1) != 1:
            return result.fail("not a LayerNormalization over the last axis with a float32 stash")
        weights = [const_array(v) for v in norm.inputs[1:]]
        if any(w is None or w.ndim != 1 for w in weights):
            return result.fail("γ or β is not a constant vector")
        found = last_axis_bias(norm.inputs[0].producer().inputs[0].producer())
        if found is None or found[0] is not y or found[1].size != weights[0].size:
            return result.fail("the inner Add's bias is not a constant along the last axis", bias)
        shapes = [v.shape for v in (y, skip)]
        if any(s is None or s.rank() != 3 for s in shapes) or list(shapes[0]) != list(shapes[1]):
            return result.fail("the product and the residual are not same-shaped rank-3 tensors")
        return result

    def rewrite(self, op, y, bias, skip, gamma, normed, **_):
        # value names are unique in a model, so the new bias's name is too (the rewriter would
        # overwrite an initializer of the same name)
        flat = op.initializer(ir.tensor(const_array(bias).reshape(-1)), name=f"{normed.name}.skip_bias")
        norm = normed.producer()
        beta = norm.inputs[2] if len(norm.inputs) > 2 else None
        epsilon = norm.attributes.get_float("epsilon", 1e-5)
        fused = op.SkipLayerNormalization(y, skip, gamma, beta, flat, epsilon=epsilon, _domain=CONTRIB_DOMAIN)
        fused.producer().name = norm.name  # the norm's place in the model, which reports name it by
        return fused


_RULES = pattern.RewriteRuleSet(list(_BiasSkipLayerNorm.rule().commute()))


class BiasSkipLayerNormPass(ir.passes.InPlacePass):
    """Rewrite every ``LayerNormalization((y + bias) + skip, γ, β)`` over the last axis of two
    same-shaped rank-3 operands, with a constant bias along that axis, as com.microsoft
    ``SkipLayerNormalization(y, skip, γ, β, bias)`` (graphs and their bodies)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        fused = _RULES.apply_to_model(model)
        if fused and CONTRIB_DOMAIN not in model.opset_imports:
            model.opset_imports[CONTRIB_DOMAIN] = 1
        return ir.passes.PassResult(model, bool(fused))
