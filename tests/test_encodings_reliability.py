"""encodings_to_onnx_qdq on values a broken pipeline writes: numbers valid as JSON but not in the
type they are written in, bad values inside double-quantized scales, strings for numbers — and
weights that reach their consumer through a data-movement operator."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxport import encodings_to_onnx_qdq, onnx_qdq_to_encodings
from onnxport.errors import InvalidArgumentError

RNG = np.random.default_rng(3)
W = RNG.standard_normal((4, 6)).astype(np.float32)  # (out 4, in 6), read as MatMul(x, Transpose(W))
X = RNG.standard_normal((2, 6)).astype(np.float32)


def transposed_weight_model(mover: str = "Transpose") -> onnx.ModelProto:
    """x (2, 6) → MatMul(x, mover(W)) → y (2, 4); the mover makes W (4, 6) a (6, 4) operand."""
    if mover == "Transpose":
        nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0])]
        inits = [numpy_helper.from_array(W, "W")]
    else:  # W stored (6, 1, 4): Squeeze or Reshape gives the (6, 4) operand
        nodes = [helper.make_node(mover, ["W", "dims"], ["Wt"])]
        dims = np.array([1], np.int64) if mover == "Squeeze" else np.array([6, 4], np.int64)
        inits = [numpy_helper.from_array(W.T.reshape(6, 1, 4).copy(), "W"), numpy_helper.from_array(dims, "dims")]
    nodes.append(helper.make_node("MatMul", ["x", "Wt"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 6])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def run(model: onnx.ModelProto) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": X})[0]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto | None:
    return next((n for n in model.graph.node if name in n.output), None)


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# -- numbers checked in the type they are written in ------------------------------------------------
def _file(version: str, scale) -> dict:
    """One scale, written where each version keeps it."""
    if version == "0.6.1":
        return {"version": "0.6.1", "activation_encodings": {"x": [{"bitwidth": 8, "dtype": "int", "is_symmetric": "False",
                                                                     "offset": -128, "scale": scale}]}, "param_encodings": {}}
    if version == "1.0.0":
        return {"version": "1.0.0", "param_encodings": [], "activation_encodings": [
            {"name": "x", "bw": 8, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": False, "scale": [scale], "offset": [-128]}]}
    return {"version": version, "encodings": [{"name": "x", "output_dtype": "uint8", "y_scale": scale}]}


@pytest.mark.parametrize("version", ["0.6.1", "1.0.0", "2.0.0", "2.1.0"])
@pytest.mark.parametrize("value, why", [
    (1e-310, "becomes 0 in float32"), (5e-324, "becomes 0 in float32"), (1e-45, "subnormal"),
    (3.5e38, "overflows float32"), (1e39, "overflows float32"), (1e308, "overflows float32"),
])
def test_scales_valid_in_float64_but_not_in_float32_are_refused(version, value, why):
    model = transposed_weight_model()
    before = model.SerializeToString()
    with pytest.raises(InvalidArgumentError, match=r"'x'.*field '(y_)?scale'") as caught:
        encodings_to_onnx_qdq(model, _file(version, value))
    assert why in str(caught.value) and repr(value) in str(caught.value)  # the value as read
    assert model.SerializeToString() == before


def test_subnormal_scales_are_an_explicit_choice():
    with pytest.raises(InvalidArgumentError, match="subnormal.*allow_subnormal_scales=True"):
        encodings_to_onnx_qdq(transposed_weight_model(), _file("2.0.0", 1e-40))
    q = encodings_to_onnx_qdq(transposed_weight_model(), _file("2.0.0", 1e-40), allow_subnormal_scales=True)
    onnx.checker.check_model(q, full_check=True)
    scale = numpy_helper.to_array(next(t for t in q.graph.initializer if t.name == "x_scale"))
    assert scale == np.float32(1e-40) and 0 < scale < np.finfo(np.float32).tiny
    with pytest.raises(InvalidArgumentError, match="becomes 0 in float32"):  # still no zero scale
        encodings_to_onnx_qdq(transposed_weight_model(), _file("2.0.0", 1e-310), allow_subnormal_scales=True)
    with pytest.raises(InvalidArgumentError, match="allow_subnormal_scales must be True or False"):
        encodings_to_onnx_qdq(transposed_weight_model(), _file("2.0.0", 0.1), allow_subnormal_scales="yes")


@pytest.mark.parametrize("version", ["0.6.1", "1.0.0", "2.0.0", "2.1.0"])
def test_a_string_where_a_number_belongs_is_a_named_error(version):
    with pytest.raises(InvalidArgumentError, match=r"'x'.*field '(y_)?scale'.*string \(\"0.1\"\).*unquoted"):
        encodings_to_onnx_qdq(transposed_weight_model(), _file(version, "0.1"))
    per_channel = {"version": version, "encodings": [
        {"name": "W", "output_dtype": "int8", "axis": 0, "y_scale": [0.1, "0.2", 0.1, 0.1]}]}
    if version.startswith("2"):
        with pytest.raises(InvalidArgumentError, match=r"'W'.*field 'y_scale'.*string"):
            encodings_to_onnx_qdq(transposed_weight_model(), per_channel)
    with pytest.raises(InvalidArgumentError, match=r"'y_zero_point'.*string"):
        encodings_to_onnx_qdq(transposed_weight_model(), {"version": "2.0.0", "encodings": [
            {"name": "x", "output_dtype": "uint8", "y_scale": 0.1, "y_zero_point": "128"}]})


def test_zero_points_huge_and_out_of_range_name_the_value():
    for zp, why in [(10**30, "outside every ONNX integer type"), (256, "256 does not fit uint8"), (-1, "-1 does not fit uint8")]:
        with pytest.raises(InvalidArgumentError, match=f"'x'.*'y_zero_point'.*{why}"):
            encodings_to_onnx_qdq(transposed_weight_model(), {"version": "2.0.0", "encodings": [
                {"name": "x", "output_dtype": "uint8", "y_scale": 0.1, "y_zero_point": zp}]})


# -- double-quantized scales: each factor valid, their product not ------------------------------------
def _meta(**inner) -> dict:
    y_scale = {"x": [3, 5, 7, 9], "x_scale": 0.01, **inner}
    return {"version": "2.1.0", "encodings": [{"name": "W", "output_dtype": "int8", "axis": 0, "y_scale": y_scale}]}


@pytest.mark.parametrize("inner, message", [
    ({"x": [3, 0, 7, 9]}, r"field 'y_scale'.*= 0.0 at index \(1,\).*zero or negative"),
    ({"x": [3, -5, 7, 9], "input_dtype": "int8"}, r"field 'y_scale'.*= -0.0499.*zero or negative"),
    ({"x_scale": 2e-38, "x": [0.5, 1, 1, 1], "input_dtype": "float8e4m3fn"}, r"field 'y_scale':.*subnormal"),
    ({"x_scale": 1e38, "x": [3, 5, 7, 200]}, r"field 'y_scale'.*overflows float32"),
    ({"x_scale": 1e-310}, r"field 'y_scale.x_scale'.*becomes 0 in float32"),
    ({"x_scale": "0.01"}, r"field 'y_scale.x_scale'.*string"),
    ({"x": [3, 5, 7, 300], "input_dtype": "uint8"}, r"field 'y_scale.x'.*300.0 at index 3 does not fit its input_dtype uint8"),
    ({"x": [3, 5, 7, 2**40]}, r"field 'y_scale.x'.*no ONNX integer type"),
    ({"x_zero_point": 300}, r"field 'y_scale.x_zero_point'.*300 does not fit uint4"),
    ({"x_zero_point": [0, 0]}, r"field 'y_scale.x_zero_point'.*2 values for 1 scales"),
    ({"x": [0.5, 1, 1, 1], "input_dtype": "float8e4m3fn", "x_scale": 0.01}, None),
    ({"x": [0.3, 1, 1, 1], "input_dtype": "float8e4m3fn"}, r"field 'y_scale.x'.*not exactly representable in its input_dtype float8e4m3fn"),
    ({"input_dtype": 8}, r"field 'y_scale.input_dtype'.*must be a string"),
    ({"x": [[3, 5], [7, 9]]}, r"field 'y_scale.x'.*without a block_size the scale is one value or one per channel"),
    ({"x": [3, 5, 7, 9], "x_scale": [0.01, 0.02], "axis": 0}, r"field 'y_scale.x_scale'.*holds 2 values, but 'x' has 4"),
    ({"axis": 3}, r"field 'y_scale.axis'.*outside"),
])
def test_meta_scale_inner_values_are_named_errors(inner, message):
    model = transposed_weight_model()
    if message is None:  # the one valid variant: a float8 meta scale
        onnx.checker.check_model(encodings_to_onnx_qdq(model, _meta(**inner)), full_check=True)
        return
    with pytest.raises(InvalidArgumentError, match=r"Encoding of 'W' \(version 2.1.0\), " + message):
        encodings_to_onnx_qdq(model, _meta(**inner))


def test_lpbq_block_scales_that_multiply_to_zero_are_refused_in_every_form():
    lpbq = {"name": "W", "output_dtype": "int4", "axis": 1, "block_size": 3,
            "per_block_int_scale": [[2, 3], [0, 1], [4, 4], [1, 1]], "per_channel_float_scale": [[0.01]] * 4}
    with pytest.raises(InvalidArgumentError, match=r"'W'.*'per_block_int_scale'.*= 0.0 at index \(1, 0\)"):
        encodings_to_onnx_qdq(transposed_weight_model(), {"version": "2.0.0", "encodings": [lpbq]})
    legacy = {"version": "1.0.0", "activation_encodings": [], "param_encodings": [
        {"name": "W", "bw": 8, "dtype": "INT", "enc_type": "LPBQ", "is_sym": True, "block_size": 3, "compressed_bw": 4,
         "scale": [0.01] * 4, "offset": [-128] * 4, "per_block_int_scale": [2, 3, 0, 1, 4, 4, 1, 1]}]}
    model = _model_reading_w_directly()
    with pytest.raises(InvalidArgumentError, match=r"'W'.*'per_block_int_scale'.*zero or negative"):
        encodings_to_onnx_qdq(model, legacy)
    legacy["param_encodings"][0]["per_block_int_scale"] = [2, 3, 2**31, 1, 4, 4, 1, 1]
    with pytest.raises(InvalidArgumentError, match=r"'W'.*'per_block_int_scale'.*no ONNX integer type"):
        encodings_to_onnx_qdq(model, legacy)


def _model_reading_w_directly() -> onnx.ModelProto:
    """x (2, 6) → Gemm(x, W, transB=1): the legacy layouts need the weight's own consumer."""
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [2, 6])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 4])], [numpy_helper.from_array(W, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


# -- a weight read through data movement --------------------------------------------------------------
def _fake_quant(w: np.ndarray, scale, axis=None, block=None, qmin=-128, qmax=127) -> np.ndarray:
    s = np.asarray(scale, np.float32)
    if block:
        s = np.repeat(s, block, axis=axis)
    elif s.ndim == 1:
        view = [1] * w.ndim
        view[axis] = -1
        s = s.reshape(view)
    return (np.clip(np.rint(w / s), qmin, qmax) * s).astype(np.float32)


S4 = [0.011, 0.013, 0.017, 0.019]


@pytest.mark.parametrize("encoding, moved_axis, fq", [
    ({"output_dtype": "int8", "y_scale": 0.02}, None, lambda: _fake_quant(W, 0.02)),
    ({"output_dtype": "int8", "axis": 0, "y_scale": S4}, 1, lambda: _fake_quant(W, S4, axis=0)),
    ({"output_dtype": "int4", "axis": 1, "block_size": 3, "y_scale": [[0.2, 0.3]] * 4}, 0,
     lambda: _fake_quant(W, [[0.2, 0.3]] * 4, axis=1, block=3, qmin=-8, qmax=7)),
    ({"output_dtype": "int4", "axis": 1, "block_size": 3, "per_block_int_scale": [[2, 3]] * 4,
      "per_channel_float_scale": [[0.1], [0.11], [0.12], [0.13]]}, 0,
     lambda: _fake_quant(W, np.array([[2, 3]] * 4, np.float32) * np.array([[0.1], [0.11], [0.12], [0.13]], np.float32),
                         axis=1, block=3, qmin=-8, qmax=7)),
])
def test_a_weight_read_through_transpose_reaches_its_matmul_quantized(encoding, moved_axis, fq):
    model = transposed_weight_model()
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [{"name": "W", **encoding}]})
    onnx.checker.check_model(q, full_check=True)
    matmul = next(n for n in q.graph.node if n.op_type == "MatMul")
    dq = producer(q, matmul.input[1])
    assert dq.op_type == "DequantizeLinear", "the MatMul must read a quantized weight"
    assert attrs(dq).get("axis") == moved_axis
    np.testing.assert_allclose(run(q), X @ fq().T, rtol=1e-5, atol=1e-5)
    off = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [{"name": "W", **encoding}]}, derive_data_movement=False)
    assert producer(off, next(n for n in off.graph.node if n.op_type == "MatMul").input[1]).op_type == "Transpose"
    assert {e["name"] for e in onnx_qdq_to_encodings(q)["encodings"]} == {"W", "Wt"}


@pytest.mark.parametrize("mover", ["Squeeze", "Reshape"])
def test_a_per_channel_weight_keeps_its_channels_through_squeeze_and_reshape(mover):
    model = transposed_weight_model(mover)  # W stored (6, 1, 4), channels on axis 2
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [
        {"name": "W", "output_dtype": "int8", "axis": 2, "y_scale": S4}]})
    matmul = next(n for n in q.graph.node if n.op_type == "MatMul")
    dq = producer(q, matmul.input[1])
    assert dq.op_type == "DequantizeLinear" and attrs(dq)["axis"] == 1
    np.testing.assert_allclose(run(q), X @ _fake_quant(W, S4, axis=0).T, rtol=1e-5, atol=1e-5)


def test_a_weight_split_across_channels_by_a_reshape_stays_as_written():
    """When the channel axis does not survive the move whole, nothing is guessed."""
    w = W.T.reshape(6, 1, 4).copy()
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["W", "dims"], ["Wt"]), helper.make_node("MatMul", ["x", "Wt"], ["y"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [2, 6])], [helper.make_tensor_value_info("y", T.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([6, 4], np.int64), "dims")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [
        {"name": "W", "output_dtype": "int8", "axis": 0, "y_scale": [0.01] * 6}]})
    assert {e["name"] for e in onnx_qdq_to_encodings(q)["encodings"]} == {"W", "Wt"}  # axis 0 (6) survives
    w2 = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["W", "dims"], ["Wt"]), helper.make_node("MatMul", ["x", "Wt"], ["y"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [2, 6])], [helper.make_tensor_value_info("y", T.FLOAT, [2, 4])],
        [numpy_helper.from_array(w2, "W"), numpy_helper.from_array(np.array([6, 4], np.int64), "dims")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    q = encodings_to_onnx_qdq(model, {"version": "2.0.0", "encodings": [
        {"name": "W", "output_dtype": "int8", "axis": 1, "y_scale": [0.01] * 3}]})
    assert {e["name"] for e in onnx_qdq_to_encodings(q)["encodings"]} == {"W"}  # axis 1 (3) is merged away
    onnx.checker.check_model(q, full_check=True)
