"""The Q/DQ rewrite passes and counters on hand-built graphs of a few nodes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxport import qdq_report, qdq_stats
from onnxport._checks import run
from onnxport._core.ir import on_proto
from onnxport.errors import ExportRefusedError, OnnxportError
from onnxport.passes import (
    ActivationsToUint8Pass,
    AddConvKernelShapePass,
    FoldWeightTransposePass,
    convs_missing_kernel_shape,
)

RNG = np.random.default_rng(0)


def _c(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _qdq_conv_model(with_kernel_shape: bool = False, zp=0, act_zp_dtype=np.int8) -> onnx.ModelProto:
    """x → Q → DQ → Conv(DQ(w_int8)) → Relu → Q → DQ → y, with per-channel weights."""
    w = RNG.integers(-127, 128, size=(4, 3, 3, 3)).astype(np.int8)
    inits = [
        _c("s_in", np.float32(0.05)), _c("zp_in", act_zp_dtype(zp)),
        _c("w_q", w), _c("w_s", np.full(4, 0.01, np.float32)), _c("w_zp", np.zeros(4, np.int8)),
        _c("s_out", np.float32(0.1)), _c("zp_out", act_zp_dtype(zp)),
    ]
    conv_attrs = {"pads": [1, 1, 1, 1]}
    if with_kernel_shape:
        conv_attrs["kernel_shape"] = [3, 3]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_in", "zp_in"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s_in", "zp_in"], ["xdq"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w"], name="dq_w", axis=0),
        helper.make_node("Conv", ["xdq", "w"], ["c"], name="conv", **conv_attrs),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s_out", "zp_out"], ["rq"], name="q_out"),
        helper.make_node("DequantizeLinear", ["rq", "s_out", "zp_out"], ["y"], name="dq_out"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])], inits,
        value_info=[helper.make_tensor_value_info("xq", TensorProto.INT8, ["batch", 3, 8, 8])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


FEEDS = {"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)}


# -- kernel_shape -------------------------------------------------------------------------------
def test_kernel_shape_is_read_through_the_dq_chain():
    model = _qdq_conv_model()
    assert convs_missing_kernel_shape(ir.from_proto(model).graph) == ["conv"]
    patched = on_proto(AddConvKernelShapePass(), model)
    conv = next(n for n in patched.graph.node if n.op_type == "Conv")
    assert helper.get_attribute_value(next(a for a in conv.attribute if a.name == "kernel_shape")) == [3, 3]
    assert convs_missing_kernel_shape(ir.from_proto(patched).graph) == []
    onnx.checker.check_model(patched, full_check=True)
    # stripping it back changes nothing the runtime computes
    assert [o.tobytes() for o in run(patched, FEEDS, optimized=True)] == [o.tobytes() for o in run(model, FEEDS, optimized=True)]
    assert on_proto(AddConvKernelShapePass(), patched).SerializeToString() == patched.SerializeToString()  # idempotent
    assert convs_missing_kernel_shape(ir.from_proto(model).graph) == ["conv"]  # input untouched


def test_existing_kernel_shape_and_conv_transpose_are_left_alone():
    model = _qdq_conv_model(with_kernel_shape=True)
    assert on_proto(AddConvKernelShapePass(), model).SerializeToString() == model.SerializeToString()
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [_c("w", np.ones((2, 2, 3, 3), np.float32))])
    m = helper.make_model(graph)
    assert on_proto(AddConvKernelShapePass(), m).SerializeToString() == m.SerializeToString()


# -- uint8 activations ------------------------------------------------------------------------------
def test_uint8_moves_activation_pairs_only_and_is_byte_identical():
    model = _qdq_conv_model()
    moved = on_proto(ActivationsToUint8Pass(), model)
    inits = {t.name: numpy_helper.to_array(t) for t in moved.graph.initializer}
    for node in moved.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            zp = inits[node.input[2]]
            if node.name == "dq_w":
                assert zp.dtype == np.int8 and not zp.any()
            else:
                assert zp.dtype == np.uint8 and np.all(zp == 128)
    assert [i.name for i in model.graph.initializer if i.name == "zp_in"]  # input untouched
    assert "zp_in" not in inits and "s_in" in inits  # old zero-points dropped, scales kept
    assert not [v for v in moved.graph.value_info if v.name == "xq"]  # stale INT8 typing removed
    onnx.checker.check_model(moved, full_check=True)
    before = run(model, FEEDS, optimized=False)
    after = run(moved, FEEDS, optimized=False)
    assert [o.tobytes() for o in after] == [o.tobytes() for o in before]
    assert qdq_stats(moved).as_dict() == {
        "n_quantize": 2, "n_dequantize": 3, "n_per_channel": 1, "n_nonzero_zero_point": 4,
        "n_unquantized_conv_add": 0, "n_uint8": 4, "n_blocked": 0, "n_int4": 0, "n_dynamic_quantize": 0,
        "n_integer_ops": 0,
    }
    assert on_proto(ActivationsToUint8Pass(), moved).SerializeToString() == moved.SerializeToString()


def test_uint8_saturation_matches_int8_at_the_extremes():
    model = _qdq_conv_model()
    extreme = {"x": np.array([-100.0, -6.4, -6.375, 6.35, 6.375, 100.0] * 32, np.float32).reshape(2, 3, 8, 4).repeat(2, -1)}
    moved = on_proto(ActivationsToUint8Pass(), model)
    assert [o.tobytes() for o in run(moved, extreme, optimized=False)] == [o.tobytes() for o in run(model, extreme, optimized=False)]


def test_uint8_refuses_nonzero_zero_points():
    with pytest.raises(ExportRefusedError, match="zero-point of node 'q_in' is int8 \\[3\\].*symmetric=False"):
        on_proto(ActivationsToUint8Pass(), _qdq_conv_model(zp=3))


def test_uint8_refuses_a_quantized_value_read_without_dequantizing():
    model = _qdq_conv_model()
    model.graph.node.append(helper.make_node("Identity", ["xq"], ["leak"], name="leak_reader"))
    with pytest.raises(ExportRefusedError, match="'leak_reader' reads 'xq' without dequantizing"):
        on_proto(ActivationsToUint8Pass(), model)


def test_uint8_zero_point_names_never_collide():
    model = _qdq_conv_model()
    model.graph.initializer.append(_c("zp_in_uint8", np.float32(1.0)))  # a name the rewrite would pick
    moved = on_proto(ActivationsToUint8Pass(), model)
    names = [t.name for t in moved.graph.initializer]
    assert len(names) == len(set(names)) and "zp_in_uint8_1" in names


def test_uint8_keeps_qat_style_weight_pairs_int8():
    model = _qdq_conv_model()
    g = model.graph
    # weight as float constant → Q → DQ (what a QAT graph writes)
    g.initializer.append(_c("w_f", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)))
    dq_w = next(n for n in g.node if n.name == "dq_w")
    g.node.insert(0, helper.make_node("QuantizeLinear", ["w_f", "w_s", "w_zp"], ["w_q2"], name="q_w", axis=0))
    dq_w.input[0] = "w_q2"
    moved = on_proto(ActivationsToUint8Pass(), model)
    inits = {t.name: t for t in moved.graph.initializer}
    q_w = next(n for n in moved.graph.node if n.name == "q_w")
    assert inits[q_w.input[2]].data_type == TensorProto.INT8


# -- counters ---------------------------------------------------------------------------------------
def _graph_with(nodes, inits, outputs=("y",), extra_inputs=()):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in extra_inputs],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


_W = [_c("w", np.ones((2, 2, 1, 1), np.float32)), _c("s", np.float32(0.1)), _c("z", np.int8(0))]
_QDQ = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]), helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"])]


@pytest.mark.parametrize(
    "body, expected",
    [
        ([helper.make_node("Conv", ["xd", "w"], ["c"]), helper.make_node("Add", ["c", "xd"], ["y"])], 1),
        ([helper.make_node("Conv", ["xd", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
          helper.make_node("Add", ["r", "xd"], ["y"])], 1),
        ([helper.make_node("Conv", ["xd", "w"], ["c"]), helper.make_node("Clip", ["c"], ["r"]),
          helper.make_node("Add", ["r", "xd"], ["y"])], 1),  # ReLU6 as Clip (MobileNet)
        ([helper.make_node("Conv", ["xd", "w"], ["c"]), helper.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"]),
          helper.make_node("DequantizeLinear", ["cq", "s", "z"], ["cd"]), helper.make_node("Add", ["cd", "xd"], ["y"])], 0),
        ([helper.make_node("Conv", ["xd", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
          helper.make_node("Add", ["r", "xd"], ["y"]), helper.make_node("Neg", ["r"], ["y2"])], 0),  # shared ReLU
        ([helper.make_node("Conv", ["xd", "w"], ["c"]), helper.make_node("Conv", ["xd", "w"], ["c2"]),
          helper.make_node("Add", ["c", "c2"], ["y"])], 2),
    ],
)
def test_unquantized_conv_add_edges(body, expected):
    outputs = ("y", "y2") if any(n.output[0] == "y2" for n in body) else ("y",)
    assert qdq_stats(_graph_with(_QDQ + body, _W, outputs)).n_unquantized_conv_add == expected


def test_float_graph_has_no_unquantized_edges():
    body = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "x"], ["y"])]
    assert qdq_stats(_graph_with(body, _W)).as_dict() == dict.fromkeys(
        ["n_quantize", "n_dequantize", "n_per_channel", "n_nonzero_zero_point", "n_unquantized_conv_add", "n_uint8",
         "n_blocked", "n_int4", "n_dynamic_quantize", "n_integer_ops"], 0)


def test_missing_zero_point_and_non_constant_parameters():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s"], ["xq"]), helper.make_node("DequantizeLinear", ["xq", "s"], ["y"])]
    assert qdq_stats(_graph_with(nodes, [_c("s", np.float32(0.1))])).as_dict()["n_nonzero_zero_point"] == 0
    bad_scale = [helper.make_node("QuantizeLinear", ["x", "sx"], ["y"])]
    with pytest.raises(OnnxportError, match="scale of node"):
        qdq_stats(_graph_with(bad_scale, [], extra_inputs=["sx"]))
    bad_zp = [helper.make_node("QuantizeLinear", ["x", "s", "zx"], ["y"])]
    with pytest.raises(OnnxportError, match="zero_point of node"):
        qdq_stats(_graph_with(bad_zp, [_c("s", np.float32(0.1))], extra_inputs=["zx"]))


def test_subgraphs_count_and_foreign_domains_do_not():
    inner = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["iq"]), helper.make_node("DequantizeLinear", ["iq", "s", "z"], ["io"])],
        "body", [], [helper.make_tensor_value_info("io", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("Constant", [], ["cond"], value=_c("c", np.array(True))),
        helper.make_node("If", ["cond"], ["y"], then_branch=inner, else_branch=inner),
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["mq"], domain="com.microsoft"),
    ]
    model = _graph_with(nodes, _W)
    stats = qdq_stats(model)
    assert (stats.n_quantize, stats.n_dequantize) == (2, 2)


def test_report_names_float_ops_and_missing_kernel_shape(tmp_path):
    model = _qdq_conv_model()
    model.graph.node.append(helper.make_node("MatMul", ["y", "m"], ["z"], name="float_matmul"))
    model.graph.initializer.append(_c("m", np.ones((8, 2), np.float32)))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    report = qdq_report(path)
    assert report.opset == 18 and report.missing_kernel_shape == ("conv",)
    assert [op.name for op in report.float_ops] == ["float_matmul"]
    assert report.float_ops[0].why_float == "its weight is not dequantized"
    assert report.zero_point_dtypes == {"int8": 5}
    text = str(report)
    assert "Conv              1 / 1" in text and "float: MatMul 'float_matmul'" in text and "kernel_shape" in text
    assert report.as_dict()["stats"]["n_per_channel"] == 1


def test_report_says_why_an_add_or_mul_stays_float():
    body = [*_QDQ, helper.make_node("Relu", ["xd"], ["r"]),
            helper.make_node("Add", ["xd", "xd"], ["between_pairs"]),  # both operands dequantized: INT8
            helper.make_node("Mul", ["xd", "half"], ["scaled"]),  # GELU's 0.5
            helper.make_node("Add", ["r", "xd"], ["after_float"]),
            helper.make_node("Add", ["scaled", "after_float"], ["y0"]),
            helper.make_node("Add", ["y0", "between_pairs"], ["y"])]
    report = qdq_report(_graph_with(body, [*_W, _c("half", np.float32(0.5))]), ort=False)
    assert report.extra["float_elementwise"] == {
        "Mul: a float constant operand": 1,
        "Add: an operand from Relu (float)": 1,
        "Add: an operand from Add (float), an operand from Mul (float)": 1,
        "Add: an operand from Add (float)": 1,
    }
    assert "float (no pair on both operands, so no QLinearAdd/QLinearMul): Mul: a float constant operand x1" in str(report)


# -- weight transpose folding ------------------------------------------------------------------------
def test_weight_transpose_is_folded_into_the_constant_exactly():

    w = RNG.integers(-127, 128, size=(5, 4)).astype(np.int8)  # (out, in) as nn.Linear stores it
    inits = [_c("w", w), _c("ws", np.linspace(0.01, 0.05, 5).astype(np.float32)), _c("wz", np.zeros(5, np.int8))]
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    folded = on_proto(FoldWeightTransposePass(), model)
    ops = [n.op_type for n in folded.graph.node]
    assert ops == ["DequantizeLinear", "MatMul"]
    dq = folded.graph.node[0]
    assert helper.get_attribute_value(dq.attribute[0]) == 1
    assert numpy_helper.to_array(next(t for t in folded.graph.initializer if t.name == dq.input[0])).shape == (4, 5)
    assert "w" not in {t.name for t in folded.graph.initializer}
    onnx.checker.check_model(folded, full_check=True)
    feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}
    assert run(folded, feeds, optimized=False)[0].tobytes() == run(model, feeds, optimized=False)[0].tobytes()
    assert on_proto(FoldWeightTransposePass(), folded).SerializeToString() == folded.SerializeToString()


def test_weight_transpose_folding_reaches_into_if_bodies_and_keeps_shared_weights():
    """Both branches of an If read the outer weight through DQ → Transpose → MatMul; the main graph
    reads it too. Every foldable Transpose is folded, the shared weight stays, the checker passes."""
    import onnx_ir as ir


    w = RNG.integers(-127, 128, size=(5, 4)).astype(np.int8)
    inits = [_c("w", w), _c("ws", np.linspace(0.01, 0.05, 5).astype(np.float32)), _c("wz", np.zeros(5, np.int8))]

    def branch(name: str) -> onnx.GraphProto:
        nodes = [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], [f"{name}_wd"], axis=0),
                 helper.make_node("Transpose", [f"{name}_wd"], [f"{name}_wt"], perm=[1, 0]),
                 helper.make_node("MatMul", ["x", f"{name}_wt"], ["same"])]  # the same name in both branches
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info("same", TensorProto.FLOAT, [2, 3, 5])])

    nodes = [helper.make_node("If", ["flag"], ["picked"], then_branch=branch("then"), else_branch=branch("else")),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("ReduceSum", ["wd"], ["total"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("picked", TensorProto.FLOAT, [2, 3, 5]),
                               helper.make_tensor_value_info("total", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    folded = on_proto(FoldWeightTransposePass(), model)
    onnx.checker.check_model(folded, full_check=True)
    assert "w" in {t.name for t in folded.graph.initializer}  # the main graph still reads it
    bodies = [a.g for n in folded.graph.node if n.op_type == "If" for a in n.attribute]
    assert all("Transpose" not in [n.op_type for n in body.node] for body in bodies)
    for flag in (True, False):
        feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32), "flag": np.array(flag)}
        got, want = run(folded, feeds, optimized=False), run(model, feeds, optimized=False)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
    ir_model = ir.from_proto(folded)
    assert FoldWeightTransposePass()(ir_model).modified is False  # idempotent, and honest about it
    assert FoldWeightTransposePass()(ir.from_proto(model)).modified is True
