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
    """onnxslim's default optimisation; ``modified`` says whether any node or constant changed.

    ``lift_larger_than``: initializers of more bytes are lifted out as graph inputs while onnxslim
    runs and put back after, untouched: onnxslim copies every constant it is handed (and a graph
    over 2 GB cannot be handed to it at all), so an LLM's weights would cost it their size again.
    It then cannot fold them, which ONNX Runtime does when it loads the file.
    """

    def __init__(self, lift_larger_than: int | None = None) -> None:
        super().__init__()
        self.lift_larger_than = lift_larger_than

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.lift_larger_than is None:
            return self._slim(model)
        graph = model.graph
        lifted = {name: value for name, value in graph.initializers.items()
                  if value.const_value is not None and value.const_value.nbytes > self.lift_larger_than}
        tensors = {}
        for name, value in lifted.items():
            graph.initializers.pop(name)
            tensors[name], value.const_value = value.const_value, None
            graph.inputs.append(value)
        try:
            result = self._slim(model)
        finally:  # the input model gets its weights back whatever happens
            for name, value in lifted.items():
                graph.inputs.remove(value)
                value.const_value = tensors[name]
                graph.register_initializer(value)
        inputs = {v.name: v for v in result.model.graph.inputs}
        for name, tensor in tensors.items():
            value = inputs.get(name)
            if value is None:
                continue  # onnxslim found the weight unused: it stays dropped
            result.model.graph.inputs.remove(value)
            value.const_value = tensor
            result.model.graph.register_initializer(value)
        return result

    def _slim(self, model: ir.Model) -> ir.passes.PassResult:
        import onnxslim

        proto = ir.to_proto(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # onnxslim's own progress chatter
            slimmed = onnxslim.slim(proto)
        modified = _shape_of(slimmed.graph) != _shape_of(proto.graph)
        return ir.passes.PassResult(ir.from_proto(slimmed), modified)
