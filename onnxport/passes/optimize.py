"""Graph optimisation with onnxslim, as an ``onnx_ir`` pass.

onnxslim folds constants and fuses patterns without touching Q/DQ pairs (measured against
onnxoptimizer and the onnxscript optimizer; see docs/float-export.md). It works on protos,
so the pass is functional: it returns a new model.
"""

from __future__ import annotations

import warnings

import onnx
import onnx_ir as ir


def _shape_of(graph: onnx.GraphProto) -> tuple:
    """What onnxslim may change, without the initializers' bytes: nodes, constant names and dims."""
    return ([n.SerializeToString() for n in graph.node], [(t.name, tuple(t.dims), t.data_type) for t in graph.initializer])


class OnnxSlimPass(ir.passes.FunctionalPass):
    """onnxslim's default optimisation; ``modified`` says whether any node or constant changed."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        import onnxslim

        proto = ir.to_proto(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # onnxslim's own progress chatter
            slimmed = onnxslim.slim(proto)
        modified = _shape_of(slimmed.graph) != _shape_of(proto.graph)
        return ir.passes.PassResult(ir.from_proto(slimmed), modified)
