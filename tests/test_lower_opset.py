"""The opset-lowering pass on hand-built graphs of a few nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxport._checks import check_lowered
from onnxport.errors import ExportRefusedError
from onnxport.passes import lower_opset


def _reduce_graph(op: str = "ReduceMean", axes_from_constant: bool = True, keepdims: int = 0) -> onnx.ModelProto:
    nodes = []
    inits = []
    if axes_from_constant:
        inits.append(numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes"))
    else:
        nodes.append(helper.make_node("Shape", ["x"], ["shape"], start=2))
        nodes.append(helper.make_node("Sub", ["shape", "two"], ["axes"]))
        inits.append(numpy_helper.from_array(np.array([0, 0], dtype=np.int64), "two"))
    nodes.append(helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceL2", "ReduceProd"])
def test_reduce_axes_input_becomes_attribute(op):
    model = _reduce_graph(op)
    lowered = lower_opset(model, 17)
    node = lowered.graph.node[0]
    assert list(node.input) == ["x"]
    assert helper.get_attribute_value(node.attribute[-1]) == [2, 3]
    assert lowered.opset_import[0].version == 17
    assert len(lowered.graph.initializer) == 0  # the axes constant is gone
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)}
    check_lowered(lowered, model, feeds)  # checker at 17 + byte-identical outputs


def test_input_model_untouched_and_pass_idempotent():
    model = _reduce_graph()
    before = model.SerializeToString()
    once = lower_opset(model, 17)
    assert model.SerializeToString() == before
    assert lower_opset(once, 17).SerializeToString() == once.SerializeToString()


def test_reduce_sum_keeps_its_axes_input_down_to_13():
    lowered = lower_opset(_reduce_graph("ReduceSum"), 13)
    assert list(lowered.graph.node[0].input) == ["x", "axes"]


def test_computed_axes_are_refused_naming_the_node():
    with pytest.raises(ExportRefusedError, match="ReduceMean node .* computed while the graph runs"):
        lower_opset(_reduce_graph(axes_from_constant=False), 17)


def test_operator_with_newer_form_is_refused():
    node = helper.make_node("Split", ["x"], ["a", "b"], axis=0, num_outputs=2, name="split0")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ExportRefusedError, match="Split node 'split0'.*opset 18"):
        lower_opset(model, 17)


def test_operator_missing_before_its_opset_is_refused():
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y"], name="ln")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert lower_opset(model, 17).opset_import[0].version == 17
    with pytest.raises(ExportRefusedError, match="LayerNormalization node 'ln' has no definition before opset 17"):
        lower_opset(model, 16)
