"""The opset-lowering pass on hand-built graphs of a few nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxport._checks import check_identical_outputs, run
from onnxport._core.ir import on_proto
from onnxport.errors import ExportRefusedError
from onnxport.passes import LowerOpsetPass


def lower_opset(model, opset):
    """The pass on a proto, which is left as it was."""
    return on_proto(LowerOpsetPass(opset), model)


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
    onnx.checker.check_model(lowered, full_check=True)  # valid at opset 17
    check_identical_outputs(run(lowered, feeds, optimized=False), run(model, feeds, optimized=False), "lowered")


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
    node = helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0, reduction="max", name="scatter0")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array([1], np.int64), "i"), numpy_helper.from_array(np.array([5.0], np.float32), "u")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ExportRefusedError, match="ScatterElements node 'scatter0'.*opset 18"):
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


def _split_graph(length, parts: int = 3) -> onnx.ModelProto:
    outputs = [f"y{i}" for i in range(parts)]
    graph = helper.make_graph(
        [helper.make_node("Split", ["x"], outputs, axis=-1, num_outputs=parts)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, length])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["N", 5, None]) for o in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("length, sizes", [(24, [8, 8, 8]), (25, [9, 9, 7])])
def test_split_num_outputs_becomes_explicit_sizes_when_the_dimension_is_known(length, sizes):
    import onnxruntime as ort

    model = _split_graph(length)
    lowered = lower_opset(model, 17)
    node = lowered.graph.node[0]
    assert not any(a.name == "num_outputs" for a in node.attribute)
    stored = next(t for t in lowered.graph.initializer if t.name == node.input[1])
    assert numpy_helper.to_array(stored).tolist() == sizes
    onnx.checker.check_model(lowered, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 5, length)).astype(np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    runs = [ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
            for m in (model, lowered)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))


def test_split_along_a_dimension_known_only_at_run_time_is_refused_by_name():
    with pytest.raises(ExportRefusedError, match="Split node .* only known while the graph runs"):
        lower_opset(_split_graph("L"), 17)


def _assert_exported_at_opset_17(model, x, path) -> onnx.ModelProto:
    """``export_onnx`` at its default opset declares 17 and agrees with torch at another batch size."""
    import torch

    from onnxport import export_onnx, verify_onnx

    export_onnx(model, x, path)
    exported = onnx.load(str(path))
    assert next(e.version for e in exported.opset_import if e.domain in ("", "ai.onnx")) == 17
    assert verify_onnx(model, path, torch.cat([x, x[:1]]))
    return exported


def test_export_onnx_of_a_model_that_splits_evenly_works_at_the_default_opset(tmp_path):
    """GPT-2's attention splits its fused projection with tensor.split(size): opset 18's num_outputs."""
    import torch

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).split(8, dim=2)
            return q * k + v

    _assert_exported_at_opset_17(Fused().eval(), torch.randn(2, 5, 8), tmp_path / "split.onnx")


def _col2im_graph(strides: list[int], image: tuple[int, int] = (4, 9)) -> onnx.ModelProto:
    """2 channels folded from 2x3 blocks into a 4x9 image (6 blocks when they do not overlap)."""
    graph = helper.make_graph(
        [helper.make_node("Col2Im", ["x", "image", "block"], ["y"], name="fold", strides=strides)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, *image])],
        [numpy_helper.from_array(np.array(image, np.int64), "image"),
         numpy_helper.from_array(np.array([2, 3], np.int64), "block")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_col2im_of_non_overlapping_blocks_becomes_a_reshape_and_transpose():
    import onnxruntime as ort

    model = _col2im_graph([2, 3])
    lowered = lower_opset(model, 17)
    assert [n.op_type for n in lowered.graph.node] == ["Reshape", "Transpose", "Reshape"]
    assert {t.name for t in lowered.graph.initializer}.isdisjoint({"image", "block"})
    onnx.checker.check_model(lowered, full_check=True)
    x = np.random.default_rng(0).standard_normal((3, 12, 6)).astype(np.float32)
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for m in (model, lowered)]
    assert runs[0].shape == (3, 2, 4, 9)
    assert runs[0].tobytes() == runs[1].tobytes()


def test_col2im_whose_blocks_leave_a_margin_pads_it_with_zeros():
    import onnxruntime as ort

    # 2x3 blocks into 5x10: two rows and three columns of blocks cover 4x9, Col2Im leaves the rest 0
    # (MobileViTV2 folds 2x2 blocks into its 7x7 maps)
    model = _col2im_graph([2, 3], image=(5, 10))
    lowered = lower_opset(model, 17)
    assert [n.op_type for n in lowered.graph.node] == ["Reshape", "Transpose", "Reshape", "Pad"]
    onnx.checker.check_model(lowered, full_check=True)
    x = np.random.default_rng(1).standard_normal((3, 12, 6)).astype(np.float32)
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for m in (model, lowered)]
    assert runs[0].shape == (3, 2, 5, 10) and not runs[0][:, :, 4:, :].any() and runs[0][:, :, :4, :9].all()
    assert runs[0].tobytes() == runs[1].tobytes()


def test_col2im_of_overlapping_blocks_is_refused_by_name():
    with pytest.raises(ExportRefusedError, match="Col2Im node 'fold' folds blocks \\[2, 3\\] with strides \\[1, 1\\]"):
        lower_opset(_col2im_graph([1, 1]), 17)


def test_export_onnx_of_a_model_that_folds_patches_works_at_the_default_opset(tmp_path):
    """MobileViT-style patch attention unfolds an image into patches and folds it back."""
    import torch

    class Patches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            columns = torch.nn.functional.unfold(x, kernel_size=2, stride=2)  # [N, 8, 16]
            mixed = self.mix(columns.transpose(1, 2)).transpose(1, 2)
            return torch.nn.functional.fold(mixed, output_size=(8, 8), kernel_size=2, stride=2)

    exported = _assert_exported_at_opset_17(Patches().eval(), torch.randn(2, 2, 8, 8), tmp_path / "fold.onnx")
    assert "Col2Im" not in {n.op_type for n in exported.graph.node}
