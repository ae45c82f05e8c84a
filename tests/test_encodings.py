"""encodings_to_onnx_qdq on hand-built graphs: every version × kind, checked node by node and
against a NumPy fake-quantization reference run through real ONNX Runtime."""

from __future__ import annotations

import copy
import json

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxport import encodings_to_onnx_qdq, onnx_qdq_to_encodings, save_model
from onnxport.encodings.convert import OmittedEncodingsWarning
from onnxport.errors import InvalidArgumentError

RNG = np.random.default_rng(0)
W_CONV = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
W_FC = RNG.standard_normal((5, 16)).astype(np.float32)  # Gemm transB=1: (out, in)
X = RNG.standard_normal((2, 3, 4, 4)).astype(np.float32)


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def conv_model(opset=17):
    """input → Conv(+bias) → Relu → Reshape → Gemm(transB=1) → output."""
    return _model(
        [
            helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["conv_out"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv_out"], ["relu_out"]),
            helper.make_node("GlobalAveragePool", ["relu_out"], ["pooled"]),
            helper.make_node("Reshape", ["pooled", "shape"], ["flat"]),
            helper.make_node("Concat", ["flat", "flat", "flat", "flat"], ["cat"], axis=1),
            helper.make_node("Gemm", ["cat", "fc.weight", "fc.bias"], ["output"], transB=1),
        ],
        [helper.make_tensor_value_info("input", T.FLOAT, ["N", 3, 4, 4])],
        [helper.make_tensor_value_info("output", T.FLOAT, ["N", 5])],
        [numpy_helper.from_array(W_CONV, "conv.weight"), numpy_helper.from_array(np.full(4, 0.1, np.float32), "conv.bias"),
         numpy_helper.from_array(np.array([-1, 4], np.int64), "shape"), numpy_helper.from_array(W_FC, "fc.weight"),
         numpy_helper.from_array(np.zeros(5, np.float32), "fc.bias")],
        opset,
    )


def run(model, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def fake_quant(x, scale, zp, qmin, qmax, axis=None, block=None):
    scale = np.asarray(scale, np.float32)
    zp = np.asarray(zp, np.float32)
    if block:
        scale, zp = np.repeat(scale, block, axis=axis), np.repeat(np.broadcast_to(zp, scale.shape if zp.ndim else ()), block, axis=axis) if zp.ndim else zp
    elif axis is not None and scale.ndim == 1:
        view = [1] * x.ndim
        view[axis] = -1
        scale, zp = scale.reshape(view), (zp.reshape(view) if zp.ndim else zp)
    q = np.clip(np.rint(x / scale) + zp, qmin, qmax)
    return ((q - zp) * scale).astype(np.float32)


def nodes_of(model, op):
    return [n for n in model.graph.node if n.op_type == op]


def init(model, name):
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def opset(model):
    return next(e.version for e in model.opset_import if e.domain in ("", "ai.onnx"))


def reference(model, replacements, x, input_fq=None, output_fq=None):
    """Run the float model with constants replaced by their fake-quantized values."""
    ref = copy.deepcopy(model)
    for t in ref.graph.initializer:
        if t.name in replacements:
            t.CopyFrom(numpy_helper.from_array(replacements[t.name], t.name))
    out = run(ref, {"input": input_fq(x) if input_fq else x})[0]
    return output_fq(out) if output_fq else out


# -- 2.0.0 ------------------------------------------------------------------------------------------------
def test_v2_per_tensor_per_channel_and_outputs_against_numpy():
    s_w = np.linspace(0.01, 0.04, 4).astype(np.float32)
    enc = {"version": "2.0.0", "encodings": [
        {"name": "input", "output_dtype": "uint8", "y_scale": 0.03125, "y_zero_point": 128},
        {"name": "conv.weight", "output_dtype": "int8", "y_scale": s_w.tolist(), "axis": 0},
        {"name": "output", "output_dtype": "int8", "y_scale": 0.0625},
    ]}
    model = conv_model()
    before = model.SerializeToString()
    q = encodings_to_onnx_qdq(model, enc, force_activation_as=None, derive_data_movement=False)
    assert model.SerializeToString() == before  # input untouched
    assert opset(q) == 17 and [o.name for o in q.graph.output] == ["output"] and q.graph.input[0].name == "input"
    onnx.checker.check_model(q, full_check=True)
    dq_w = next(n for n in nodes_of(q, "DequantizeLinear") if n.input[0] == "conv.weight_q" or "conv.weight" in n.input[0])
    assert helper.get_attribute_value(dq_w.attribute[0]) == 0
    np.testing.assert_array_equal(init(q, "conv.weight_scale"), s_w)
    assert init(q, "conv.weight_zero_point").dtype == np.int8
    expected = reference(
        model, {"conv.weight": fake_quant(W_CONV, s_w, 0, -128, 127, axis=0)}, X,
        input_fq=lambda x: fake_quant(x, 0.03125, 128, 0, 255),
        output_fq=lambda y: fake_quant(y, 0.0625, 0, -128, 127),
    )
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, rtol=0, atol=1e-6)


def test_v2_blockwise_int4_and_int16_raise_opset_to_21():
    enc = {"version": "2.0.0", "encodings": [
        {"name": "fc.weight", "output_dtype": "int4", "y_scale": [[0.25, 0.5]] * 5, "axis": 1, "block_size": 8},
        {"name": "input", "output_dtype": "uint16", "y_scale": 0.001, "y_zero_point": 32768},
    ]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    assert opset(q) == 21
    dq = next(n for n in nodes_of(q, "DequantizeLinear") if n.output[0].startswith("fc.weight"))
    assert {a.name: a.i for a in dq.attribute} == {"axis": 1, "block_size": 8}
    assert next(t for t in q.graph.initializer if t.name == "fc.weight_zero_point").data_type == T.INT4
    expected = reference(conv_model(), {"fc.weight": fake_quant(W_FC, np.array([[0.25, 0.5]] * 5), 0, -8, 7, axis=1, block=8)},
                         X, input_fq=lambda x: fake_quant(x, 0.001, 32768, 0, 65535))
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, atol=1e-5)


def test_v2_lpbq_form_equals_its_product():
    ints = [[16, 15], [16, 6], [10, 16], [3, 4], [9, 9]]
    channel = [[0.001], [0.002], [0.003], [0.004], [0.005]]
    enc = {"version": "2.0.0", "encodings": [{"name": "fc.weight", "output_dtype": "int4", "axis": 1, "block_size": 8,
                                               "per_block_int_scale": ints, "per_channel_float_scale": channel}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    scale_dq = next(n for n in nodes_of(q, "DequantizeLinear") if n.output[0] == "fc.weight_scale")
    assert helper.get_attribute_value(scale_dq.attribute[0]) == 0  # the channel axis
    scale = np.array(ints, np.float32) * np.array(channel, np.float32)
    expected = reference(conv_model(), {"fc.weight": fake_quant(W_FC, scale, 0, -8, 7, axis=1, block=8)}, X)
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float8e4m3fn", "float8e5m2"])
def test_v2_float8_per_tensor_and_per_channel(dtype):
    enc = {"version": "2.0.0", "encodings": [
        {"name": "input", "output_dtype": dtype, "y_scale": 0.01},
        {"name": "conv.weight", "output_dtype": dtype, "y_scale": [0.001, 0.002, 0.003, 0.004], "axis": 0},
    ]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    assert opset(q) == 19
    onnx.checker.check_model(q, full_check=True)
    ty = {"float8e4m3fn": ml_dtypes.float8_e4m3fn, "float8e5m2": ml_dtypes.float8_e5m2}[dtype]
    top = float(ml_dtypes.finfo(ty).max)  # QuantizeLinear saturates

    def cast(v):
        return np.clip(v, -top, top).astype(ty).astype(np.float32)

    xq = cast(X / np.float32(0.01)) * np.float32(0.01)
    wq = cast(W_CONV / np.array([0.001, 0.002, 0.003, 0.004], np.float32).reshape(4, 1, 1, 1))
    wq = wq * np.array([0.001, 0.002, 0.003, 0.004], np.float32).reshape(4, 1, 1, 1)
    expected = reference(conv_model(), {"conv.weight": wq}, xq)
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, rtol=1e-4, atol=1e-4)


def test_v2_int32_bias_is_stored_prequantized():
    enc = {"version": "2.0.0", "encodings": [{"name": "conv.bias", "output_dtype": "int32", "y_scale": [1e-4] * 4, "axis": 0}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    stored = init(q, "conv.bias_q")
    assert stored.dtype == np.int32 and np.all(stored == 1000)
    assert not nodes_of(q, "QuantizeLinear")
    assert "conv.bias" not in {t.name for t in q.graph.initializer}


def test_prequantize_constants_matches_quantize_linear():
    s_w = [0.011, 0.013, 0.017, 0.019]
    enc = {"version": "2.0.0", "encodings": [{"name": "conv.weight", "output_dtype": "int8", "y_scale": s_w, "axis": 0}]}
    pre = encodings_to_onnx_qdq(conv_model(), enc, prequantize_constants=True, derive_data_movement=False)
    live = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    assert init(pre, "conv.weight_q").dtype == np.int8 and not nodes_of(pre, "QuantizeLinear")
    np.testing.assert_array_equal(run(pre, {"input": X})[0], run(live, {"input": X})[0])


# -- 2.1.0 ------------------------------------------------------------------------------------------------
def test_v21_meta_scale_is_double_quantized():  # §4.1 #1
    enc = {"version": "2.1.0", "encodings": [{"name": "fc.weight", "output_dtype": "int4", "axis": 1, "block_size": 8,
                                               "y_scale": {"x": [[3, 5]] * 5, "x_scale": [0.01, 0.02, 0.03, 0.04, 0.05], "axis": 0}}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    scale = np.array([[3, 5]] * 5, np.float32) * np.array([0.01, 0.02, 0.03, 0.04, 0.05], np.float32)[:, None]
    expected = reference(conv_model(), {"fc.weight": fake_quant(W_FC, scale, 0, -8, 7, axis=1, block=8)}, X)
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, atol=1e-5)
    back = onnx_qdq_to_encodings(q)
    assert back["version"] == "2.1.0" and back["encodings"][0]["y_scale"]["x"] == [[3, 5]] * 5


def test_v21_float4_with_float8_meta_scale():  # §4.1 #4
    enc = {"version": "2.1.0", "encodings": [{"name": "fc.weight", "output_dtype": "float4e2m1", "axis": 1, "block_size": 16,
                                               "y_scale": {"x": [[0.5]] * 5, "x_scale": 0.25, "input_dtype": "float8e4m3fn"}}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    assert opset(q) == 23
    onnx.checker.check_model(q, full_check=True)
    assert next(t for t in q.graph.initializer if t.name == "fc.weight_zero_point").data_type == T.FLOAT4E2M1


# -- legacy ----------------------------------------------------------------------------------------------
def _v061(weight_offsets=-128.0, sym="True"):
    return {"version": "0.6.1",
            "activation_encodings": {"input": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "False", "offset": -165.0,
                                                "scale": 0.02, "min": -3.3, "max": 1.8}],
                                     "relu_out": [{"bitwidth": 16, "dtype": "float"}]},
            "param_encodings": {"conv.weight": [{"bitwidth": 8, "dtype": "int", "is_symmetric": sym, "offset": weight_offsets,
                                                 "scale": s} for s in (0.01, 0.02, 0.03, 0.04)]}}


def test_v061_offsets_follow_the_unsigned_domain_and_fp16_is_omitted():
    with pytest.warns(OmittedEncodingsWarning, match="relu_out"):
        q = encodings_to_onnx_qdq(conv_model(), _v061(), force_activation_as=None, derive_data_movement=False)
    assert init(q, "input_zero_point") == 165 and init(q, "input_zero_point").dtype == np.uint8
    assert np.all(init(q, "conv.weight_zero_point") == 0) and init(q, "conv.weight_zero_point").dtype == np.int8
    dq = next(n for n in nodes_of(q, "DequantizeLinear") if "conv.weight" in n.output[0])
    assert helper.get_attribute_value(dq.attribute[0]) == 0  # axis from the shape: 4 output channels


def test_is_symmetric_bool_and_string_mean_the_same():  # §4.1 #8
    with pytest.warns(OmittedEncodingsWarning):
        a = encodings_to_onnx_qdq(conv_model(), _v061(sym="True"), derive_data_movement=False)
    with pytest.warns(OmittedEncodingsWarning):
        b = encodings_to_onnx_qdq(conv_model(), _v061(sym=True), derive_data_movement=False)
    assert init(a, "conv.weight_zero_point").dtype == init(b, "conv.weight_zero_point").dtype == np.int8


def test_positive_legacy_offset_is_an_error_not_a_wrap():  # §4.1 #7
    bad = _v061()
    bad["activation_encodings"]["input"][0]["offset"] = 11.0
    with pytest.raises(InvalidArgumentError, match="'input'.*'offset'.*zero-point -11 does not fit uint8"):
        encodings_to_onnx_qdq(conv_model(), bad)


def test_v100_per_channel_axis_from_the_consumer_when_shape_is_ambiguous():
    w = RNG.standard_normal((4, 4)).astype(np.float32)  # MatMul weight (K, N), K == N
    model = _model([helper.make_node("MatMul", ["input", "w"], ["output"])],
                   [helper.make_tensor_value_info("input", T.FLOAT, [2, 4])], [helper.make_tensor_value_info("output", T.FLOAT, [2, 4])],
                   [numpy_helper.from_array(w, "w")])
    enc = {"version": "1.0.0", "activation_encodings": [], "param_encodings": [
        {"name": "w", "dtype": "INT", "enc_type": "PER_CHANNEL", "bw": 8, "is_sym": True, "scale": [0.1, 0.2, 0.3, 0.4], "offset": [-128] * 4}]}
    q = encodings_to_onnx_qdq(model, enc)
    dq = nodes_of(q, "DequantizeLinear")[0]
    assert helper.get_attribute_value(dq.attribute[0]) == 1  # MatMul: the last axis


@pytest.mark.parametrize("trans_b", [1, 0])
def test_v100_per_block_on_gemm_both_layouts(trans_b):  # §4.1 #2
    w = W_FC if trans_b else W_FC.T.copy()
    model = conv_model()
    model.graph.initializer[3].CopyFrom(numpy_helper.from_array(w, "fc.weight"))
    next(n for n in model.graph.node if n.op_type == "Gemm").attribute[0].i = trans_b
    flat = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]  # (channel, block) order, 5 channels x 2 blocks
    enc = {"version": "1.0.0", "activation_encodings": [], "param_encodings": [
        {"name": "fc.weight", "dtype": "INT", "enc_type": "PER_BLOCK", "bw": 4, "is_sym": True, "block_size": 8, "scale": flat, "offset": [-8] * 10}]}
    q = encodings_to_onnx_qdq(model, enc)
    grid = np.array(flat, np.float32).reshape(5, 2)
    expected_w = fake_quant(W_FC, grid, 0, -8, 7, axis=1, block=8)
    np.testing.assert_allclose(run(q, {"input": X})[0], reference(model, {"fc.weight": expected_w if trans_b else expected_w.T.copy()}, X), atol=1e-5)
    assert init(q, "fc.weight_scale").shape == ((5, 2) if trans_b else (2, 5))


def test_v100_lpbq():  # §4.1 #2
    enc = {"version": "1.0.0", "activation_encodings": [], "param_encodings": [
        {"name": "fc.weight", "dtype": "INT", "enc_type": "LPBQ", "bw": 8, "compressed_bw": 4, "is_sym": True, "block_size": 8,
         "scale": [0.001, 0.002, 0.003, 0.004, 0.005], "offset": [-128] * 5, "per_block_int_scale": [16, 15, 16, 6, 10, 16, 3, 4, 9, 9]}]}
    q = encodings_to_onnx_qdq(conv_model(), enc)
    scale = np.array([16, 15, 16, 6, 10, 16, 3, 4, 9, 9], np.float32).reshape(5, 2) * np.array([0.001, 0.002, 0.003, 0.004, 0.005], np.float32)[:, None]
    expected = reference(conv_model(), {"fc.weight": fake_quant(W_FC, scale, 0, -8, 7, axis=1, block=8)}, X)
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, atol=1e-5)


def test_int2_packs_and_declares_opset_25():  # §4.1 #3
    enc = {"version": "2.0.0", "encodings": [{"name": "conv.weight", "output_dtype": "int2", "y_scale": [0.5] * 4, "axis": 0}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, prequantize_constants=True, derive_data_movement=False)
    assert opset(q) == 25
    onnx.checker.check_model(q, full_check=True)
    stored = init(q, "conv.weight_q")
    np.testing.assert_array_equal(stored.astype(np.int8), np.clip(np.rint(W_CONV / 0.5), -2, 1).astype(np.int8))


# -- data movement, force_activation_as, names, control flow -----------------------------------------------
def test_data_movement_is_derived_and_can_be_switched_off():
    enc = {"version": "2.0.0", "encodings": [{"name": "pooled", "output_dtype": "uint8", "y_scale": 0.05}]}
    on = encodings_to_onnx_qdq(conv_model(), enc)
    off = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    names = {e["name"] for e in onnx_qdq_to_encodings(on)["encodings"]}
    assert {"pooled", "flat", "cat"} <= names
    assert {e["name"] for e in onnx_qdq_to_encodings(off)["encodings"]} == {"pooled"}


def test_clip_bounds_stay_float_and_optional_inputs_are_fine():  # §4.1 #13, #18
    model = _model([helper.make_node("Clip", ["input", "", "hi"], ["clipped"]), helper.make_node("Relu", ["clipped"], ["output"])],
                   [helper.make_tensor_value_info("input", T.FLOAT, [2, 4])], [helper.make_tensor_value_info("output", T.FLOAT, [2, 4])],
                   [numpy_helper.from_array(np.array(2.0, np.float32), "hi")])
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "uint8", "y_scale": 0.1}]})
    names = {e["name"] for e in onnx_qdq_to_encodings(q)["encodings"]}
    assert names == {"input", "clipped"}  # forward through Clip; the bound 'hi' gets no pair


def test_force_activation_as_is_lossless_and_validated():  # §4.1 #9
    enc = {"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": 0.05, "y_zero_point": -1},
                                              {"name": "conv.weight", "output_dtype": "int8", "y_scale": [0.01] * 4, "axis": 0}]}
    kept = encodings_to_onnx_qdq(conv_model(), enc, force_activation_as=None, derive_data_movement=False)
    unsigned = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    assert init(unsigned, "input_zero_point") == 127 and init(unsigned, "input_zero_point").dtype == np.uint8
    assert init(unsigned, "conv.weight_zero_point").dtype == np.int8  # parameters keep their type
    np.testing.assert_array_equal(run(unsigned, {"input": X})[0], run(kept, {"input": X})[0])
    with pytest.raises(InvalidArgumentError, match="force_activation_as must be"):
        encodings_to_onnx_qdq(conv_model(), enc, force_activation_as="foo")


def test_int32_activation_is_refused_clearly():  # §4.1 #6
    enc = {"version": "2.0.0", "encodings": [{"name": "conv_out", "output_dtype": "int32", "y_scale": 0.001}]}
    with pytest.raises(InvalidArgumentError, match="int32 activation has no QuantizeLinear"):
        encodings_to_onnx_qdq(conv_model(), enc)


def test_generated_names_never_collide():  # §4.1 #10
    model = conv_model()
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "input_scale"))
    model.graph.node.append(helper.make_node("Identity", ["input"], ["input_qdq"]))
    model.graph.output.append(helper.make_tensor_value_info("input_qdq", T.FLOAT, ["N", 3, 4, 4]))
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "uint8", "y_scale": 0.1}]},
                              derive_data_movement=False)
    onnx.checker.check_model(q)
    outputs = [o for n in q.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs)) and [o.name for o in q.graph.output] == ["output", "input_qdq"]


def test_tensors_inside_if_bodies_can_be_named():  # §4.1 #11
    body = helper.make_graph([helper.make_node("Relu", ["input"], ["inner"]), helper.make_node("Neg", ["inner"], ["branch_out"])],
                             "then", [], [helper.make_tensor_value_info("branch_out", T.FLOAT, [2, 4])])
    model = _model([helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True), "c")),
                    helper.make_node("If", ["cond"], ["output"], then_branch=body, else_branch=body)],
                   [helper.make_tensor_value_info("input", T.FLOAT, [2, 4])], [helper.make_tensor_value_info("output", T.FLOAT, [2, 4])], [])
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [{"name": "inner", "output_dtype": "uint8", "y_scale": 0.125}]})
    np.testing.assert_allclose(run(q, {"input": x})[0], -fake_quant(np.maximum(x, 0), 0.125, 0, 0, 255), atol=1e-6)


def _if_model() -> onnx.ModelProto:
    """input → Sigmoid → outer; If(cond): then reads outer and a branch-local constant, else negates."""
    then = helper.make_graph([
        helper.make_node("Constant", [], ["k_then"], value=numpy_helper.from_array(np.full(4, 2.0, np.float32), "k")),
        helper.make_node("Relu", ["outer"], ["then_mid"]),
        helper.make_node("Mul", ["then_mid", "k_then"], ["then_out"]),
    ], "then", [], [helper.make_tensor_value_info("then_out", T.FLOAT, [2, 4])])
    other = helper.make_graph([helper.make_node("Neg", ["outer"], ["else_out"])], "else", [],
                              [helper.make_tensor_value_info("else_out", T.FLOAT, [2, 4])])
    return _model([helper.make_node("Sigmoid", ["input"], ["outer"]),
                   helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=other),
                   helper.make_node("Add", ["branch", "outer"], ["output"])],
                  [helper.make_tensor_value_info("input", T.FLOAT, [2, 4]), helper.make_tensor_value_info("cond", T.BOOL, [])],
                  [helper.make_tensor_value_info("output", T.FLOAT, [2, 4])], [])


@pytest.mark.parametrize("prequantize", [False, True])
@pytest.mark.parametrize("names", [["then_mid", "k_then"], ["outer", "then_mid", "k_then"], ["outer", "then_mid"]])
def test_encodings_inside_if_branches_give_a_checked_sorted_model(names, prequantize):
    """Q/DQ pairs are appended to the graph that holds their tensor and every graph is sorted.
    With a pair in the main graph too, the bodies were reordered on copies the model no longer
    held, and a branch read its pair before making it."""
    model = _if_model()
    enc = {"version": "2.0.0", "encodings": [
        {"name": n, "output_dtype": "int8" if n.startswith("k") else "uint8", "y_scale": 0.125} for n in names]}
    q = encodings_to_onnx_qdq(model, enc, prequantize_constants=prequantize)
    onnx.checker.check_model(q, full_check=True)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    outer = 1 / (1 + np.exp(-x))
    if "outer" in names:
        outer = fake_quant(outer, 0.125, 0, 0, 255)
    mid = fake_quant(np.maximum(outer, 0), 0.125, 0, 0, 255)
    for cond, expected in ((True, mid * 2.0 + outer), (False, -outer + outer)):
        np.testing.assert_allclose(run(q, {"input": x, "cond": np.array(cond)})[0], expected, atol=1e-6)


def test_scalar_scale_with_one_element_zero_point():  # §4.1 #20
    q = encodings_to_onnx_qdq(conv_model(), {"version": "2.0.0", "encodings": [
        {"name": "input", "output_dtype": "uint8", "y_scale": 0.1, "y_zero_point": [3]}]}, force_activation_as=None)
    assert init(q, "input_zero_point") == 3


def test_per_channel_activation_in_v2():  # §4.1 #14
    enc = {"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": [0.1, 0.2, 0.3], "axis": 1}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, force_activation_as=None, derive_data_movement=False)
    expected = reference(conv_model(), {}, X, input_fq=lambda x: fake_quant(x, [0.1, 0.2, 0.3], 0, -128, 127, axis=1))
    np.testing.assert_allclose(run(q, {"input": X})[0], expected, atol=1e-5)


def test_fp8_prequantization_saturates():  # §4.1 #16
    enc = {"version": "2.0.0", "encodings": [{"name": "conv.weight", "output_dtype": "float8e4m3fn", "y_scale": [1e-3] * 4, "axis": 0}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, prequantize_constants=True, derive_data_movement=False)
    stored = init(q, "conv.weight_q").astype(np.float32)
    assert np.all(np.isfinite(stored)) and np.max(np.abs(stored)) == 448.0


def test_v2_float16_entries_are_omitted_with_one_warning():  # §4.1 #5
    enc = {"version": "2.0.0", "encodings": [{"name": "relu_out", "output_dtype": "float16"},
                                              {"name": "conv_out", "output_dtype": "bfloat16"}]}
    with pytest.warns(OmittedEncodingsWarning, match=r"omitted 2 encoding\(s\): \['conv_out', 'relu_out'\]"):
        q = encodings_to_onnx_qdq(conv_model(), enc)
    assert not nodes_of(q, "QuantizeLinear")


# -- validation: before the graph is touched, naming tensor and field -------------------------------------
@pytest.mark.parametrize(
    "enc, message",
    [
        ({"encodings": []}, "Unsupported encodings version None"),
        ({"version": "3.0", "encodings": []}, "Unsupported encodings version '3.0'"),
        ({"version": "2.0.0"}, "needs an 'encodings' list"),
        ({"version": "1.0.0", "param_encodings": {}}, "must be a list"),
        ({"version": "2.0.0", "encodings": [{"output_dtype": "int8", "y_scale": 1}]}, "has no 'name'"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": 0.1}] * 2}, "appears twice"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": -0.1}]}, "'input'.*'y_scale'.*zero, negative"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": float("nan")}]}, "'y_scale'.*not finite"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": True}]}, "'y_scale'.*non-numeric"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "uint8", "y_scale": 0.1, "y_zero_point": 2.5}]}, "'y_zero_point'.*not an integer"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": 0.1, "y_zero_point": 200}]}, "200 does not fit int8"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": 0.1, "bw": 8}]}, "'bw'.*legacy"),
        ({"version": "2.0.0", "encodings": [{"name": "conv.weight", "output_dtype": "int4", "y_scale": [[0.1]], "block_size": 4}]}, "'block_size'.*needs an 'axis'"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int9", "y_scale": 0.1}]}, "'output_dtype'"),
        ({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "int8", "y_scale": {"x": [1], "x_scale": 1}}]}, "needs version 2.1.0"),
        ({"version": "1.0.0", "activation_encodings": [{"name": "input", "dtype": "INT", "enc_type": "VECTOR", "bw": 8}], "param_encodings": []}, "'enc_type'"),
        ({"version": "1.0.0", "activation_encodings": [{"name": "x", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": True, "scale": [1], "offset": [-128]}],
          "param_encodings": [{"name": "x", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": True, "scale": [1], "offset": [-128]}]}, "in both"),
        ({"version": "0.6.1", "activation_encodings": {"input": [{"bitwidth": 8, "dtype": "float"}]}, "param_encodings": {}}, "8-bit float"),
        ({"version": "0.6.1", "activation_encodings": {"input": [{"bitwidth": 8, "dtype": "int", "offset": 0, "scale": 1}]}, "param_encodings": {}}, "'is_symmetric'.*missing"),
    ],
)
def test_file_validation(enc, message):
    model = conv_model()
    before = model.SerializeToString()
    with pytest.raises(InvalidArgumentError, match=message):
        encodings_to_onnx_qdq(model, enc)
    assert model.SerializeToString() == before


def test_missing_tensors_are_listed():
    enc = {"version": "2.0.0", "encodings": [{"name": n, "output_dtype": "uint8", "y_scale": 0.1} for n in ("nope_b", "input", "nope_a")]}
    with pytest.raises(InvalidArgumentError, match=r"does not have: \['nope_a', 'nope_b'\]"):
        encodings_to_onnx_qdq(conv_model(), enc)


def test_non_float_tensor_and_axis_contradicting_shape():  # §4.1 #12
    with pytest.raises(InvalidArgumentError, match="'shape'.*int64"):
        encodings_to_onnx_qdq(conv_model(), {"version": "2.0.0", "encodings": [{"name": "shape", "output_dtype": "int8", "y_scale": 1.0}]})
    with pytest.raises(InvalidArgumentError, match=r"'conv.weight' \(shape \(4, 3, 3, 3\)\).*axis 1 has 3 channels.*4 scales"):
        encodings_to_onnx_qdq(conv_model(), {"version": "2.0.0", "encodings": [{"name": "conv.weight", "output_dtype": "int8", "y_scale": [0.1] * 4, "axis": 1}]})


@pytest.mark.parametrize("dtype", [T.FLOAT16, T.BFLOAT16, T.DOUBLE])
def test_non_float32_graphs_are_refused_subgraphs_included(dtype):  # §4.1 #11, #12
    body = helper.make_graph([helper.make_node("Cast", ["input"], ["c"], to=dtype), helper.make_node("Cast", ["c"], ["o"], to=T.FLOAT)],
                             "b", [], [helper.make_tensor_value_info("o", T.FLOAT, [2, 4])])
    model = _model([helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True), "k")),
                    helper.make_node("If", ["cond"], ["output"], then_branch=body, else_branch=body)],
                   [helper.make_tensor_value_info("input", T.FLOAT, [2, 4])], [helper.make_tensor_value_info("output", T.FLOAT, [2, 4])], [])
    with pytest.raises(InvalidArgumentError, match="converts float32 models"):
        encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": []})


# -- files, paths, external data --------------------------------------------------------------------------
def test_paths_for_model_and_encodings(tmp_path):  # §4.1 #15
    model_path = tmp_path / "m.onnx"
    onnx.save(conv_model(), str(model_path))
    enc_path = tmp_path / "m.encodings"
    enc_path.write_text(json.dumps({"version": "2.0.0", "encodings": [{"name": "input", "output_dtype": "uint8", "y_scale": 0.1}]}))
    q = encodings_to_onnx_qdq(model_path, enc_path)  # pathlib.Path for both
    assert nodes_of(q, "QuantizeLinear")


def test_external_weights_stay_on_disk_and_save_streams_them(tmp_path):
    big = RNG.standard_normal((64, 256)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["input", "w"], ["output"])],
                   [helper.make_tensor_value_info("input", T.FLOAT, [2, 64])], [helper.make_tensor_value_info("output", T.FLOAT, [2, 256])],
                   [numpy_helper.from_array(big, "w")])
    src = tmp_path / "src"
    src.mkdir()
    onnx.save_model(model, str(src / "m.onnx"), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    enc = {"version": "2.0.0", "encodings": [{"name": "w", "output_dtype": "int4", "y_scale": np.full((2, 256), 0.05).tolist(),
                                              "axis": 0, "block_size": 32}]}
    q = encodings_to_onnx_qdq(src / "m.onnx", enc)
    weight = next(t for t in q.graph.initializer if t.name == "w")
    assert weight.data_location == T.EXTERNAL and not weight.raw_data  # never loaded
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    save_model(q, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["q.onnx", "q.onnx.data"]
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    options = ort.SessionOptions()
    # at the default level ORT fuses DQ(int4)+MatMul into MatMulNBits, which may quantize the
    # activations too; the exact semantics are checked unoptimised
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    expected = x @ fake_quant(big, np.full((2, 256), 0.05), 0, -8, 7, axis=0, block=32)
    np.testing.assert_allclose(session.run(None, {"input": x})[0], expected, atol=1e-4)


# -- the reverse direction ---------------------------------------------------------------------------------
def test_round_trip_is_the_identity_on_normalised_entries():
    enc = {"version": "2.0.0", "encodings": [
        {"name": "input", "output_dtype": "uint8", "y_scale": 0.5, "y_zero_point": 3},
        {"name": "conv.weight", "output_dtype": "int8", "y_scale": [0.25, 0.5, 0.125, 1.0], "axis": 0},
        {"name": "fc.weight", "output_dtype": "int4", "y_scale": [[0.25, 0.5]] * 5, "axis": 1, "block_size": 8},
        {"name": "output", "output_dtype": "int16", "y_scale": 0.0625, "y_zero_point": -7},
    ]}
    q = encodings_to_onnx_qdq(conv_model(), enc, force_activation_as=None, derive_data_movement=False)
    back = onnx_qdq_to_encodings(q)
    assert back["version"] == "2.0.0"
    assert sorted(back["encodings"], key=lambda e: e["name"]) == sorted(enc["encodings"], key=lambda e: e["name"])
    again = encodings_to_onnx_qdq(conv_model(), back, force_activation_as=None, derive_data_movement=False)
    np.testing.assert_array_equal(run(again, {"input": X})[0], run(q, {"input": X})[0])


def test_strict_symmetric_legacy_offset_is_zero_point_minus_one():  # §4.1 #17
    enc = {"version": "1.0.0", "activation_encodings": [], "param_encodings": [
        {"name": "conv.weight", "dtype": "INT", "enc_type": "PER_CHANNEL", "bw": 8, "is_sym": True,
         "scale": [0.01] * 4, "offset": [-127] * 4}]}
    q = encodings_to_onnx_qdq(conv_model(), enc, derive_data_movement=False)
    # AIMET's strict grid is [-127s, 127s]; Q/DQ can state the grid's offset (zero-point -1) but not
    # AIMET's clamp at +127s, so +128s stays representable: the closest exact translation.
    assert np.all(init(q, "conv.weight_zero_point") == -1)


def test_encodings_and_stats_never_import_torch(tmp_path):
    import subprocess
    import sys

    onnx.save(conv_model(), str(tmp_path / "m.onnx"))
    code = (
        "import sys, onnxport\n"
        f"m = onnxport.encodings_to_onnx_qdq(r'{tmp_path / 'm.onnx'}', {{'version': '2.0.0', 'encodings': "
        "[{'name': 'input', 'output_dtype': 'uint8', 'y_scale': 0.1}]})\n"
        "onnxport.qdq_stats(m); onnxport.onnx_qdq_to_encodings(m)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_conv_transpose_legacy_axis_and_a_residual_transpose_chain():
    w = RNG.standard_normal((4, 4, 2, 2)).astype(np.float32)  # ConvTranspose (in, out, k, k): in == out
    model = _model(
        [
            helper.make_node("ConvTranspose", ["input", "up.weight"], ["up"], strides=[2, 2]),
            helper.make_node("Transpose", ["up"], ["t1"], perm=[0, 1, 3, 2]),
            helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 1, 3, 2]),
            helper.make_node("Add", ["t2", "up"], ["output"]),  # a residual add over the chain
        ],
        [helper.make_tensor_value_info("input", T.FLOAT, [1, 4, 3, 3])],
        [helper.make_tensor_value_info("output", T.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(w, "up.weight")],
    )
    enc = {"version": "1.0.0", "param_encodings": [
        {"name": "up.weight", "dtype": "INT", "enc_type": "PER_CHANNEL", "bw": 8, "is_sym": True,
         "scale": [0.01, 0.02, 0.03, 0.04], "offset": [-128] * 4}],
        "activation_encodings": [{"name": "up", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": False,
                                  "scale": [0.05], "offset": [-128]}]}
    q = encodings_to_onnx_qdq(model, enc)
    dq_w = next(n for n in nodes_of(q, "DequantizeLinear") if n.output[0].startswith("up.weight"))
    assert helper.get_attribute_value(dq_w.attribute[0]) == 1  # ConvTranspose: output channels on axis 1
    names = {e["name"] for e in onnx_qdq_to_encodings(q)["encodings"]}
    assert {"up", "t1", "t2"} <= names  # the Transpose chain takes the encoding of what it moves
    x = RNG.standard_normal((1, 4, 3, 3)).astype(np.float32)
    ref_w = fake_quant(w, [0.01, 0.02, 0.03, 0.04], 0, -128, 127, axis=1)
    up = run(_model([helper.make_node("ConvTranspose", ["input", "up.weight"], ["output"], strides=[2, 2])],
                    [helper.make_tensor_value_info("input", T.FLOAT, [1, 4, 3, 3])],
                    [helper.make_tensor_value_info("output", T.FLOAT, [1, 4, 6, 6])],
                    [numpy_helper.from_array(ref_w, "up.weight")]), {"input": x})[0]
    up_q = fake_quant(up, 0.05, 128, 0, 255)
    np.testing.assert_allclose(run(q, {"input": x})[0], up_q + up_q, atol=1e-5)


# -- the converter's passes, on hand-built graphs ---------------------------------------------------
def _relu_model(opset: int) -> ir.Model:

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 4])])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def test_raise_opset_pass_raises_never_lowers_and_is_idempotent():
    from onnxport.encodings.convert import RaiseOpsetPass

    raised = RaiseOpsetPass(21)(_relu_model(13))
    assert raised.modified and raised.model.opset_imports[""] == 21
    again = RaiseOpsetPass(21)(raised.model)
    assert not again.modified and again.model.opset_imports[""] == 21
    assert not RaiseOpsetPass(13)(_relu_model(17)).modified  # never lowers


def test_insert_encodings_pass_inserts_once_and_needs_its_opset():
    import collections

    from onnxport.encodings.convert import InsertEncodingsPass
    from onnxport.encodings.formats import parse_encodings

    def entries(*specs):
        return collections.deque(parse_encodings({"version": "2.0.0", "encodings": list(specs)}).entries)

    model = _relu_model(13)
    x = {"name": "x", "output_dtype": "uint8", "y_scale": 0.05, "y_zero_point": 128}
    assert InsertEncodingsPass(entries(x), prequantize=False, scratch=None)(model).modified
    ops = [n.op_type for n in model.graph]
    assert ops == ["QuantizeLinear", "DequantizeLinear", "Relu"]  # sorted: the pair before its reader
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.inputs[0].producer().op_type == "DequantizeLinear"
    assert not InsertEncodingsPass(entries(x), prequantize=False, scratch=None)(model).modified  # already encoded
    onnx.checker.check_model(ir.to_proto(model), full_check=True)

    int16 = {"name": "y", "output_dtype": "uint16", "y_scale": 0.05}  # 16-bit Q/DQ is opset 21
    with pytest.raises(ir.passes.PreconditionError, match="opset 21"):
        InsertEncodingsPass(entries(int16), prequantize=False, scratch=None)(_relu_model(13))
