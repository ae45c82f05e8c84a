"""The export engine on a hand-built plan: one capture, steps proven in order, one write, the file's
proofs, and a target that is either the proven file or exactly what it was."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from onnxport.engine import ExportPlan, run_plan, validate_opset
from onnxport.errors import ExportRefusedError, InvalidArgumentError
from onnxport.passes.lower_opset import LowerOpsetPass
from onnxport.pipeline import IdenticalOutputs, Step


def _graph() -> ir.Model:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "g", [x], [y], [two]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    return ir.from_proto(model)


def _plan(**changes) -> ExportPlan:
    fields = {
        "name": "hand-built", "opset": 17, "feeds": {"x": np.ones((2, 4), np.float32)}, "capture": _graph,
        "steps": [Step("lower to opset 17", LowerOpsetPass(17), IdenticalOutputs)], "axes": {"x": {0: "batch"}},
    }
    fields.update(changes)
    return ExportPlan(**fields)


def test_a_plan_is_captured_stepped_written_once_and_proven(tmp_path, caplog):
    target = tmp_path / "m.onnx"
    seen = []
    with caplog.at_level(logging.INFO, logger="onnxport"):
        result = run_plan(_plan(rules=[seen.append], metadata={"k": "v"}), target)
    assert result.path == target and result.changed == ["lower to opset 17"]
    # the reference (once) and the lowered graph, both unoptimised, then the file at the default level
    assert result.sessions == 3
    # the rules read the staged file, before it replaces the target; the stage is gone after
    assert len(seen) == 1 and seen[0].name == "m.onnx" and seen[0].parent.parent == tmp_path
    assert not seen[0].exists()
    model = onnx.load(str(target))
    assert model.opset_import[0].version == 17 and {p.key: p.value for p in model.metadata_props}["k"] == "v"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    logged = caplog.text
    assert "step 'lower to opset 17': changed the graph; proof: identical outputs" in logged
    assert "proving the file" in logged and "proven and in place" in logged


def test_a_refusing_rule_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "m.onnx"
    target.write_bytes(b"the previous file")

    def refuse(path):
        raise ExportRefusedError("the rule refuses")

    with pytest.raises(ExportRefusedError, match="the rule refuses"):
        run_plan(_plan(rules=[refuse]), target)
    assert target.read_bytes() == b"the previous file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_a_rule_that_onnx_runtime_cannot_run_is_a_refusal_and_leaves_the_target(tmp_path):
    import onnxruntime as ort

    target = tmp_path / "m.onnx"
    target.write_bytes(b"the previous file")

    def run_at_a_wrong_width(path):
        ort.InferenceSession(str(path)).run(None, {"x": np.ones((2, 5), np.float32)})

    with pytest.raises(ExportRefusedError, match="ONNX Runtime cannot run the written file while proving it"):
        run_plan(_plan(rules=[run_at_a_wrong_width]), target)
    assert target.read_bytes() == b"the previous file"
    # a rule's own bug is not dressed up as the file's refusal
    with pytest.raises(ZeroDivisionError):
        run_plan(_plan(rules=[lambda path: 1 / 0]), target)


def test_steps_may_depend_on_the_stage_and_the_captured_graph_is_checked_first(tmp_path):
    folders = []

    def steps(scratch):
        folders.append(scratch)
        return []

    def refuse_capture(graph):
        raise ExportRefusedError("the captured graph is not the model's")

    with pytest.raises(ExportRefusedError, match="not the model's"):
        run_plan(_plan(steps=steps, captured_proofs=[refuse_capture]), tmp_path / "m.onnx")
    assert folders and folders[0].parent == tmp_path and not folders[0].exists()
    assert list(tmp_path.iterdir()) == []


def test_the_sizes_every_proof_runs_at():
    plan = _plan()
    sizes = plan.sizes()
    assert [s["x"].shape for s in sizes] == [(2, 4), (3, 4)]
    assert [s["x"].shape for s in _plan(axes={}).sizes()] == [(2, 4)]


@pytest.mark.parametrize("value", [12, 10**6, "17", True, None])
def test_one_opset_validator_names_the_range(value):
    with pytest.raises(InvalidArgumentError, match=r"opset_version must be an integer from 13 to \d+"):
        validate_opset(value)
    with pytest.raises(InvalidArgumentError, match="from 21 to .*int4"):
        validate_opset(18, lowest=21, why="int4 needs 21.")
    assert validate_opset(17) == 17


def test_after_write_runs_once_the_file_is_written_and_before_its_proofs(tmp_path):
    order: list[str] = []
    target = tmp_path / "m.onnx"

    def after_write() -> None:
        staged = [p for p in tmp_path.rglob("m.onnx")]
        order.append("after_write" + (" (written)" if staged and staged[0] != target else ""))

    run_plan(_plan(after_write=after_write, rules=[lambda path: order.append("rule")]), target)
    assert order == ["after_write (written)", "rule"]


def test_dropped_weights_are_freed_where_another_holder_keeps_the_tensor():
    # what export_seq2seq does once its files are written: a library may still hold the model's
    # parameters (onnxscript's rewrite rules keep the last graph they matched, whose initializers
    # wrap them), so their data must go, not only the module's references
    import torch

    from onnxport._core.torch_helpers import drop_weights

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    model.register_buffer("table", torch.ones(8))
    held = [model[0].weight, model.table]
    drop_weights(model)
    assert [t.numel() for t in held] == [0, 0]
    assert list(model.parameters()) == [] and list(model.buffers()) == []
