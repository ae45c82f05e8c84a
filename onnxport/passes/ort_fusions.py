"""ONNX Runtime's CPU contrib fusions of a transformer graph, as an ``onnx_ir`` pass.

onnxscript's ``optimize_for_ort`` rewrites standard-op patterns into com.microsoft operators
(SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, RotaryEmbedding,
MultiHeadAttention, GroupQueryAttention, Gelu): kernels ONNX Runtime's CPU provider runs in one
call. What the result holds is kept in :attr:`OrtFusionPass.fusions` (fused operators by type),
so the exporter can report them; onnxscript's own rule counts are not used, since a rule may fire
and a later one undo it (its rotary rule counts on a graph with no RotaryEmbedding left). The fused kernels add in another order, so the outputs move by more
than a last bit: the exporter proves the result on the written file.
"""

from __future__ import annotations

import warnings
from collections import Counter

import onnx_ir as ir

#: Fused operators: those the pass may write (com.microsoft, and SimplifiedLayerNormalization,
#: which ONNX Runtime registers in the default domain), opset 23's own Attention,
#: RotaryEmbedding and RMSNormalization, which torch.onnx writes there and ORT runs in one call,
#: and the decoder's GroupQueryAttention.
FUSED_OPS = frozenset({
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization",
    "RotaryEmbedding", "MultiHeadAttention", "GroupQueryAttention", "Attention", "Gelu", "FastGelu", "BiasGelu",
    "RMSNormalization", "MoE",
})


def fused_ops(model: ir.Model) -> Counter:
    """The fused operators a model holds, by type (bodies included)."""
    return Counter(node.op_type for node in model.graph.all_nodes() if node.op_type in FUSED_OPS)


def _fuse_without_attention(model: ir.Model) -> None:
    """onnxscript's normalisation, rotary and GELU fusions, leaving attention as it is."""
    from onnx_ir.passes import common
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter.ort_fusions import bias_gelu, cos_sin_cache, gelu, rms_normalization, rotary_embedding
    from onnxscript.rewriter.ort_fusions import skip_normalization as skip

    common.ShapeInferencePass()(model)
    optimize(model)
    for fuse in (rms_normalization.fuse_rms_normalization, skip.fuse_skip_layer_normalization,
                 skip.fuse_skip_rms_normalization, rotary_embedding.fuse_rotary_embedding,
                 cos_sin_cache.fuse_cos_sin_cache, rotary_embedding.fuse_partial_rotary_embedding,
                 gelu.fuse_gelu, bias_gelu.fuse_bias_gelu):
        fuse(model)
    optimize(model)


class OrtFusionPass(ir.passes.InPlacePass):
    """onnxscript's ONNX Runtime fusions, in place; ``fusions`` counts the fused operators the
    result holds that the input did not.

    ``attention=False`` leaves attention unfused: onnxscript's attention rules can write a graph
    ONNX Runtime refuses (GPT-2's 2-D linear layers after attention: a MultiHeadAttention whose
    3-D output feeds a Gemm), which the exporter finds on the file and then asks for this.
    """

    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        self.attention = attention
        self.fusions: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        before = [(node.op_type, node.domain, len(node.inputs)) for node in model.graph.all_nodes()]
        had = fused_ops(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.attention:
                fused, _ = optimize_for_ort(model)
            else:
                _fuse_without_attention(model)
                fused = model
        if fused is not model:  # the rewriter works in place today; keep the pass honest if that changes
            raise AssertionError("onnxscript's optimize_for_ort returned a new model; OrtFusionPass expects it in place.")
        self.fusions = dict(fused_ops(model) - had)
        after = [(node.op_type, node.domain, len(node.inputs)) for node in model.graph.all_nodes()]
        return ir.passes.PassResult(model, modified=after != before)

    def ensures(self, model: ir.Model) -> None:
        # a fused node must be one ONNX Runtime knows: its domain is imported by the model
        for node in model.graph.all_nodes():
            if node.domain and node.domain not in model.opset_imports:
                raise ir.passes.PostconditionError(f"{node.op_type} is in domain '{node.domain}', which the model does not import.")
