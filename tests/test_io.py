"""The atomic-write helper: a target holds a complete, checked file or is left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxport import save_model
from onnxport._core.io import check_output_path, external_data_files, staged_output
from onnxport._core.ir import write_model
from onnxport.errors import InvalidArgumentError
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


def test_a_failed_model_replace_leaves_the_previous_model_and_its_data(tmp_path, monkeypatch):
    """The model and its data cannot move in one step: when the model's replace fails after the
    data moved, the previous data must come back, or the previous model reads new weights."""
    import os

    from onnxport._core import io
    from onnxport.errors import WriteError

    target = tmp_path / "m.onnx"
    save_model(_tiny_model(), target, external_data=True)
    before = listing(tmp_path)
    new = _tiny_model()
    new.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.full((1, 4096), 7.0, np.float32), "w"))
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(dst) == os.fspath(target):  # the model's own move: the commit
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(WriteError, match="previous file is untouched"), staged_output(target) as staged:
        write_model(new, staged, external_data=True)
    monkeypatch.undo()
    assert listing(tmp_path) == before
    loaded = onnx.load(str(target))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), np.arange(4096, dtype=np.float32).reshape(1, -1))


def test_a_failed_data_replace_leaves_no_new_data_beside_the_previous_model(tmp_path, monkeypatch):
    import os

    from onnxport._core import io
    from onnxport.errors import WriteError

    target = tmp_path / "m.onnx"
    target.write_bytes(onnx.load_from_string(_tiny_model().SerializeToString()).SerializeToString())
    before = listing(tmp_path)
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(dst).endswith(".data"):
            raise OSError(27, "File too large")
        return real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(WriteError, match="File too large"), staged_output(target) as staged:
        write_model(_tiny_model(), staged, external_data=True)
    monkeypatch.undo()
    assert listing(tmp_path) == before


def test_a_large_single_file_model_is_written_a_weight_at_a_time_and_reads_back_the_same(tmp_path, monkeypatch):
    """Over STREAM_INLINE_BYTES, save_ir writes the model without its weights, then each weight as
    a further graph field: every reader merges them into the model ir.save would have written."""
    import onnx_ir as ir
    import onnxruntime as ort

    import onnxport._core.ir as ir_module

    rng = np.random.default_rng(3)
    w1, w2 = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    monkeypatch.setattr(ir_module, "STREAM_INLINE_BYTES", 2**62)
    whole = ir_module.save_ir(model, tmp_path / "whole.onnx")
    monkeypatch.setattr(ir_module, "STREAM_INLINE_BYTES", 1)
    streamed = ir_module.save_ir(model, tmp_path / "streamed.onnx")
    assert whole.read_bytes() != streamed.read_bytes()  # written another way: the test compares two writers
    assert sorted(listing(tmp_path)) == ["streamed.onnx", "whole.onnx"]  # one file each, no data beside
    assert onnx.load(str(streamed)) == onnx.load(str(whole))
    onnx.checker.check_model(str(streamed), full_check=True)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    runs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0] for p in (whole, streamed)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert [v.const_value.numpy().tobytes() for v in model.graph.initializers.values()] == [w1.tobytes(), w2.tobytes()]


def _resident_file_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


def test_mapped_file_pages_are_given_back_and_read_again_unchanged(tmp_path):
    # a model loaded from safetensors views its mapped file privately, as torch.from_file does here
    import torch

    from onnxport._core.io import MappedFilePages

    size = 32 << 20
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    (tmp_path / "weights.bin").write_bytes(data.tobytes())
    mapped = torch.from_file(str(tmp_path / "weights.bin"), shared=False, size=size, dtype=torch.uint8)
    total = int(mapped.sum())  # every page read: resident
    mapped[:10] = 7  # a written page is the process's own: it must survive the release
    pages = MappedFilePages()
    before = _resident_file_bytes()
    if not pages.release(mapped.data_ptr(), size):
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4)")
    assert before - _resident_file_bytes() > size // 2
    assert int(mapped[10:].sum()) == total - int(data[:10].sum()) and torch.equal(mapped[:10], torch.full((10,), 7, dtype=torch.uint8))
    # memory that maps no file (the heap, a tensor of the process's own) is never touched
    own = torch.ones(size, dtype=torch.uint8)
    assert not MappedFilePages().release(own.data_ptr(), size)
