"""The atomic-write helper: a target holds a complete, checked file or is left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxport._io import check_output_path, external_data_files, staged_output, write_model
from onnxport.errors import InvalidArgumentError
from onnxport.files import save_model
from tests.conftest import listing


def _tiny_model(weight_size: int = 4096) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(weight_size, dtype=np.float32).reshape(1, -1), "w")
    node = helper.make_node("Add", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight_size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, weight_size])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_save_model_writes_a_checked_file_and_nothing_else(tmp_path):
    target = save_model(_tiny_model(), tmp_path / "m.onnx")
    assert sorted(listing(tmp_path)) == ["m.onnx"]
    onnx.checker.check_model(str(target))


def test_failure_inside_stage_keeps_previous_file_byte_for_byte(tmp_path):
    target = tmp_path / "m.onnx"
    target.write_bytes(b"previous good file")
    before = listing(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), staged_output(target) as staged:
        write_model(_tiny_model(), staged, external_data=True)
        assert (staged.parent / "m.onnx.data").exists()
        raise RuntimeError("boom")
    assert listing(tmp_path) == before


def test_failed_check_leaves_target_absent(tmp_path):
    bad = _tiny_model()
    bad.graph.node[0].input[1] = "missing"  # refers to a tensor nobody defines
    with pytest.raises(InvalidArgumentError, match="fails onnx.checker, so '.*m.onnx' was not written"):
        save_model(bad, tmp_path / "m.onnx")
    assert listing(tmp_path) == {}


def test_external_data_moves_with_the_model_and_scratch_files_do_not(tmp_path):
    target = tmp_path / "big.onnx"
    with staged_output(target) as staged:
        write_model(_tiny_model(), staged, external_data=True)
        (staged.parent / "scratch.onnx").write_bytes(b"intermediate")
    assert sorted(listing(tmp_path)) == ["big.onnx", "big.onnx.data"]
    assert external_data_files(target) == [tmp_path / "big.onnx.data"]
    loaded = onnx.load(str(target))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]).ravel(), np.arange(4096))


def test_replacing_an_external_data_model(tmp_path):
    target = tmp_path / "big.onnx"
    save_model(_tiny_model(4096), target, external_data=True)
    save_model(_tiny_model(2048), target, external_data=True)
    assert sorted(listing(tmp_path)) == ["big.onnx", "big.onnx.data"]
    assert onnx.load(str(target)).graph.initializer[0].dims == [1, 2048]


def test_output_path_errors_name_the_argument(tmp_path):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        check_output_path(tmp_path / "nowhere" / "m.onnx")
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        check_output_path(tmp_path)
    with pytest.raises(InvalidArgumentError, match="output_path must be"):
        check_output_path(42)
