"""Property: random valid 2.0.0 encodings on random small graphs convert, pass the checker, run,
and come back unchanged through onnx_qdq_to_encodings."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxport import encodings_to_onnx_qdq, onnx_qdq_to_encodings
from onnxport.encodings.formats import DTYPES

K = 8
INTEGER_TYPES = ["int8", "uint8", "int16", "uint16", "int4", "uint4"]
scales = st.integers(1, 64).map(lambda m: float(np.float32(m / 256)))  # exact in float32


@st.composite
def graphs_and_encodings(draw):
    n_layers = draw(st.integers(1, 4))
    nodes, inits, tensors, weights = [], [], ["input"], []
    current = "input"
    for i in range(n_layers):
        kind = draw(st.sampled_from(["matmul", "relu", "add", "transpose"]))
        out = f"t{i}"
        if kind == "matmul":
            w = f"w{i}"
            inits.append(numpy_helper.from_array(np.random.default_rng(i).standard_normal((K, K)).astype(np.float32), w))
            nodes.append(helper.make_node("MatMul", [current, w], [out]))
            weights.append(w)
        elif kind == "relu":
            nodes.append(helper.make_node("Relu", [current], [out]))
        elif kind == "add":
            b = f"b{i}"
            inits.append(numpy_helper.from_array(np.full(K, 0.5, np.float32), b))
            nodes.append(helper.make_node("Add", [current, b], [out]))
        else:
            nodes.append(helper.make_node("Transpose", [current], [out], perm=[1, 0]))
        tensors.append(out)
        current = out
    nodes.append(helper.make_node("Identity", [current], ["output"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", T.FLOAT, [K, K])],
                              [helper.make_tensor_value_info("output", T.FLOAT, [K, K])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    chosen = draw(st.lists(st.sampled_from(tensors + weights), unique=True, max_size=len(tensors) + len(weights)))
    entries = []
    for name in chosen:
        dtype = draw(st.sampled_from(INTEGER_TYPES))
        d = DTYPES[dtype]
        layout = draw(st.sampled_from(["tensor", "channel", "block"] if name in weights else ["tensor"]))
        entry: dict = {"name": name, "output_dtype": dtype}
        if layout == "tensor":
            entry["y_scale"] = draw(scales)
            zp = draw(st.integers(d.qmin, d.qmax))
        elif layout == "channel":
            entry["axis"] = draw(st.sampled_from([0, 1]))
            entry["y_scale"] = draw(st.lists(scales, min_size=K, max_size=K))
            zp = [draw(st.integers(d.qmin, d.qmax)) for _ in range(K)]
        else:
            axis, block = draw(st.sampled_from([0, 1])), draw(st.sampled_from([2, 4, 8]))
            shape = [K, K]
            shape[axis] = K // block
            entry.update(axis=axis, block_size=block)
            entry["y_scale"] = np.array(draw(st.lists(scales, min_size=K * K // block, max_size=K * K // block))).reshape(shape).tolist()
            zp = np.array([draw(st.integers(d.qmin, d.qmax)) for _ in range(K * K // block)]).reshape(shape).tolist()
        if np.any(np.asarray(zp)):
            entry["y_zero_point"] = zp
        entries.append(entry)
    return model, {"version": "2.0.0", "encodings": entries}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_and_encodings())
def test_random_encodings_convert_check_run_and_round_trip(case):
    model, encodings = case
    q = encodings_to_onnx_qdq(model, encodings, force_activation_as=None, derive_data_movement=False)
    onnx.checker.check_model(q, full_check=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    out = ort.InferenceSession(q.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"input": np.random.default_rng(1).standard_normal((K, K)).astype(np.float32)})[0]
    assert np.all(np.isfinite(out))
    back = onnx_qdq_to_encodings(q)
    key = lambda e: e["name"]
    assert sorted(back["encodings"], key=key) == sorted(encodings["encodings"], key=key)
