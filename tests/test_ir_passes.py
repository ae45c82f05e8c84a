"""Every graph pass on a hand-built model with If and Loop bodies: the bodies read outer
initializers and repeat each other's value names. Each pass must rewrite the bodies too, keep
what the main graph still reads, pass the checker, compute the same bytes, be idempotent, and
say honestly whether it changed anything. Then the pipeline that runs them."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedOpsetsPass

from onnxport._checks import run
from onnxport._core.ir import on_proto
from onnxport.errors import ExportRefusedError
from onnxport.passes.conv_kernel_shape import AddConvKernelShapePass
from onnxport.passes.linear_bias_rank import LinearBiasRankPass
from onnxport.passes.lower_opset import LowerOpsetPass
from onnxport.passes.ort_quantize import OrtQuantizeOptions, OrtQuantizePass, SetMetadataPass
from onnxport.passes.rsqrt_div import RsqrtToDivPass
from onnxport.passes.uint8_activations import ActivationsToUint8Pass
from onnxport.pipeline import LastBit, OnFile, Pipeline, Step, Structural
from tests.conftest import ort_optimised_ops

RNG = np.random.default_rng(0)
FLOAT = TensorProto.FLOAT


def _c(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _if_model(branch_nodes, inits, x_shape, out_shape, main_nodes=(), main_outputs=(), opset=18, domains=()):
    """``If(flag)`` whose two branches are ``branch_nodes(prefix)`` ending in the value 'same'."""
    def branch(prefix):
        return helper.make_graph(branch_nodes(prefix), prefix, [], [helper.make_tensor_value_info("same", FLOAT, out_shape)])

    nodes = [helper.make_node("If", ["flag"], ["picked"], then_branch=branch("then"), else_branch=branch("else")),
             *main_nodes]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", FLOAT, x_shape), helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("picked", FLOAT, out_shape), *main_outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *domains])


def _same_bytes(a: onnx.ModelProto, b: onnx.ModelProto, x_shape, max_ulp: int = 0) -> None:
    """The same outputs (``max_ulp``: each changed value within that many units in the last place
    of the input's largest magnitude, for a pass the exporter proves as a last-bit step)."""
    for flag in (True, False):
        feeds = {"x": RNG.standard_normal(x_shape).astype(np.float32), "flag": np.array(flag)}
        got, want = run(a, feeds, optimized=False), run(b, feeds, optimized=False)
        if max_ulp:
            # the ulp belongs to the values the pass changed (a pool of x), not to a sum of them
            # that cancels: 2 ulps of a sum near 0 were a fraction of one ulp of x (seen in a run).
            # Carried through the test graph's Sum of three, each addition may round it once more.
            ulp = np.spacing(np.abs(feeds["x"]).max())
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=0, atol=float(4 * max_ulp * ulp))
        else:
            assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def _apply(pass_, proto):
    """The pass on a fresh ir model of ``proto``: (result proto, modified, modified on a second run)."""
    model = ir.from_proto(proto)
    first = pass_(model).modified
    second = pass_(model).modified
    return ir.to_proto(model), first, second


def _body_nodes(model: onnx.ModelProto):
    return [n for node in model.graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node]


def test_kernel_shape_reaches_if_bodies():
    inits = [_c("w", RNG.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)), _c("ws", np.full(4, 0.02, np.float32)),
             _c("wz", np.zeros(4, np.int8))]

    def body(p):
        return [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], [f"{p}_w"], axis=0),
                helper.make_node("Conv", ["x", f"{p}_w"], ["same"], pads=[1, 1, 1, 1], name=f"{p}_conv")]

    model = _if_model(body, inits, [1, 3, 6, 6], [1, 4, 6, 6])
    patched, first, second = _apply(AddConvKernelShapePass(), model)
    assert (first, second) == (True, False)
    convs = [n for n in _body_nodes(patched) if n.op_type == "Conv"]
    assert len(convs) == 2 and all(helper.get_attribute_value(a) == [3, 3] for n in convs for a in n.attribute if a.name == "kernel_shape")
    onnx.checker.check_model(patched, full_check=True)
    _same_bytes(patched, model, (1, 3, 6, 6))


def test_uint8_reaches_if_bodies_and_shares_one_zero_point():
    inits = [_c("s", np.float32(0.05)), _c("zp", np.int8(0))]

    def body(p):
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_q"], name=f"{p}_q"),
                helper.make_node("DequantizeLinear", [f"{p}_q", "s", "zp"], [f"{p}_dq"]),
                helper.make_node("Relu", [f"{p}_dq"], ["same"])]

    # the main graph reads the int8 zero-point too, through a weight pair that must stay int8
    main = [helper.make_node("DequantizeLinear", ["wq", "s", "zp"], ["wd"]),
            helper.make_node("ReduceSum", ["wd"], ["total"], keepdims=0)]
    model = _if_model(body, [*inits, _c("wq", np.arange(-4, 4, dtype=np.int8))], [2, 5], [2, 5], main,
                      [helper.make_tensor_value_info("total", FLOAT, [])])
    moved, first, second = _apply(ActivationsToUint8Pass(), model)
    assert (first, second) == (True, False)
    consts = {t.name: numpy_helper.to_array(t) for t in moved.graph.initializer}
    zps = {n.input[2] for n in _body_nodes(moved) if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    assert len(zps) == 1 and consts[zps.pop()].dtype == np.uint8
    assert consts["zp"].dtype == np.int8  # still read by the weight pair in the main graph
    onnx.checker.check_model(moved, full_check=True)
    _same_bytes(moved, model, (2, 5))


def test_uint8_refusal_in_a_body_names_the_node():
    inits = [_c("s", np.float32(0.05)), _c("zp", np.int8(3))]

    def body(p):
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_q"], name=f"{p}_q"),
                helper.make_node("DequantizeLinear", [f"{p}_q", "s", "zp"], ["same"])]

    with pytest.raises(ExportRefusedError, match="zero-point of node '(then|else)_q' is int8 \\[3\\]"):
        ActivationsToUint8Pass()(ir.from_proto(_if_model(body, inits, [2, 5], [2, 5])))


def test_lowering_reaches_if_and_loop_bodies_and_drops_the_outer_axes_once_unread():
    inits = [_c("axes", np.array([1], np.int64))]

    def body(p):
        return [helper.make_node("ReduceMean", ["x", "axes"], ["same"], keepdims=1, name=f"{p}_mean")]

    # a Loop whose body splits its state with num_outputs (opset 18's form) along a known axis
    loop_body = helper.make_graph(
        [helper.make_node("Split", ["state_in"], ["a", "b"], axis=1, num_outputs=2, name="loop_split"),
         helper.make_node("Concat", ["b", "a"], ["state_out"], axis=1),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "loop", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("state_in", FLOAT, [2, 6])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("state_out", FLOAT, [2, 6])])
    main = [helper.make_node("Loop", ["trips", "", "x"], ["swapped"], body=loop_body)]
    model = _if_model(body, [*inits, _c("trips", np.array(3, np.int64))], [2, 6], [2, 1], main,
                      [helper.make_tensor_value_info("swapped", FLOAT, [2, 6])])
    lowered, first, second = _apply(LowerOpsetPass(17), model)
    assert (first, second) == (True, False)
    assert lowered.opset_import[0].version == 17
    assert "axes" not in {t.name for t in lowered.graph.initializer}
    means = [n for n in _body_nodes(lowered) if n.op_type == "ReduceMean"]
    assert len(means) == 2 and all(list(n.input) == ["x"] for n in means)
    split = next(n for n in _body_nodes(lowered) if n.op_type == "Split")
    assert not any(a.name == "num_outputs" for a in split.attribute) and len(split.input) == 2
    onnx.checker.check_model(lowered, full_check=True)
    _same_bytes(lowered, model, (2, 6))


def test_opsets_used_only_in_a_body_are_kept():
    def body(p):
        return [helper.make_node("Gelu", ["x"], ["same"], domain="com.microsoft")]

    model = _if_model(body, [], [2, 3], [2, 3], domains=[helper.make_opsetid("com.microsoft", 1),
                                                          helper.make_opsetid("ai.onnx.ml", 3)])
    stripped = on_proto(RemoveUnusedOpsetsPass(), model)
    assert sorted(e.domain for e in stripped.opset_import) == ["", "com.microsoft"]
    assert len(model.opset_import) == 3  # input untouched


# -- the pipeline ------------------------------------------------------------------------------------
class _NudgeWeight(ir.passes.InPlacePass):
    """A rewrite that is not exact: it changes one weight value (what the proof must catch)."""

    def call(self, model):
        value = model.graph.initializers["w"]
        value.const_value = ir.tensor(value.const_value.numpy() + np.float32(1e-3))
        return ir.passes.PassResult(model, True)


def _matmul_model(w: np.ndarray | None = None) -> ir.Model:
    w = RNG.standard_normal((3, 4)).astype(np.float32) if w is None else w
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]),
         helper.make_node("ReduceMean", ["m", "axes"], ["y"], keepdims=0, name="mean")],
        "g", [helper.make_tensor_value_info("x", FLOAT, [2, 3])], [helper.make_tensor_value_info("y", FLOAT, [2])],
        [_c("w", w), _c("axes", np.array([1], np.int64))])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


FEEDS = {"x": RNG.standard_normal((2, 3)).astype(np.float32)}


def test_pipeline_proves_only_the_steps_that_change_the_graph(tmp_path):
    pipeline = Pipeline(FEEDS, scratch=tmp_path)
    model = _matmul_model()
    pipeline.start(model)
    pipeline.apply(model, [Step("kernel shapes", AddConvKernelShapePass(), Structural)])
    assert pipeline.sessions == 0 and pipeline.changed == []  # nothing changed: no reference was needed
    steps = [Step("lower to opset 17", LowerOpsetPass(17)), Step("lower again", LowerOpsetPass(17)),
             Step("kernel shapes", AddConvKernelShapePass(), Structural)]
    model = pipeline.apply(model, steps)
    assert pipeline.changed == ["lower to opset 17"]
    assert pipeline.sessions == 2  # the reference once, the one changing step once
    assert model.opset_imports[""] == 17


def test_pipeline_refuses_an_inexact_step_by_name_and_a_pass_refusal_too(tmp_path):
    pipeline = Pipeline(FEEDS, scratch=tmp_path)
    model = _matmul_model()
    pipeline.start(model)
    with pytest.raises(ExportRefusedError, match="Step 'nudge': output 0 differs from the graph as produced"):
        pipeline.apply(model, [Step("nudge", _NudgeWeight())])
    model = _matmul_model()
    model.graph.node(1).replace_input_with(1, model.graph.node(0).outputs[0])  # axes computed at run time
    with pytest.raises(ExportRefusedError, match="Step 'lower to opset 17': Cannot lower .* computed while the graph runs"):
        pipeline.apply(model, [Step("lower to opset 17", LowerOpsetPass(17))])


def test_pipeline_file_proofs_refuse_a_wrong_opset(tmp_path):
    pipeline = Pipeline(FEEDS, scratch=tmp_path)
    model = _matmul_model()
    path = pipeline.write(model, tmp_path / "m.onnx")
    pipeline.prove_file(path, opset=18)
    with pytest.raises(ExportRefusedError, match="declares opset 18, not the requested 17"):
        pipeline.prove_file(path, opset=17)
    promised = Pipeline(FEEDS, scratch=tmp_path, axes={"x": {0: "batch", 1: "width"}})
    with pytest.raises(ExportRefusedError, match=r"x: 0=batch, 1=width were asked for, but in the produced file "
                                                 r"'x' axis 0 \('batch'\) is fixed \(2\), 'x' axis 1 \('width'\) is fixed \(3\)"):
        promised.prove_file(path, opset=18)


def test_strip_qdq_reaches_if_bodies_and_keeps_output_names():
    from onnxport.encodings.reverse import StripQDQPass

    w = np.arange(-4, 4, dtype=np.int8)
    inits = [_c("s", np.float32(0.05)), _c("zp", np.int8(0)), _c("wq", w), _c("ws", np.float32(0.5))]

    def body(p):
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_q"]),
                helper.make_node("DequantizeLinear", [f"{p}_q", "s", "zp"], [f"{p}_dq"]),
                helper.make_node("DequantizeLinear", ["wq", "ws"], [f"{p}_w"]),  # the outer weight, in a body
                helper.make_node("Add", [f"{p}_dq", f"{p}_w"], ["same"])]

    main = [helper.make_node("DequantizeLinear", ["wq", "ws"], ["total"])]  # a DQ that is a graph output
    model = _if_model(body, inits, [2, 8], [2, 8], main, [helper.make_tensor_value_info("total", FLOAT, [8])])
    stripped, first, second = _apply(StripQDQPass(), model)
    assert (first, second) == (True, False)
    everywhere = [*stripped.graph.node, *_body_nodes(stripped)]
    assert not [n for n in everywhere if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert [o.name for o in stripped.graph.output] == ["picked", "total"]
    weight = next(t for t in stripped.graph.initializer if t.name == "wq")  # named after the integers it replaced
    assert numpy_helper.to_array(weight).tolist() == (w * 0.5).tolist()
    onnx.checker.check_model(stripped, full_check=True)
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    for flag in (True, False):
        picked, total = run(stripped, {"x": x, "flag": np.array(flag)}, optimized=False)
        np.testing.assert_array_equal(picked, x + (w * 0.5).astype(np.float32))
        np.testing.assert_array_equal(total, (w * 0.5).astype(np.float32))


def test_onnxslim_pass_is_honest_about_modified():
    from onnxport.passes.optimize import OnnxSlimPass

    # Identity chains and a constant subexpression: something for onnxslim to fold away
    graph = helper.make_graph(
        [helper.make_node("Add", ["two", "two"], ["four"]), helper.make_node("Identity", ["x"], ["xi"]),
         helper.make_node("Mul", ["xi", "four"], ["y"])],
        "g", [helper.make_tensor_value_info("x", FLOAT, [2, 3])], [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
        [_c("two", np.full((1, 3), 2.0, np.float32))])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    first = OnnxSlimPass()(model)
    assert first.modified and len(first.model.graph) < 3
    assert OnnxSlimPass()(first.model).modified is False  # nothing left to slim
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(run(ir.to_proto(first.model), {"x": x}, optimized=False)[0], x * 4)


def test_onnxslim_pass_lifts_large_weights_out_of_its_reach_and_back():
    from onnxport.passes.optimize import OnnxSlimPass

    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["xi"]), helper.make_node("MatMul", ["xi", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("x", FLOAT, [2, 3])], [helper.make_tensor_value_info("y", FLOAT, [2, 4])],
        [_c("w", weight)])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    tensor = model.graph.initializers["w"].const_value
    result = OnnxSlimPass(lift_larger_than=16)(model)
    assert result.modified and [n.op_type for n in result.model.graph] == ["MatMul"]
    assert result.model.graph.initializers["w"].const_value is tensor  # handed back, never copied
    assert [v.name for v in result.model.graph.inputs] == ["x"]
    # the input model is left as it was: its weight back among its initializers, not its inputs
    assert model.graph.initializers["w"].const_value is tensor and [v.name for v in model.graph.inputs] == ["x"]
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(run(ir.to_proto(result.model), {"x": x}, optimized=False)[0], x @ weight)


def test_a_pipeline_started_without_its_reference_refuses_identical_outputs_steps(tmp_path):
    pipeline = Pipeline(FEEDS, scratch=tmp_path)
    model = _matmul_model()
    pipeline.start(model, keep_reference=False)
    pipeline.apply(model, [Step("kernel shapes", AddConvKernelShapePass(), Structural)])
    with pytest.raises(AssertionError, match="no reference graph"):
        pipeline.apply(model, [Step("lower to opset 17", LowerOpsetPass(17))])


def test_a_pool_window_larger_than_its_input_is_clipped_in_bodies_too():
    from onnxport.passes.pool_window import PoolWindowPass

    def body(p):  # what torch writes for nn.AvgPool2d(320, ceil_mode=True) on a 2x2 map
        return [helper.make_node("AveragePool", ["x"], [f"{p}_avg"], kernel_shape=[320, 320], strides=[320, 320],
                                 ceil_mode=1, count_include_pad=1, pads=[0, 0, 0, 0]),
                helper.make_node("MaxPool", ["x"], [f"{p}_max"], kernel_shape=[4, 3], strides=[4, 3],
                                 ceil_mode=1),  # exceeds it too
                helper.make_node("MaxPool", ["x"], [f"{p}_local"], kernel_shape=[1, 1]),  # a real window: kept
                helper.make_node("ReduceSum", [f"{p}_local"], [f"{p}_sum"], keepdims=1),
                helper.make_node("Sum", [f"{p}_avg", f"{p}_max", f"{p}_sum"], ["same"])]

    model = _if_model(body, [], [1, 3, 2, 2], [1, 3, 1, 1], opset=17)
    model = onnx.shape_inference.infer_shapes(model)
    pooled, first, second = _apply(PoolWindowPass(), model)
    assert (first, second) == (True, False)
    windows = sorted((n.op_type, [tuple(helper.get_attribute_value(a)) for a in n.attribute if a.name == "kernel_shape"])
                     for n in _body_nodes(pooled) if n.op_type.endswith("Pool"))
    assert windows == sorted([("AveragePool", [(2, 2)]), ("MaxPool", [(2, 2)]), ("MaxPool", [(1, 1)])] * 2)
    assert all(helper.get_attribute_value(a) == 0 for n in _body_nodes(pooled) for a in n.attribute
               if a.name == "ceil_mode")
    onnx.checker.check_model(pooled, full_check=True)
    # the exporter proves the step to the last bit: ORT's average over the clipped window may
    # divide where the original multiplied by the reciprocal of its count
    _same_bytes(pooled, model, (1, 3, 2, 2), max_ulp=1)


def test_cast_qdq_parameters_are_stored_as_constants_in_bodies_too():
    from onnxport.passes.qdq_parameters import FoldQDQParameterCastsPass

    def body(p):  # what torch.onnx leaves for a zero-point past its folding size limit
        return [helper.make_node("Cast", ["zp64"], [f"{p}_zp"], to=TensorProto.INT8),
                helper.make_node("QuantizeLinear", ["x", "scale", f"{p}_zp"], [f"{p}_q"], axis=1),
                helper.make_node("DequantizeLinear", [f"{p}_q", "scale", f"{p}_zp"], ["same"], axis=1)]

    inits = [_c("zp64", np.zeros(3, np.int64)), _c("scale", np.array([0.1, 0.2, 0.05], np.float32))]
    model = _if_model(body, inits, [2, 3], [2, 3])
    stored, first, second = _apply(FoldQDQParameterCastsPass(), model)
    assert (first, second) == (True, False)
    assert not [n for n in _body_nodes(stored) if n.op_type == "Cast"]
    onnx.checker.check_model(stored, full_check=True)
    _same_bytes(stored, model, (2, 3))


def test_a_zero_pad_between_pairs_is_folded_into_the_conv_in_bodies_too():
    from onnxport.passes.fold_pad import FoldPadIntoConvPass

    def body(p):  # DQ -> Pad -> Q -> DQ -> Conv, as TensorFlow-style "same" padding exports
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_xq"]),
                helper.make_node("DequantizeLinear", [f"{p}_xq", "s", "zp"], [f"{p}_x"]),
                helper.make_node("Pad", [f"{p}_x", "pads"], [f"{p}_padded"]),
                helper.make_node("QuantizeLinear", [f"{p}_padded", "s", "zp"], [f"{p}_pq"]),
                helper.make_node("DequantizeLinear", [f"{p}_pq", "s", "zp"], [f"{p}_p"]),
                helper.make_node("DequantizeLinear", ["wq", "ws", "wzp"], [f"{p}_w"], axis=0),
                helper.make_node("Conv", [f"{p}_p", f"{p}_w"], ["same"], pads=[1, 0, 0, 1], strides=[2, 2]),
                ]

    inits = [_c("s", np.float32(0.05)), _c("zp", np.int8(0)), _c("pads", np.array([0, 0, 0, 1, 0, 0, 1, 0])),
             _c("wq", RNG.integers(-127, 127, (4, 3, 3, 3)).astype(np.int8)), _c("ws", np.full(4, 0.01, np.float32)),
             _c("wzp", np.zeros(4, np.int8))]
    model = onnx.shape_inference.infer_shapes(_if_model(body, inits, [1, 3, 7, 7], [1, 4, 4, 4]))
    folded, first, second = _apply(FoldPadIntoConvPass(), model)
    assert (first, second) == (True, False)
    ops = [n.op_type for n in _body_nodes(folded)]
    assert "Pad" not in ops and ops.count("QuantizeLinear") == 2
    convs = [n for n in _body_nodes(folded) if n.op_type == "Conv"]
    assert all(helper.get_attribute_value(a) == [1, 1, 1, 1] for n in convs for a in n.attribute if a.name == "pads")
    onnx.checker.check_model(folded, full_check=True)
    _same_bytes(folded, model, (1, 3, 7, 7))


@pytest.mark.parametrize("opset", [17, 18])
def test_a_mean_over_every_spatial_axis_becomes_a_global_pool_in_bodies_too(opset):
    from onnxport.passes.global_mean import SpatialMeanToGlobalPoolPass

    def mean(p, name, axes, source="xd", **kw):  # axes are an input from opset 18 on, an attribute before
        reads = f"{p}_{source}" if source == "xd" else source
        if opset >= 18:
            return helper.make_node("ReduceMean", [reads, f"axes_{name}"], [f"{p}_{name}"], **kw)
        return helper.make_node("ReduceMean", [reads], [f"{p}_{name}"], axes=axes, **kw)

    def body(p):  # x.mean((2, 3), keepdim=True) and x.mean((-1, -2), ...) after a pair: pools; the others are not
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_xq"]),
                helper.make_node("DequantizeLinear", [f"{p}_xq", "s", "zp"], [f"{p}_xd"]),
                mean(p, "hw", [2, 3]), mean(p, "neg", [-1, -2]), mean(p, "chw", [1, 2, 3]),
                mean(p, "flat", [2, 3], keepdims=0), mean(p, "float", [2, 3], source="x"),  # float: ORT gains nothing
                helper.make_node("Unsqueeze", [f"{p}_flat", "last"], [f"{p}_back"]),
                helper.make_node("Sum", [f"{p}_hw", f"{p}_neg", f"{p}_chw", f"{p}_back", f"{p}_float"], ["same"])]

    inits = [_c("last", np.array([2, 3])), _c("s", np.float32(0.02)), _c("zp", np.int8(0))]
    if opset >= 18:
        inits += [_c(f"axes_{n}", np.array(a)) for n, a in
                  (("hw", [2, 3]), ("neg", [-1, -2]), ("chw", [1, 2, 3]), ("flat", [2, 3]), ("float", [2, 3]))]
    model = onnx.shape_inference.infer_shapes(_if_model(body, inits, [2, 3, 5, 4], [2, 3, 1, 1], opset=opset))
    pooled, first, second = _apply(SpatialMeanToGlobalPoolPass(), model)
    assert (first, second) == (True, False)
    ops = [n.op_type for n in _body_nodes(pooled)]
    assert ops.count("GlobalAveragePool") == 4 and ops.count("ReduceMean") == 6  # per branch: two, three
    assert not {"axes_hw", "axes_neg"} & {i.name for i in pooled.graph.initializer}  # unread now
    onnx.checker.check_model(pooled, full_check=True)
    for flag in (True, False):  # the same mean; the sum may run in another order
        feeds = {"x": RNG.standard_normal((2, 3, 5, 4)).astype(np.float32), "flag": np.array(flag)}
        np.testing.assert_allclose(run(pooled, feeds, optimized=False)[0], run(model, feeds, optimized=False)[0],
                                   rtol=1e-6, atol=1e-7)


def test_a_zero_pad_on_a_float_input_moves_behind_the_pair_into_the_conv_in_bodies_too():
    from onnxport.passes.fold_pad import FoldPadIntoConvPass

    def body(p):  # x -> Pad -> Q -> DQ -> Conv: the pad on the model's float input (per-channel pair)
        return [helper.make_node("Pad", ["x", "pads"], [f"{p}_padded"]),
                helper.make_node("QuantizeLinear", [f"{p}_padded", "s", "zp"], [f"{p}_pq"], axis=1),
                helper.make_node("DequantizeLinear", [f"{p}_pq", "s", "zp"], [f"{p}_p"], axis=1),
                helper.make_node("DequantizeLinear", ["wq", "ws", "wzp"], [f"{p}_w"], axis=0),
                helper.make_node("Conv", [f"{p}_p", f"{p}_w"], ["same"], strides=[2, 2])]

    inits = [_c("s", np.array([0.05, 0.02, 0.1], np.float32)), _c("zp", np.array([3, -4, 0], np.int8)),
             _c("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1])),
             _c("wq", RNG.integers(-127, 127, (4, 3, 3, 3)).astype(np.int8)), _c("ws", np.full(4, 0.01, np.float32)),
             _c("wzp", np.zeros(4, np.int8))]
    main = [n for n in body("main")]  # the main graph too, where shape inference records the pair's shapes
    main[-1].output[0] = "main_y"
    model = onnx.shape_inference.infer_shapes(_if_model(
        body, inits, [1, 3, 7, 7], [1, 4, 4, 4], main_nodes=main,
        main_outputs=[helper.make_tensor_value_info("main_y", FLOAT, [1, 4, 4, 4])]))
    folded, first, second = _apply(FoldPadIntoConvPass(), model)
    assert (first, second) == (True, False)
    assert "Pad" not in [n.op_type for n in folded.graph.node]
    ops = [n.op_type for n in _body_nodes(folded)]
    assert "Pad" not in ops and ops.count("QuantizeLinear") == 2  # the pair stays: it quantizes x now
    assert all(n.input[0] == "x" for n in _body_nodes(folded) if n.op_type == "QuantizeLinear")
    convs = [n for n in _body_nodes(folded) if n.op_type == "Conv"]
    assert all(helper.get_attribute_value(a) == [1, 1, 1, 1] for n in convs for a in n.attribute if a.name == "pads")
    onnx.checker.check_model(folded, full_check=True)  # the pair's recorded shapes are the unpadded input's
    _same_bytes(folded, model, (1, 3, 7, 7))


def test_the_exporters_gelu_is_reordered_for_ort_fusion_in_bodies_too():
    from onnxport.passes.gelu_order import GeluOrderPass

    def body(p):  # torch.onnx's erf GELU: x * (0.5 * (1 + erf(x / sqrt 2)))
        return [helper.make_node("Div", ["x", "sqrt2"], [f"{p}_d"]), helper.make_node("Erf", [f"{p}_d"], [f"{p}_e"]),
                helper.make_node("Add", [f"{p}_e", "one"], [f"{p}_a"]),
                helper.make_node("Mul", [f"{p}_a", "half"], [f"{p}_h"]),
                helper.make_node("Mul", ["x", f"{p}_h"], ["same"])]

    inits = [_c("sqrt2", np.float32(np.sqrt(2))), _c("one", np.float32(1)), _c("half", np.float32(0.5))]
    model = _if_model(body, inits, [2, 64], [2, 64])
    reordered, first, second = _apply(GeluOrderPass(), model)
    assert (first, second) == (True, False)
    for branch in reordered.graph.node[0].attribute:
        muls = [n for n in branch.g.node if n.op_type == "Mul"]
        assert [list(n.input) for n in muls] == [["x", f"{branch.g.name}_a"], [muls[0].output[0], "half"]]
        assert muls[1].output[0] == "same"
    onnx.checker.check_model(reordered, full_check=True)
    _same_bytes(reordered, model, (2, 64))  # halving is exact: the same bits
    fused = ort_optimised_ops(reordered)  # and now ONNX Runtime runs one Gelu per branch
    assert fused.count("Gelu") == 2 and "Erf" not in fused and ort_optimised_ops(model).count("Erf") == 2
    # a GELU whose half is not 0.5 (another function) is left alone
    other = onnx.ModelProto()
    other.CopyFrom(model)
    next(t for t in other.graph.initializer if t.name == "half").CopyFrom(_c("half", np.float32(0.25)))
    assert _apply(GeluOrderPass(), other)[1] is False


def _erf_gelu(x: str, q: str) -> list[onnx.NodeProto]:
    """The exporter's ordered erf GELU of ``x``, ``(x * (1 + erf(x / √2))) * 0.5``, its values named after ``q``."""
    return [helper.make_node("Div", [x, "sqrt2"], [f"{q}_d"]), helper.make_node("Erf", [f"{q}_d"], [f"{q}_e"]),
            helper.make_node("Add", [f"{q}_e", "one"], [f"{q}_a"]), helper.make_node("Mul", [x, f"{q}_a"], [f"{q}_m"]),
            helper.make_node("Mul", [f"{q}_m", "half"], [f"{q}_g"])]


def test_a_gelu_that_reads_a_dequantize_becomes_orts_gelu_in_bodies_too():
    from onnxport.passes.contrib_gelu import DequantizedGeluPass

    def body(p):  # a pair, then the ordered GELU of its output; a second GELU of the float x stays
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_xq"]),
                helper.make_node("DequantizeLinear", [f"{p}_xq", "s", "zp"], [f"{p}_xd"]),
                *_erf_gelu(f"{p}_xd", f"{p}_dq"), *_erf_gelu("x", f"{p}_float"),
                helper.make_node("Add", [f"{p}_dq_g", f"{p}_float_g"], ["same"])]

    inits = [_c("sqrt2", np.float32(np.sqrt(2))), _c("one", np.float32(1)), _c("half", np.float32(0.5)),
             _c("s", np.float32(0.02)), _c("zp", np.uint8(128))]
    model = _if_model(body, inits, [2, 64], [2, 64])
    assert ort_optimised_ops(model).count("Erf") == 2  # the GELU after the pair is not fused by ORT
    fused, first, second = _apply(DequantizedGeluPass(), model)
    assert (first, second) == (True, False)
    ops = [n.op_type for n in _body_nodes(fused)]
    assert ops.count("Gelu") == 2 and ops.count("Erf") == 2  # one per branch; the float GELUs stay standard
    assert {(n.domain, n.input[0]) for n in _body_nodes(fused) if n.op_type == "Gelu"} == {
        ("com.microsoft", "then_xd"), ("com.microsoft", "else_xd")}
    assert {o.domain: o.version for o in fused.opset_import}["com.microsoft"] == 1
    assert "Erf" not in ort_optimised_ops(fused)
    onnx.checker.check_model(fused, full_check=True)
    x = RNG.standard_normal((2, 64)).astype(np.float32) * 2
    for flag in (True, False):  # the same erf GELU, possibly a last bit apart
        feeds = {"x": x, "flag": np.array(flag)}
        np.testing.assert_allclose(run(fused, feeds, optimized=False)[0], run(model, feeds, optimized=False)[0],
                                   rtol=1e-6, atol=1e-6)


def _quantized_linear(p: str) -> list[onnx.NodeProto]:
    """A float-output quantized linear of ``x`` into ``{p}_m`` (its constants: :func:`_linear_inits`)."""
    return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], [f"{p}_xq"]),
            helper.make_node("DequantizeLinear", [f"{p}_xq", "s", "zp"], [f"{p}_xd"]),
            helper.make_node("DequantizeLinear", ["wq", "ws"], [f"{p}_wd"]),
            helper.make_node("MatMul", [f"{p}_xd", f"{p}_wd"], [f"{p}_m"])]


def _biased_linear_then(gelu):
    """An If branch: a float-output quantized linear, its bias, then ``gelu`` of that sum; and the same
    GELU of ``x + x`` (no constant bias), which the bias passes must leave alone."""
    def body(p):
        return [*_quantized_linear(p),
                helper.make_node("Add", [f"{p}_m", "bias"], [f"{p}_y"]), *gelu(f"{p}_y", f"{p}_b"),
                helper.make_node("Add", ["x", "x"], [f"{p}_x2"]), *gelu(f"{p}_x2", f"{p}_f"),
                helper.make_node("Concat", [f"{p}_b_g", f"{p}_f_g"], ["same"], axis=-1)]
    return body


def _linear_inits():  # the constants of _quantized_linear, drawn afresh
    return [_c("s", np.float32(0.05)), _c("zp", np.uint8(128)), _c("ws", np.float32(0.02)),
            _c("wq", RNG.integers(-64, 65, (16, 16)).astype(np.int8)), _c("bias", RNG.standard_normal(16).astype(np.float32))]


def test_a_gelu_after_a_quantized_linears_bias_becomes_orts_bias_gelu(tmp_path):
    from onnxport.passes.contrib_gelu import BiasGeluPass

    body = _biased_linear_then(_erf_gelu)
    inits = [_c("sqrt2", np.float32(np.sqrt(2))), _c("one", np.float32(1)), _c("half", np.float32(0.5)), *_linear_inits()]
    # as the exporter runs them: the bias takes the input's rank first, which keeps ORT from fusing it
    model = onnx.shape_inference.infer_shapes(_if_model(body, inits, [1, 6, 16], [1, 6, 32]))
    ranked = _apply(LinearBiasRankPass(), model)[0]
    assert "BiasGelu" not in ort_optimised_ops(ranked)
    fused, first, second = _apply(BiasGeluPass(), ranked)
    assert (first, second) == (True, False)
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in _body_nodes(fused)]
    assert ops.count("BiasGelu") == 2 and ops.count("Erf") == 2  # one per branch; the GELU of x + x stays standard
    assert all(n.domain == "com.microsoft" for n in _body_nodes(fused) if n.op_type == "BiasGelu")
    bodies = [a.g for node in fused.graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    biases = {t.name: list(t.dims) for g in (fused.graph, *bodies) for t in g.initializer}
    assert all(biases[n.input[1]] == [16] for n in _body_nodes(fused) if n.op_type == "BiasGelu")  # 1-D, as it must be
    optimised = ort_optimised_ops(fused)
    assert optimised.count("MatMulIntegerToFloat") == 2 and optimised.count("BiasGelu") == 2, optimised
    for flag in (True, False):  # the same erf GELU of the same sum, possibly a last bit apart
        feeds = {"x": RNG.standard_normal((1, 6, 16)).astype(np.float32), "flag": np.array(flag)}
        np.testing.assert_allclose(run(fused, feeds, optimized=False)[0], run(ranked, feeds, optimized=False)[0],
                                   rtol=1e-6, atol=1e-6)


def test_a_tanh_gelu_after_a_quantized_linears_bias_becomes_orts_fast_gelu_with_that_bias():
    from onnxport.passes.contrib_gelu import BiasFastGeluPass

    def tanh_gelu(x, q):  # transformers' gelu_new as the exporter writes it
        return [helper.make_node("Mul", [x, "half"], [f"{q}_h"]), helper.make_node("Pow", [x, "three"], [f"{q}_p"]),
                helper.make_node("Mul", [f"{q}_p", "c"], [f"{q}_c"]), helper.make_node("Add", [x, f"{q}_c"], [f"{q}_i"]),
                helper.make_node("Mul", [f"{q}_i", "k"], [f"{q}_s"]), helper.make_node("Tanh", [f"{q}_s"], [f"{q}_t"]),
                helper.make_node("Add", [f"{q}_t", "one"], [f"{q}_o"]), helper.make_node("Mul", [f"{q}_h", f"{q}_o"], [f"{q}_g"])]

    body = _biased_linear_then(tanh_gelu)
    inits = [_c("half", np.float32(0.5)), _c("three", np.float32(3)), _c("c", np.float32(0.044715)),
             _c("k", np.float32(np.sqrt(2 / np.pi))), _c("one", np.float32(1)), *_linear_inits()]
    model = onnx.shape_inference.infer_shapes(_if_model(body, inits, [1, 6, 16], [1, 6, 32]))
    ranked = _apply(LinearBiasRankPass(), model)[0]
    assert ort_optimised_ops(ranked).count("Add") >= 2  # ORT fuses FastGelu but leaves each rank-3 bias an Add
    fused, first, second = _apply(BiasFastGeluPass(), ranked)
    assert (first, second) == (True, False)
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in _body_nodes(fused)]
    assert ops.count("FastGelu") == 2 and ops.count("Tanh") == 2 and ops.count("Pow") == 2, ops  # x + x's GELU stays
    assert all(n.domain == "com.microsoft" and len(n.input) == 2 for n in _body_nodes(fused) if n.op_type == "FastGelu")
    optimised = ort_optimised_ops(fused)
    assert optimised.count("MatMulIntegerToFloat") == 2 and optimised.count("FastGelu") == 4, optimised
    assert optimised.count("Add") == ort_optimised_ops(ranked).count("Add") - 2, optimised  # both biases gone
    for flag in (True, False):  # the same tanh GELU of the same sum, possibly last bits apart
        feeds = {"x": RNG.standard_normal((1, 6, 16)).astype(np.float32), "flag": np.array(flag)}
        np.testing.assert_allclose(run(fused, feeds, optimized=False)[0], run(ranked, feeds, optimized=False)[0],
                                   rtol=1e-5, atol=1e-5)  # FastGelu's tanh is MLAS's own approximation, per ISA


def test_rsqrt_becomes_a_division_that_ort_fuses_as_an_rmsnorm_in_bodies_too():
    def body(p):  # torch.onnx's RMSNorm: w * (x * reciprocal(sqrt(mean(x ** 2) + eps)))
        return [helper.make_node("Pow", ["x", "two"], [f"{p}_sq"]),
                helper.make_node("ReduceMean", [f"{p}_sq", "last"], [f"{p}_ms"], keepdims=1),
                helper.make_node("Add", [f"{p}_ms", "eps"], [f"{p}_v"]), helper.make_node("Sqrt", [f"{p}_v"], [f"{p}_s"]),
                helper.make_node("Reciprocal", [f"{p}_s"], [f"{p}_r"]),
                helper.make_node("Mul", [f"{p}_r", "x"] if p == "then" else ["x", f"{p}_r"], [f"{p}_n"]),
                helper.make_node("Mul", ["w", f"{p}_n"], ["same"])]

    inits = [_c("two", np.float32(2)), _c("last", np.array([-1])), _c("eps", np.float32(1e-6)),
             _c("w", RNG.standard_normal(64).astype(np.float32))]
    model = _if_model(body, inits, [2, 8, 64], [2, 8, 64])
    divided, first, second = _apply(RsqrtToDivPass(), model)
    assert (first, second) == (True, False)
    for branch in divided.graph.node[0].attribute:  # either operand order of the product
        ops = [n.op_type for n in branch.g.node]
        assert "Reciprocal" not in ops and ops.count("Div") == 1
        div = next(n for n in branch.g.node if n.op_type == "Div")
        assert list(div.input) == ["x", f"{branch.g.name}_s"] and div.output[0] == f"{branch.g.name}_n"
    onnx.checker.check_model(divided, full_check=True)
    for flag in (True, False):  # one rounding fewer: the same to a last bit
        feeds = {"x": RNG.standard_normal((2, 8, 64)).astype(np.float32), "flag": np.array(flag)}
        np.testing.assert_allclose(run(divided, feeds, optimized=False)[0], run(model, feeds, optimized=False)[0],
                                   rtol=1e-6, atol=1e-7)
    fused = ort_optimised_ops(divided)
    assert fused.count("SimplifiedLayerNormalization") == 2 and ort_optimised_ops(model).count("Reciprocal") == 2


def test_pipeline_refuses_an_identical_outputs_step_after_a_last_bit_one(tmp_path):
    """Proofs are kinds with an order: after a rewrite that may move a last bit, the graph as
    produced is no reference, so a byte-for-byte proof may not follow (in one call or the next)."""
    pipeline = Pipeline(FEEDS, scratch=tmp_path)
    model = _matmul_model()
    with pytest.raises(AssertionError, match="Step 'lower to opset 17' is proven by identical outputs but follows 'rsqrt'"):
        pipeline.apply(model, [Step("rsqrt", RsqrtToDivPass(), LastBit), Step("lower to opset 17", LowerOpsetPass(17))])
    later, model = Pipeline(FEEDS, scratch=tmp_path), _matmul_model()
    later.start(model)
    model = later.apply(model, [Step("kernel shapes", AddConvKernelShapePass(), Structural),
                                  Step("lower to opset 17", LowerOpsetPass(17)), Step("rsqrt", RsqrtToDivPass(), LastBit)])
    with pytest.raises(AssertionError, match="follows 'rsqrt'"):
        later.apply(model, [Step("lower again", LowerOpsetPass(17))])


def test_a_step_proven_on_the_file_needs_the_files_rules_and_ends_byte_for_byte_proofs(tmp_path):
    """``OnFile``: a rewrite that changes values on purpose. Nothing byte-for-byte may follow it,
    and the written file must be held to the exporter's rules (the Pipeline refuses without)."""
    pipeline = Pipeline(FEEDS, scratch=tmp_path)
    model = _matmul_model()
    pipeline.start(model)
    model = pipeline.apply(model, [Step("nudge on purpose", _NudgeWeight(), OnFile)])
    assert pipeline.changed == ["nudge on purpose"] and pipeline.sessions == 0  # no byte-for-byte run
    with pytest.raises(AssertionError, match="follows 'nudge on purpose'"):
        pipeline.apply(model, [Step("lower to opset 17", LowerOpsetPass(17))])
    path = pipeline.write(model, tmp_path / "m.onnx")
    with pytest.raises(AssertionError, match=r"\['nudge on purpose'\] are proven by the written file's rules, but none"):
        pipeline.prove_file(path, opset=18)
    seen = []
    pipeline.prove_file(path, opset=18, rules=[seen.append],
                        on_default_run=lambda outputs, optimised: seen.append((len(outputs), optimised.is_file())))
    assert seen == [path, (1, True)]


def test_metadata_pass_is_honest_and_idempotent():
    model = _matmul_model()
    set_range = SetMetadataPass({"onnxport.weight_range": "portable"})
    assert set_range(model).modified and not set_range(model).modified
    assert ir.to_proto(model).metadata_props[0].value == "portable"


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_orts_quantizer_as_a_pass_returns_a_new_quantized_model(tmp_path, mode):
    # positive inputs and weights: the row means cannot cancel to near zero, so an error of a tenth
    # of the output is a wrong quantization whatever the seed or the order the tests ran in
    rng = np.random.default_rng(7)
    model = _matmul_model(np.abs(rng.standard_normal((3, 4))).astype(np.float32))
    calibration = [{"x": np.abs(rng.standard_normal((2, 3))).astype(np.float32)} for _ in range(4)]
    feeds = {"x": np.abs(rng.standard_normal((2, 3))).astype(np.float32)}
    result = OrtQuantizePass(tmp_path, OrtQuantizeOptions(mode, calibration))(model)
    ops = {n.op_type for n in result.model.graph}
    assert result.modified and result.model is not model
    assert ops & {"DynamicQuantizeLinear", "MatMulInteger", "QuantizeLinear"}, ops
    assert "MatMul" in {n.op_type for n in model.graph}  # the input model is left as it was
    got = run(ir.to_proto(result.model), feeds, optimized=True)[0]
    want = run(ir.to_proto(model), feeds, optimized=True)[0]
    assert np.abs(got - want).max() < 0.1 * np.abs(want).min()


def test_the_pipeline_writes_lazily_loaded_weights_into_the_files_own_data(tmp_path):
    """A model loaded with ``ir.load`` keeps its weights on disk; writing it copies them into the
    new file's own data, never leaving it pointing at the source's."""
    source = tmp_path / "src"
    source.mkdir()
    onnx.save_model(ir.to_proto(_matmul_model()), str(source / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=0)
    out = tmp_path / "out"
    out.mkdir()
    path = Pipeline(FEEDS, scratch=tmp_path).write(ir.load(source / "m.onnx"), out / "copy.onnx")
    (source / "m.onnx.data").unlink()
    assert sorted(p.name for p in out.iterdir()) == ["copy.onnx", "copy.onnx.data"]
    assert run(path, FEEDS, optimized=False)[0].shape == (2,)


def _linear_model(*, quantized_output: bool, in_body: bool = False) -> onnx.ModelProto:
    """``DQ(x) → MatMul ← DQ(w)`` then ``Add(bias[8])`` on a static [1, 6, 16] input; its output
    either quantized (a QuantizeLinear reads it) or float (a Relu does)."""
    def body(prefix: str) -> list[onnx.NodeProto]:
        tail = (["QuantizeLinear", ["y", "s", "zp"], [f"{prefix}q"]], ["DequantizeLinear", [f"{prefix}q", "s", "zp"], ["same"]]) \
            if quantized_output else (["Relu", ["y"], ["same"]],)
        return [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
                helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"]),
                helper.make_node("DequantizeLinear", ["wq", "ws"], ["wd"]),
                helper.make_node("MatMul", ["xd", "wd"], ["m"]),
                helper.make_node("Add", ["m", "bias"], ["y"]),
                *(helper.make_node(op, i, o) for op, i, o in tail)]
    inits = [_c("s", np.float32(0.05)), _c("zp", np.uint8(128)), _c("ws", np.float32(0.02)),
             _c("wq", RNG.integers(-64, 65, (16, 8)).astype(np.int8)), _c("bias", RNG.standard_normal(8).astype(np.float32))]
    if in_body:
        model = _if_model(lambda prefix: body(prefix), inits, [1, 6, 16], [1, 6, 8])
    else:
        graph = helper.make_graph(body(""), "g", [helper.make_tensor_value_info("x", FLOAT, [1, 6, 16])],
                                  [helper.make_tensor_value_info("same", FLOAT, [1, 6, 8])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model)  # as the exporter's graphs: every value has its shape


def _ort_ops(model: onnx.ModelProto, tmp_path) -> set[str]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return {n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node}


def test_a_float_output_linears_bias_takes_the_input_rank_so_ort_keeps_it_int8(tmp_path):

    plain = _linear_model(quantized_output=False)
    # the cause, as ORT does it: with static shapes MatMul+Add becomes a float Gemm between DQs
    assert "Gemm" in _ort_ops(plain, tmp_path) and "MatMulIntegerToFloat" not in _ort_ops(plain, tmp_path)
    fixed, first, second = _apply(LinearBiasRankPass(), plain)
    assert first and not second
    assert [list(t.dims) for t in fixed.graph.initializer if t.name.startswith("bias")] == [[1, 1, 8]]
    ops = _ort_ops(fixed, tmp_path)
    assert "MatMulIntegerToFloat" in ops and "Gemm" not in ops, ops
    feeds = {"x": RNG.standard_normal((1, 6, 16)).astype(np.float32)}
    assert run(fixed, feeds, optimized=False)[0].tobytes() == run(plain, feeds, optimized=False)[0].tobytes()
    # a quantized output is left alone: ORT makes that Gemm a QGemm, its INT8 form
    assert not _apply(LinearBiasRankPass(), _linear_model(quantized_output=True))[1]
    # and bodies are reached
    original = _linear_model(quantized_output=False, in_body=True)
    body, first, _ = _apply(LinearBiasRankPass(), original)
    assert first and sorted(n.input[1] for n in _body_nodes(body) if n.op_type == "Add") == ["bias.rank3", "bias.rank3_1"]
    _same_bytes(body, original, [1, 6, 16])


def _cached_attention_model(with_mask: bool = True, size: int = 8) -> onnx.ModelProto:
    """One decoder attention as torch.onnx writes it at opset 23: 4 query heads over 2 key/value
    heads of ``size``, the keys and values appended to the past by Concat (the present outputs)."""
    def heads(name, count):
        return [helper.make_node("Reshape", [name, f"{name}_split"], [f"{name}4"]),
                helper.make_node("Transpose", [f"{name}4"], [f"{name}_t"], perm=[0, 2, 1, 3])]

    nodes = [*heads("q", 4), *heads("k", 2), *heads("v", 2),
             helper.make_node("Concat", ["past_key", "k_t"], ["present_key"], axis=-2),
             helper.make_node("Concat", ["past_value", "v_t"], ["present_value"], axis=-2),
             helper.make_node("Attention", ["q_t", "present_key", "present_value"] + (["mask"] if with_mask else []),
                              ["y4"], scale=0.5, is_causal=0 if with_mask else 1),
             helper.make_node("Transpose", ["y4"], ["y_t"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["y_t", "merged"], ["y"])]
    inits = [_c("q_split", np.array([0, 0, 4, size])), _c("k_split", np.array([0, 0, 2, size])),
             _c("v_split", np.array([0, 0, 2, size])), _c("merged", np.array([0, 0, 4 * size]))]
    info = helper.make_tensor_value_info
    inputs = [info("q", FLOAT, ["b", "s", 4 * size]), info("k", FLOAT, ["b", "s", 2 * size]),
              info("v", FLOAT, ["b", "s", 2 * size]), info("past_key", FLOAT, ["b", 2, "p", size]),
              info("past_value", FLOAT, ["b", 2, "p", size])]
    if with_mask:
        inputs.append(info("mask", TensorProto.BOOL, ["b", 1, "s", "t"]))
    outputs = [info("y", FLOAT, ["b", "s", 4 * size]), info("present_key", FLOAT, ["b", 2, "t", size]),
               info("present_value", FLOAT, ["b", 2, "t", size])]
    graph = helper.make_graph(nodes, "attention", inputs, outputs, inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def _decoder_feeds(with_mask: bool, past: int, new: int) -> dict:
    total = past + new
    rng = np.random.default_rng(past * 10 + new)
    feeds = {"q": rng.standard_normal((2, new, 32)), "k": rng.standard_normal((2, new, 16)),
             "v": rng.standard_normal((2, new, 16)), "past_key": rng.standard_normal((2, 2, past, 8)),
             "past_value": rng.standard_normal((2, 2, past, 8))}
    feeds = {name: array.astype(np.float32) for name, array in feeds.items()}
    if with_mask:
        causal = np.arange(total)[None, :] <= past + np.arange(new)[:, None]
        padding = np.ones((2, total), bool)
        padding[1, :2] = False  # the second row is padded on the left
        feeds["mask"] = causal[None, None] & padding[:, None, None, :]
    return feeds


def test_cached_attention_becomes_group_query_attention_with_the_same_outputs():
    from onnxport.passes.group_query_attention import GroupQueryAttentionPass

    proto = _cached_attention_model()
    model = ir.from_proto(proto)
    rewrite = GroupQueryAttentionPass()
    assert rewrite(model).modified and rewrite.rewritten == 1
    ops = [n.op_type for n in model.graph]
    assert "GroupQueryAttention" in ops and not {"Attention", "Concat", "Transpose"} & set(ops)
    assert [v.name for v in model.graph.outputs] == ["y", "present_key", "present_value"]
    assert not rewrite(model).modified and rewrite.rewritten == 0  # idempotent, and honest about it
    fused = ir.to_proto(model)
    # a prompt with an empty past, a decode step, and two tokens over a past (which the kernel
    # refuses for a batch of two unless it is told each row's chunk length)
    for past, new in ((0, 5), (5, 1), (3, 2)):
        feeds = _decoder_feeds(True, past, new)
        for want, got in zip(run(proto, feeds, optimized=False), run(fused, feeds, optimized=False)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_group_query_attention_pass_needs_opset_23_and_leaves_what_its_kernel_cannot_run():
    from onnxport.passes.group_query_attention import GroupQueryAttentionPass

    # ONNX Runtime's kernel refuses a head size that is not a multiple of 8
    assert not GroupQueryAttentionPass()(ir.from_proto(_cached_attention_model(size=4))).modified
    # ONNX's is_causal triangle starts at the first key, the kernel's ends at the last
    assert not GroupQueryAttentionPass()(ir.from_proto(_cached_attention_model(with_mask=False))).modified

    proto = _cached_attention_model()
    uncached = onnx.ModelProto()
    uncached.CopyFrom(proto)
    uncached.graph.node[6].input[1:3] = ["k_t", "v_t"]  # attention over the new keys only: no cache
    model = ir.from_proto(uncached)
    assert not GroupQueryAttentionPass()(model).modified
    older = ir.from_proto(proto)
    older.opset_imports[""] = 22
    with pytest.raises(ir.passes.PreconditionError, match="opset 23"):
        GroupQueryAttentionPass()(older)


def test_residual_add_and_rms_norm_become_one_skip_norm_and_the_sum_stays_readable():
    from onnxport.passes.skip_rms_norm import SkipRmsNormPass

    info = helper.make_tensor_value_info
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("RMSNormalization", ["h", "w"], ["y"], axis=-1, epsilon=1e-6),
             helper.make_node("Relu", ["h"], ["next"])]  # the next residual reads the sum too
    graph = helper.make_graph(nodes, "norm", [info("x", FLOAT, ["b", "s", 8]), info("r", FLOAT, ["b", "s", 8])],
                              [info("y", FLOAT, ["b", "s", 8]), info("next", FLOAT, ["b", "s", 8])],
                              [_c("w", np.linspace(0.5, 1.5, 8, dtype=np.float32))])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    model = ir.from_proto(proto)
    rewrite = SkipRmsNormPass()
    assert rewrite(model).modified and rewrite.rewritten == 1
    assert [(n.domain, n.op_type) for n in model.graph] == [("com.microsoft", "SkipSimplifiedLayerNormalization"), ("", "Relu")]
    assert not rewrite(model).modified
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32), "r": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    for want, got in zip(run(proto, feeds, optimized=False), run(ir.to_proto(model), feeds, optimized=False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _normed_ranked_model(body, width: int, batch: int | str = 1) -> onnx.ModelProto:
    """``_if_model`` of ``body`` (a linear, then norms with 16-wide ``gamma``/``beta``) as the exporter
    has it by then: its float-output linear's bias at the input's rank (else ORT makes it a float Gemm;
    with a named batch neither happens)."""
    inits = [*_linear_inits(), _c("gamma", RNG.uniform(0.5, 2.0, 16).astype(np.float32)),
             _c("beta", RNG.standard_normal(16).astype(np.float32))]
    return _apply(LinearBiasRankPass(), onnx.shape_inference.infer_shapes(_if_model(body, inits, [batch, 6, 16], [batch, 6, width])))[0]


@pytest.mark.parametrize("batch", [1, "batch"])
def test_a_linears_bias_rides_on_the_next_constant_shift_through_a_residual_and_a_scale_in_bodies_too(batch):
    from onnxport.passes.fold_bias_shift import FoldBiasIntoShiftPass

    def body(p):  # MobileBERT's NoNorm after a float-output linear and its residual: ((m + b) + x) · γ + β
        return [*_quantized_linear(p),
                helper.make_node("Add", [f"{p}_m", "bias"], [f"{p}_y"]),
                helper.make_node("Add", ["x", f"{p}_y"], [f"{p}_r"]),
                helper.make_node("Mul", [f"{p}_r", "gamma"], [f"{p}_n"]),
                helper.make_node("Add", [f"{p}_n", "beta"], [f"{p}_folded"]),
                # left alone: a bias a ReLU reads, and one whose sum is read twice
                helper.make_node("Add", ["x", "bias"], [f"{p}_y2"]), helper.make_node("Relu", [f"{p}_y2"], [f"{p}_a"]),
                helper.make_node("Add", [f"{p}_a", "beta"], [f"{p}_kept"]),
                helper.make_node("Add", ["x", "bias"], [f"{p}_y3"]), helper.make_node("Mul", [f"{p}_y3", f"{p}_y3"], [f"{p}_sq"]),
                helper.make_node("Add", [f"{p}_sq", "beta"], [f"{p}_twice"]),
                helper.make_node("Concat", [f"{p}_folded", f"{p}_kept", f"{p}_twice"], ["same"], axis=-1)]

    model = _normed_ranked_model(body, 48, batch)
    folded, first, second = _apply(FoldBiasIntoShiftPass(), model)
    assert (first, second) == (True, False)
    onnx.checker.check_model(folded, full_check=True)
    before, after = [n.op_type for n in _body_nodes(model)], [n.op_type for n in _body_nodes(folded)]
    assert after.count("Add") == before.count("Add") - 2 and after.count("Mul") == before.count("Mul")  # one per branch
    assert ort_optimised_ops(folded).count("Add") == ort_optimised_ops(model).count("Add") - 2
    for flag in (True, False):  # the same sums in another order: within a few units in the last place of the outputs
        feeds = {"x": RNG.standard_normal((1 if batch == 1 else 3, 6, 16)).astype(np.float32), "flag": np.array(flag)}
        got, want = run(folded, feeds, optimized=False)[0], run(model, feeds, optimized=False)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[..., 16:], want[..., 16:])  # the two left alone: untouched


def test_a_linears_bias_and_residual_before_a_layer_norm_become_one_skip_layer_norm_in_bodies_too():
    from onnxport.passes.bias_skip_norm import BiasSkipLayerNormPass

    def body(p):  # BERT's block end: LayerNorm((m + b) + x); left alone: a pre-norm layer's, whose sum
        # flows on as the next residual, and LayerNorm((x + b) + x) whose biased sum is read twice
        return [*_quantized_linear(p),
                helper.make_node("Add", [f"{p}_m", "bias"], [f"{p}_y"]),
                helper.make_node("Add", [f"{p}_y", "x"], [f"{p}_r"]),
                helper.make_node("LayerNormalization", [f"{p}_r", "gamma", "beta"], [f"{p}_fused"], axis=-1, epsilon=1e-6),
                helper.make_node("Add", ["x", "bias"], [f"{p}_y1"]), helper.make_node("Add", [f"{p}_y1", "x"], [f"{p}_r1"]),
                helper.make_node("LayerNormalization", [f"{p}_r1", "gamma", "beta"], [f"{p}_n1"], axis=-1),
                helper.make_node("Add", [f"{p}_n1", f"{p}_r1"], [f"{p}_flows"]),
                helper.make_node("Add", ["x", "bias"], [f"{p}_y2"]), helper.make_node("Add", [f"{p}_y2", "x"], [f"{p}_r2"]),
                helper.make_node("LayerNormalization", [f"{p}_r2", "gamma", "beta"], [f"{p}_n2"], axis=-1),
                helper.make_node("Add", [f"{p}_n2", f"{p}_y2"], [f"{p}_kept"]),
                helper.make_node("Concat", [f"{p}_fused", f"{p}_flows", f"{p}_kept"], ["same"], axis=-1)]

    model = _normed_ranked_model(body, 48)
    fused, first, second = _apply(BiasSkipLayerNormPass(), model)
    assert (first, second) == (True, False)
    onnx.checker.check_model(fused, full_check=True)
    ops = [n.op_type for n in _body_nodes(fused)]
    assert ops.count("SkipLayerNormalization") == 2 and ops.count("LayerNormalization") == 4, ops  # one per branch
    assert all(n.domain == "com.microsoft" and len(n.input) == 5 for n in _body_nodes(fused) if n.op_type == "SkipLayerNormalization")
    # ORT fused the residual and the norm itself, but not the rank-3 bias: one Add per branch fewer
    assert ort_optimised_ops(fused).count("Add") == ort_optimised_ops(model).count("Add") - 2
    for flag in (True, False):  # the same sum and norm, the terms added in the kernel's order
        feeds = {"x": RNG.standard_normal((1, 6, 16)).astype(np.float32), "flag": np.array(flag)}
        got, want = run(fused, feeds, optimized=False)[0], run(model, feeds, optimized=False)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[..., 16:], want[..., 16:])  # those left alone: untouched


def test_only_the_onnxruntime_preset_runs_the_bias_rules_and_after_every_identical_outputs_step():
    from onnxport.exporters.qdq import qdq_steps
    from onnxport.pipeline import IdenticalOutputs
    from onnxport.targets import get_target

    rules = {"fold biases into the next constant shift", "write bias, residual and LayerNorm as ORT's SkipLayerNormalization"}
    for name in ("onnxruntime", "tensorrt", "qnn", "openvino", None):
        steps = qdq_steps(18, "uint8", get_target(name).defaults)
        assert (rules <= {s.name for s in steps}) == (name == "onnxruntime"), name
        if name == "onnxruntime":  # a last-bit step: no identical-outputs proof may follow it
            first = min(i for i, s in enumerate(steps) if s.name in rules)
            assert not any(s.proof is IdenticalOutputs for s in steps[first:])


def test_a_relu_between_two_weight_only_matmuls_becomes_max_and_ort_then_fuses_both():
    from onnxport.passes.relu_as_max import ReluAfterWeightOnlyMatMulPass

    def weight(name, k, n):  # int4 in blocks of 16 along the input features, as torchao's int4 is written
        q = RNG.integers(-8, 8, (k, n))
        scale = numpy_helper.from_array((RNG.random((k // 16, n)) * 0.02 + 0.01).astype(np.float32), f"{name}_s")
        return ([helper.make_tensor(f"{name}_q", TensorProto.INT4, [k, n], q.flatten().tolist()), scale],
                helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s"], [name], axis=0, block_size=16))

    (w1, dq1), (w2, dq2) = weight("w1", 32, 64), weight("w2", 64, 32)
    nodes = [dq1, dq2, helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"]),
             # left alone: a ReLU that is a graph output, and one after a product of float weights
             helper.make_node("MatMul", ["x", "wf"], ["g"]), helper.make_node("Relu", ["g"], ["gr"]),
             helper.make_node("MatMul", ["gr", "wf2"], ["z"]), helper.make_node("Relu", ["z"], ["out"])]
    floats = [numpy_helper.from_array(RNG.standard_normal(s).astype(np.float32), n) for n, s in (("wf", (32, 8)), ("wf2", (8, 8)))]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 32]),
                               helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 5, 8])], [*w1, *w2, *floats])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    rewritten, first, second = _apply(ReluAfterWeightOnlyMatMulPass(), model)
    assert (first, second) == (True, False)
    onnx.checker.check_model(rewritten, full_check=True)
    assert [n.op_type for n in rewritten.graph.node].count("Relu") == 2  # the two left alone
    # ONNX Runtime left the first product dequantized on every run; past the Max it fuses both
    assert ort_optimised_ops(model).count("MatMulNBits") == 1
    assert ort_optimised_ops(rewritten).count("MatMulNBits") == 2
    x = RNG.standard_normal((2, 5, 32)).astype(np.float32)
    for got, want in zip(run(rewritten, {"x": x}, optimized=False), run(model, {"x": x}, optimized=False)):
        np.testing.assert_array_equal(got, want)  # ReLU's values, every one


def test_int4_dequantize_matmul_becomes_matmul_nbits_holding_the_same_integers():
    from onnxport.passes.matmul_nbits import PACKED_SUFFIX, MatMulNBitsPass, unpacked

    k, n, block = 48, 24, 16  # three blocks: the zero-points' rows are padded to whole bytes
    q = RNG.integers(-8, 8, (k, n))
    zp = RNG.integers(-8, 8, (k // block, n))
    scale = (RNG.random((k // block, n)) * 0.02 + 0.01).astype(np.float32)
    inits = [helper.make_tensor("q", TensorProto.INT4, [k, n], q.flatten().tolist()), numpy_helper.from_array(scale, "s"),
             helper.make_tensor("zp", TensorProto.INT4, [k // block, n], zp.flatten().tolist()),
             helper.make_tensor("q2", TensorProto.INT4, [k, n], q[::-1].flatten().tolist())]
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["w"], axis=0, block_size=block),
             helper.make_node("DequantizeLinear", ["q2", "s"], ["w2"], axis=0, block_size=block),  # symmetric
             helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["x", "w2"], ["h2"]),
             helper.make_node("Add", ["h", "h2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    rewritten, first, second = _apply(MatMulNBitsPass(accuracy_level=0), model)
    assert (first, second) == (True, False)
    onnx.checker.check_model(rewritten)
    assert [node.op_type for node in rewritten.graph.node] == ["MatMulNBits", "MatMulNBits", "Add"]
    # the int4 tensors are gone, not kept beside their packed copies (the scales the second weight
    # shared with the first went with it)
    assert {t.name for t in rewritten.graph.initializer} == {f"{w}{PACKED_SUFFIX}{part}" for w in ("w", "w2")
                                                             for part in ("", "_scales")} | {f"w{PACKED_SUFFIX}_zero_points"}
    # read back, the very integers, scales and zero-points (a symmetric weight's: none, a zero)
    ir_model = ir.from_proto(rewritten)
    arrays = {name: v.const_value.numpy() for name, v in ir_model.graph.initializers.items()}
    for node, (want_q, want_zp) in zip([n for n in ir_model.graph if n.op_type == "MatMulNBits"], [(q, zp), (q[::-1], None)]):
        name = node.inputs[1].name.removesuffix(PACKED_SUFFIX)
        got = unpacked(node, arrays[node.inputs[1].name], arrays[node.inputs[2].name],
                       arrays[node.inputs[3].name] if len(node.inputs) > 3 else None)
        assert name in ("w", "w2") and np.array_equal(got["q"], want_q) and np.array_equal(got["scale"], scale)
        assert (got["zp"] is None) == (want_zp is None) and (want_zp is None or np.array_equal(got["zp"], want_zp))
        assert (got["axis"], got["block_size"]) == (0, block)
    # float activations (level 0): the same products as the DequantizeLinear's, up to summation order
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, {"x": x}, optimized=False)[0], run(model, {"x": x}, optimized=False)[0],
                               rtol=1e-5, atol=1e-5)


def test_passes_that_add_initializers_walk_the_graph_and_its_bodies_not_functions():
    # onnx_ir gives a function's nodes an ir.Graph too: only the walk keeps initializers out of functions
    from onnxport._core.ir import graph_nodes, nodes

    body = helper.make_graph([helper.make_node("Relu", ["x"], ["b"], name="in_body")], "body", [],
                             [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    function = helper.make_function("local", "F", ["a"], ["c"], [helper.make_node("Relu", ["a"], ["c"], name="in_function")],
                                    [helper.make_opsetid("", 21)])
    graph = helper.make_graph([helper.make_node("If", ["flag"], ["y"], then_branch=body, else_branch=body, name="branch"),
                               helper.make_node("F", ["y"], ["z"], domain="local", name="call")], "g",
                              [helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    model = ir.from_proto(helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("local", 1)]))
    assert {n.name for n in nodes(model)} == {"branch", "call", "in_body", "in_function"}
    assert {n.name for n in graph_nodes(model)} == {"branch", "call", "in_body"}


def _moe_reference(x, fc1, fc2, index, weights):
    """A gated SiLU mixture (fc1's gate rows, then its up rows) of the chosen experts."""
    out = np.zeros_like(x)
    inner = fc1.shape[1] // 2
    for t in range(x.shape[0]):
        for e, w in zip(index[t], weights[t]):
            both = fc1[e] @ x[t]
            gate, up = both[:inner], both[inner:]
            out[t] += w * (fc2[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


@pytest.mark.parametrize("quantized", [False, True])
def test_mixture_of_experts_becomes_what_onnx_runtimes_cpu_kernels_take(quantized):
    # the exporter states the model's layout (swiglu_fusion=2), which ONNX Runtime's CPU kernels refuse
    from onnxport.passes.moe_kernel import PACKED_SUFFIX, MoEInterleavePass, QMoEPass, unpacked_experts

    experts, hidden, inner, block = 3, 32, 16, 16
    q1, q2 = RNG.integers(-8, 8, (experts, 2 * inner, hidden)), RNG.integers(-8, 8, (experts, hidden, inner))
    s1 = (RNG.random((experts, 2 * inner, hidden // block)) * 0.02 + 0.01).astype(np.float32)
    s2 = (RNG.random((experts, hidden, inner // block)) * 0.02 + 0.01).astype(np.float32)
    fc1 = (q1.reshape(*s1.shape, block) * s1[..., None]).reshape(q1.shape).astype(np.float32)
    fc2 = (q2.reshape(*s2.shape, block) * s2[..., None]).reshape(q2.shape).astype(np.float32)
    if quantized:
        inits = [helper.make_tensor("q1", TensorProto.INT4, q1.shape, q1.flatten().tolist()), _c("s1", s1),
                 helper.make_tensor("q2", TensorProto.INT4, q2.shape, q2.flatten().tolist()), _c("s2", s2)]
        nodes = [helper.make_node("DequantizeLinear", ["q1", "s1"], ["fc1"], axis=2, block_size=block),
                 helper.make_node("DequantizeLinear", ["q2", "s2"], ["fc2"], axis=2, block_size=block)]
    else:
        inits, nodes = [_c("fc1", fc1), _c("fc2", fc2)], []
    # the router's choice as the exporter hands it over: its log-weights at the chosen experts
    nodes.append(helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=2,
                                  activation_type="swiglu", swiglu_fusion=2, normalize_routing_weights=1))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, ["tokens", hidden]),
                                           helper.make_tensor_value_info("logits", FLOAT, ["tokens", experts])],
                              [helper.make_tensor_value_info("y", FLOAT, ["tokens", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    rewritten, first, second = _apply(QMoEPass(accuracy_level=0) if quantized else MoEInterleavePass(), model)
    assert (first, second) == (True, False)
    (node,) = rewritten.graph.node
    assert (node.op_type, {a.name: a.i for a in node.attribute}["swiglu_fusion"]) == ("QMoE" if quantized else "MoE", 1)
    if quantized:  # the int4 tensors are gone; read back, the very integers and scales
        ir_model = ir.from_proto(rewritten)
        packed = {v.name: v.const_value.numpy() for v in ir_model.graph.initializers.values()}
        assert set(packed) == {f"fc{i}{PACKED_SUFFIX}{part}" for i in (1, 2) for part in ("", "_scales")}
        qnode = next(iter(ir_model.graph))
        for name, q, s in (("fc1", q1, s1), ("fc2", q2, s2)):
            got = unpacked_experts(qnode, packed[f"{name}{PACKED_SUFFIX}"], packed[f"{name}{PACKED_SUFFIX}_scales"], name == "fc1")
            assert np.array_equal(got["q"], q) and np.array_equal(got["scale"], s) and (got["axis"], got["block_size"]) == (2, block)
    x = RNG.standard_normal((5, hidden)).astype(np.float32)
    index = np.stack([RNG.permutation(experts)[:2] for _ in range(5)])
    weights = np.full((5, 2), 0.5, np.float32) + RNG.random((5, 2)).astype(np.float32) * 0.1
    weights /= weights.sum(1, keepdims=True)
    logits = np.full((5, experts), -np.inf, np.float32)
    np.put_along_axis(logits, index, np.log(weights), 1)
    np.testing.assert_allclose(run(rewritten, {"x": x, "logits": logits}, optimized=False)[0],
                               _moe_reference(x, fc1, fc2, index, weights), rtol=1e-4, atol=1e-5)


def test_a_group_norms_instance_norm_becomes_a_layer_norm_in_bodies_too():
    from onnxport.passes.group_norm import GroupNormAsLayerNormPass

    def body(p):  # torch.onnx's GroupNorm(2, 4): reshape to groups, instance norm, reshape back
        return [helper.make_node("Reshape", ["x", "groups"], [f"{p}_g"]),
                helper.make_node("InstanceNormalization", [f"{p}_g", "ones", "zeros"], [f"{p}_n"], epsilon=1e-3),
                helper.make_node("Reshape", [f"{p}_n", "back"], ["same"])]

    inits = [_c("groups", np.array([2, 2, -1])), _c("back", np.array([2, 4, 8, 8])),
             _c("ones", np.ones(2, np.float32)), _c("zeros", np.zeros(2, np.float32))]
    model = _if_model(body, inits, [2, 4, 8, 8], [2, 4, 8, 8], opset=17)
    rewritten, first, second = _apply(GroupNormAsLayerNormPass(), model)
    assert (first, second) == (True, False)
    norms = [n for n in _body_nodes(rewritten) if n.op_type == "LayerNormalization"]
    assert len(norms) == 2 and not [n for n in _body_nodes(rewritten) if n.op_type == "InstanceNormalization"]
    assert all(helper.get_attribute_value(a) == (2 if a.name == "axis" else pytest.approx(1e-3))
               for n in norms for a in n.attribute)
    # one shared one-element scale and shift in the main graph; the instance norms' own are gone
    assert sorted(i.name for i in rewritten.graph.initializer) == [
        "back", "groups", "layer_norm_scale_float", "layer_norm_shift_float"]
    onnx.checker.check_model(rewritten, full_check=True)
    for flag in (True, False):
        x = (RNG.standard_normal((2, 4, 8, 8)) * 3 + 2).astype(np.float32)
        grouped = x.astype(np.float64).reshape(2, 2, -1)
        mean, var = grouped.mean(-1, keepdims=True), grouped.var(-1, keepdims=True)
        expected = ((grouped - mean) / np.sqrt(var + 1e-3)).reshape(x.shape)
        for optimized in (False, True):
            (got,) = run(rewritten, {"x": x, "flag": np.array(flag)}, optimized=optimized)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    # below opset 17 (no LayerNormalization) and with a real scale, nothing changes
    _, older, _ = _apply(GroupNormAsLayerNormPass(), _if_model(body, inits, [2, 4, 8, 8], [2, 4, 8, 8], opset=16))
    scaled = [*inits[:2], _c("ones", np.array([1.0, 2.0], np.float32)), inits[3]]
    _, affine, _ = _apply(GroupNormAsLayerNormPass(), _if_model(body, scaled, [2, 4, 8, 8], [2, 4, 8, 8], opset=17))
    assert (older, affine) == (False, False)


def test_an_opset_21_group_normalization_becomes_a_layer_norm_with_its_channel_scale_in_bodies_too():
    from onnxport.passes.group_norm import GroupNormAsLayerNormPass

    def body(p):
        return [helper.make_node("GroupNormalization", ["x", "scale", "shift"], ["same"], num_groups=2, epsilon=1e-3,
                                 name=f"{p}_gn")]

    scale, shift = RNG.standard_normal(4).astype(np.float32), RNG.standard_normal(4).astype(np.float32)
    inits = [_c("scale", scale), _c("shift", shift)]
    # a group of 2 x 8 x 8 values: ORT's own kernel is within a few times torch's rounding there, and faster
    _, small, _ = _apply(GroupNormAsLayerNormPass(), _if_model(body, inits, [2, 4, 8, 8], [2, 4, 8, 8], opset=21))
    assert not small
    shape = [2, 4, 128, 256]  # 2 x 128 x 256 = 65,536 values a group: rewritten
    model = _if_model(body, inits, shape, shape, opset=21)
    rewritten, first, second = _apply(GroupNormAsLayerNormPass(), model)
    assert (first, second) == (True, False)
    ops = [n.op_type for n in _body_nodes(rewritten)]
    assert "GroupNormalization" not in ops and ops.count("LayerNormalization") == 2
    onnx.checker.check_model(rewritten, full_check=True)
    for flag in (True, False):
        x = (RNG.standard_normal(shape) * 3 + 2).astype(np.float32)
        grouped = x.astype(np.float64).reshape(2, 2, -1)
        normed = ((grouped - grouped.mean(-1, keepdims=True)) / np.sqrt(grouped.var(-1, keepdims=True) + 1e-3))
        expected = normed.reshape(x.shape) * scale[:, None, None] + shift[:, None, None]
        (got,) = run(rewritten, {"x": x, "flag": np.array(flag)}, optimized=False)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_weight_read_one_constant_slice_at_a_time_is_stored_as_its_slices():
    from onnxport.passes.split_indexed_weight import SplitIndexedWeightPass

    w = RNG.standard_normal((3, 4, 5)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w[:, :, :4].copy(), "V"),
             numpy_helper.from_array(w[0].copy(), "U"), numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(-1, np.int64), "last")]
    # an If body reads the main graph's W too: slice 2 (as -1) beside the main graph's 0 (twice)
    body = helper.make_graph([helper.make_node("Gather", ["W", "last"], ["b"]), helper.make_node("MatMul", ["x", "b"], ["bo"])],
                             "body", [], [helper.make_tensor_value_info("bo", TensorProto.FLOAT, [2, 5])])
    nodes = [helper.make_node("Gather", ["W", "zero"], ["w0"]), helper.make_node("Gather", ["W", "zero"], ["w0b"]),
             helper.make_node("MatMul", ["x", "w0"], ["h0"]), helper.make_node("MatMul", ["x", "w0b"], ["h1"]),
             helper.make_node("If", ["flag"], ["h2"], then_branch=body, else_branch=body),
             # left whole: V read at a data index, U read by another op too
             helper.make_node("Gather", ["V", "pick"], ["v"]), helper.make_node("Gather", ["U", "zero"], ["u0"]),
             helper.make_node("Add", ["U", "U"], ["u2"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
                                           helper.make_tensor_value_info("pick", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in
                               (("h0", [2, 5]), ("h1", [2, 5]), ("h2", [2, 5]), ("v", [4, 4]), ("u0", [5]), ("u2", [4, 5]))],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rewritten, first, second = _apply(SplitIndexedWeightPass(), model)
    assert (first, second) == (True, False)
    onnx.checker.check_model(rewritten, full_check=True)
    stored = {i.name: numpy_helper.to_array(i) for i in rewritten.graph.initializer}
    assert "W" not in stored and {"V", "U"} <= set(stored)
    np.testing.assert_array_equal(stored["W.0"], w[0])
    np.testing.assert_array_equal(stored["W.2"], w[2])
    assert "Gather" not in [n.op_type for n in _body_nodes(rewritten)]
    assert not [n for n in rewritten.graph.node if n.op_type == "Gather" and n.input[0] == "W"]
    feeds = {"x": RNG.standard_normal((2, 4)).astype(np.float32), "pick": np.array(1, np.int64)}
    for flag in (True, False):
        feeds["flag"] = np.array(flag)
        for got, want in zip(run(rewritten, feeds, optimized=False), run(model, feeds, optimized=False)):
            np.testing.assert_array_equal(got, want)
