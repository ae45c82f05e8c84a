"""Write a residual ``Add`` and the ``RMSNormalization`` that reads it as ONNX Runtime's
``SkipSimplifiedLayerNormalization``.

A pre-norm decoder layer adds each block's output to the residual stream and normalises the sum
for the next block; the sum itself also flows on as the next residual. ONNX Runtime's CPU
provider has one kernel for both (``SkipSimplifiedLayerNormalization``: the sum, written as its
fourth output, and its RMS norm in one pass over the hidden vector), but its own load-time fusion
looks for ``SimplifiedLayerNormalization`` only, not opset 23's ``RMSNormalization`` that
torch.onnx writes. The kernel adds in another order, so the step's proof is the decoder's
outputs on the written file.
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import CONTRIB_DOMAIN, graphs, is_default


def _last_axis(norm: ir.Node, rank: int) -> bool:
    axis = norm.attributes.get_int("axis", -1)
    return axis in (-1, rank - 1)


class SkipRmsNormPass(ir.passes.InPlacePass):
    """Rewrite every ``RMSNormalization(Add(a, b), w)`` over the last axis of two same-shaped
    rank-3 operands (float32 statistics) as com.microsoft ``SkipSimplifiedLayerNormalization``,
    the sum's other readers reading its fourth output; ``rewritten`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten = 0
        for graph in graphs(model):
            for norm in [n for n in graph if n.op_type == "RMSNormalization" and is_default(n)]:
                if self._rewrite(graph, norm):
                    self.rewritten += 1
        if self.rewritten:
            model.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
        return ir.passes.PassResult(model, modified=self.rewritten > 0)

    @staticmethod
    def _rewrite(graph: ir.Graph, norm: ir.Node) -> bool:
        if len(norm.inputs) != 2 or norm.inputs[1] is None or len([o for o in norm.outputs if o.uses() or o.is_graph_output()]) > 1:
            return False
        total, weight = norm.inputs
        add = total.producer()
        if add is None or add.op_type != "Add" or not is_default(add) or add.graph is not graph:
            return False
        left, right = add.inputs
        shapes = [v.shape for v in (left, right)]
        if any(s is None or s.rank() != 3 for s in shapes) or shapes[0] != shapes[1] or left.dtype != right.dtype:
            return False
        hidden = shapes[0][2]
        if not isinstance(hidden, int) or weight.shape is None or list(weight.shape) != [hidden]:
            return False
        if not _last_axis(norm, 3) or norm.attributes.get_int("stash_type", 1) != 1:
            return False
        fused = ir.node(
            "SkipSimplifiedLayerNormalization", inputs=[left, right, weight],
            attributes={"epsilon": norm.attributes.get_float("epsilon", 1e-5)},
            domain=CONTRIB_DOMAIN, num_outputs=4, name=norm.name or None,
        )
        output, _, _, total_out = fused.outputs
        graph.insert_before(norm, [fused])
        # the sum's other readers (the next residual) read the fused node's copy of it
        ir.convenience.replace_nodes_and_values(graph, fused, [norm], [], [norm.outputs[0]], [output])
        ir.convenience.replace_nodes_and_values(graph, fused, [add], [], [total], [total_out])
        return True
