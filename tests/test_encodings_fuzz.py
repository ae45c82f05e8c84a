"""Fuzz: malformed AIMET encodings, as a user's broken pipeline writes them.

Every generated file starts from a valid encodings file for a small real graph (every version,
every kind: per-tensor, per-channel, blockwise, LPBQ, 2.1.0 meta scales) and has one to three of
its values replaced, deleted or added. Each case must either convert to a model that passes the
full ``onnx.checker``, whose every Q/DQ scale is finite, positive and normal in float32, and
which ONNX Runtime runs to finite outputs — or raise ``InvalidArgumentError`` naming the tensor.
Never another exception, never more than 5 s, never a modified input.

The run is derandomised so CI is reproducible; ``ONNXPORT_FUZZ_RANDOM=1`` draws new cases and
``ONNXPORT_FUZZ_EXAMPLES`` sets how many per version (default 400, so 1,600 in all).
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import warnings
from collections import Counter
from contextlib import contextmanager

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplemented_

from onnxport import encodings_to_onnx_qdq
from onnxport.errors import InvalidArgumentError

EXAMPLES = int(os.environ.get("ONNXPORT_FUZZ_EXAMPLES", "400"))
RANDOM = bool(os.environ.get("ONNXPORT_FUZZ_RANDOM"))
OUTCOMES: Counter = Counter()
TIME_LIMIT_S = 5

RNG = np.random.default_rng(7)
W = RNG.standard_normal((8, 6)).astype(np.float32)  # MatMul weight: (in 8, out 6)
W2 = RNG.standard_normal((4, 6)).astype(np.float32)  # read through a Transpose: (out 4, in 6)
X = RNG.standard_normal((2, 8)).astype(np.float32)


def fuzz_model() -> onnx.ModelProto:
    """x → MatMul(W) → Add(b) → Relu → MatMul(Transpose(W2)) → Reshape → Identity → y."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["add"]),
        helper.make_node("Relu", ["add"], ["relu"]),
        helper.make_node("Transpose", ["W2"], ["W2t"], perm=[1, 0]),
        helper.make_node("MatMul", ["relu", "W2t"], ["mm2"]),
        helper.make_node("Reshape", ["mm2", "shape"], ["flat"]),
        helper.make_node("Identity", ["flat"], ["y"]),
    ]
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.full(6, 0.25, np.float32), "b"),
             numpy_helper.from_array(W2, "W2"), numpy_helper.from_array(np.array([-1], np.int64), "shape")]
    graph = helper.make_graph(nodes, "fuzz", [helper.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MODEL = fuzz_model()
MODEL_BYTES = MODEL.SerializeToString()

# -- valid starting points --------------------------------------------------------------------------
scales = st.integers(1, 4096).map(lambda m: m / 4096)


def _v2_weight(draw, meta: bool) -> dict:
    kind = draw(st.sampled_from(["tensor", "channel", "block", "lpbq"] + (["meta"] if meta else [])))
    if kind == "tensor":
        return {"name": "W", "output_dtype": "int8", "y_scale": draw(scales)}
    if kind == "channel":
        return {"name": "W", "output_dtype": "int8", "axis": 1, "y_scale": [draw(scales) for _ in range(6)]}
    if kind == "block":
        return {"name": "W", "output_dtype": "int4", "axis": 0, "block_size": 4,
                "y_scale": [[draw(scales) for _ in range(6)] for _ in range(2)]}
    if kind == "lpbq":
        return {"name": "W", "output_dtype": "int4", "axis": 0, "block_size": 4,
                "per_block_int_scale": [[draw(st.integers(1, 16)) for _ in range(6)] for _ in range(2)],
                "per_channel_float_scale": [[draw(scales) for _ in range(6)]]}
    inner = {"x": [[draw(st.integers(1, 16)) for _ in range(6)] for _ in range(2)],
             "x_scale": [draw(scales) for _ in range(6)], "axis": 1}
    if draw(st.booleans()):
        inner["input_dtype"] = "uint8"
    if draw(st.booleans()):
        inner["x_zero_point"] = [0] * 6
    return {"name": "W", "output_dtype": "int4", "axis": 0, "block_size": 4, "y_scale": inner}


@st.composite
def valid_v2(draw, version: str) -> dict:
    entries = [
        {"name": "x", "output_dtype": "uint8", "y_scale": draw(scales), "y_zero_point": draw(st.integers(0, 255))},
        _v2_weight(draw, meta=version == "2.1.0"),
        {"name": "b", "output_dtype": "int32", "y_scale": draw(scales) / 64},
        {"name": "relu", "output_dtype": "int8", "y_scale": draw(scales)},
        {"name": "W2", "output_dtype": "int8", "axis": 0, "y_scale": [draw(scales) for _ in range(4)]},
        {"name": "y", "output_dtype": "int16", "y_scale": draw(scales)},
    ]
    return {"version": version, "encodings": entries}


@st.composite
def valid_v100(draw) -> dict:
    def per_tensor(name: str, bits: int = 8, sym: bool = False) -> dict:
        return {"name": name, "bw": bits, "dtype": "INT", "enc_type": "PER_TENSOR", "is_sym": sym,
                "scale": [draw(scales)], "offset": [-(2 ** (bits - 1)) if sym else -draw(st.integers(0, 255))]}

    kind = draw(st.sampled_from(["channel", "block", "lpbq"]))
    if kind == "channel":
        w = {"name": "W", "bw": 8, "dtype": "INT", "enc_type": "PER_CHANNEL", "is_sym": True,
             "scale": [draw(scales) for _ in range(6)], "offset": [-128] * 6}
    elif kind == "block":
        w = {"name": "W", "bw": 4, "dtype": "INT", "enc_type": "PER_BLOCK", "is_sym": True, "block_size": 4,
             "scale": [draw(scales) for _ in range(12)], "offset": [-8] * 12}
    else:
        w = {"name": "W", "bw": 8, "dtype": "INT", "enc_type": "LPBQ", "is_sym": True, "block_size": 4,
             "compressed_bw": 4, "scale": [draw(scales) for _ in range(6)], "offset": [-128] * 6,
             "per_block_int_scale": [draw(st.integers(1, 16)) for _ in range(12)]}
    return {"version": "1.0.0", "param_encodings": [w, per_tensor("W2", sym=True)],
            "activation_encodings": [per_tensor("x"), per_tensor("relu"), per_tensor("y", 16)]}


@st.composite
def valid_v061(draw) -> dict:
    def one(sym: bool, bits: int = 8) -> dict:
        return {"bitwidth": bits, "dtype": "int", "is_symmetric": "True" if sym else "False",
                "offset": -(2 ** (bits - 1)) if sym else -draw(st.integers(0, 255)), "scale": draw(scales),
                "min": -1.0, "max": 1.0}

    return {"version": "0.6.1",
            "param_encodings": {"W": [one(True) for _ in range(6)], "W2": [one(True)]},
            "activation_encodings": {"x": [one(False)], "relu": [one(False)], "y": [one(False, 16)]}}


# -- mutations ------------------------------------------------------------------------------------
BAD_NUMBERS = [0, 0.0, -1, -0.5, 1e-310, 5e-324, 1e-45, 3.5e38, 1e39, 1e308, math.nan, math.inf, -math.inf,
               2**31, -(2**31) - 1, 2**63, 10**30, -(10**30), 1.5, 0.5, 127, 128, 255, 256, -129, 65536, 7, 16, 17]
BAD_OTHERS = ["0.1", "abc", "", "True", "int8", "uint4", "float16", "bfloat16", "int2", "float8e4m3fn",
              "float4e2m1", "PER_BLOCK", "LPBQ", "VECTOR", True, False, None, [], [[]], {}, [None], ["0.1"],
              [0.1, "x"], [[0.1], [0.2, 0.3]], [[[0.1]]], [0.1] * 3, [0.1] * 5, [0.1] * 7, [1] * 12,
              [[0.1] * 6] * 3, {"x": [1], "x_scale": 0.1}, {"x": "1", "x_scale": 0.1},
              {"x": [[0] * 6] * 2, "x_scale": [0.1] * 6, "axis": 1}, {"x": [[1] * 6] * 2, "x_scale": [1e-30] * 6, "axis": 1},
              {"x": [[1e30] * 6] * 2, "x_scale": [1e30] * 6, "axis": 1}, {"x_scale": 0.1}]
KEYS = ["y_scale", "y_zero_point", "axis", "block_size", "output_dtype", "per_block_int_scale",
        "per_channel_float_scale", "x", "x_scale", "x_zero_point", "input_dtype", "bw", "bitwidth", "dtype",
        "enc_type", "is_sym", "is_symmetric", "scale", "offset", "compressed_bw", "name"]


def _slots(value, path=()):
    """Every place in the file a value can be changed, as (path, container-kind)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield path + (key,), "dict"
            yield from _slots(inner, path + (key,))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield path + (index,), "list"
            yield from _slots(inner, path + (index,))


def _get(data, path):
    for step in path:
        data = data[step]
    return data


def _entry_name(data: dict, path: tuple) -> str | None:
    """The tensor whose entry holds ``path``, or None for a change at file level."""
    if data.get("version") == "0.6.1":
        return path[1] if len(path) >= 3 and path[0] in ("param_encodings", "activation_encodings") else None
    section_depth = 2
    if len(path) <= section_depth:
        return None
    entry = _get(data, path[:section_depth])
    name = entry.get("name") if isinstance(entry, dict) else None
    return name if isinstance(name, str) else None


@st.composite
def malformed(draw, base_strategy) -> tuple[dict, set]:
    data = copy.deepcopy(draw(base_strategy))
    touched: set = set()
    for _ in range(draw(st.integers(1, 3))):
        slots = [s for s in _slots(data) if s[0][0] != "version"]
        if not slots:
            break
        path, kind = draw(st.sampled_from(slots))
        name = _entry_name(data, path)
        parent = _get(data, path[:-1])
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
        key = draw(st.sampled_from(KEYS)) if action == "add" and isinstance(parent, dict) else path[-1]
        if name is None or key == "name" or len(path) <= 2:
            touched.add(None)  # the entry's identity changed: an error naming the entry's place will do
        touched.add(name)
        if action == "delete" and kind == "dict":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[key] = copy.deepcopy(draw(st.sampled_from(BAD_NUMBERS + BAD_OTHERS)))
        else:
            parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(BAD_NUMBERS + BAD_OTHERS)))
    return data, touched


# -- the oracle -----------------------------------------------------------------------------------
@contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise TimeoutError(f"a conversion ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _scale_values(model: onnx.ModelProto) -> list[np.ndarray]:
    """Every Q/DQ scale as float32 values, double-quantized scales evaluated as DequantizeLinear does."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    values = []
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        name = node.input[1]
        if name in inits:
            values.append(inits[name].astype(np.float32))
            continue
        meta = producers[name]
        assert meta.op_type == "DequantizeLinear" and all(i in inits for i in meta.input), "scale from an unexpected node"
        attrs = {a.name: a.i for a in meta.attribute}
        x = inits[meta.input[0]].astype(np.float32)
        s = inits[meta.input[1]].astype(np.float32)
        z = inits[meta.input[2]].astype(np.float32) if len(meta.input) > 2 and meta.input[2] else np.float32(0)
        if s.ndim == 1 and s.size > 1:
            view = [1] * x.ndim
            view[attrs.get("axis", 1)] = -1
            s, z = s.reshape(view), (z.reshape(view) if np.ndim(z) else z)
        values.append(((x - z) * s).astype(np.float32))
    return values


def check_case(case: tuple[dict, set]) -> None:
    data, touched = case
    before = json.dumps(data, sort_keys=True, default=repr)
    try:
        with time_limit(TIME_LIMIT_S), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = encodings_to_onnx_qdq(MODEL, data)
    except InvalidArgumentError as error:
        OUTCOMES["refused"] += 1
        named = [n for n in touched if n is not None and f"'{n}'" in str(error)]
        assert None in touched or named, f"the error names none of {sorted(map(str, touched))}: {error}"
    else:
        OUTCOMES["converted"] += 1
        onnx.checker.check_model(result, full_check=True)
        for scale in _scale_values(result):
            assert np.all(np.isfinite(scale)) and np.all(scale >= np.finfo(np.float32).tiny), scale
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4  # the failures that matter are raised, not logged
        try:
            session = ort.InferenceSession(result.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except NotImplemented_ as gap:  # a valid file ORT has no CPU kernel for (float4 Q/DQ, say)
            OUTCOMES["converted, no ORT kernel"] += 1
            assert "Could not find an implementation" in str(gap), gap
            return
        assert np.all(np.isfinite(session.run(None, {"x": X})[0]))
    finally:
        assert json.dumps(data, sort_keys=True, default=repr) == before, "the encodings were modified"
        assert MODEL.SerializeToString() == MODEL_BYTES, "the model was modified"


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(strategy) -> Counter:
    """Run the fuzz cases of one starting point and check that they both converted and refused a
    real share: a suite that only refused (or only converted) would test one path alone."""
    before = OUTCOMES.copy()

    @FUZZ
    @given(malformed(strategy))
    def run(case):
        check_case(case)

    run()
    mine = OUTCOMES - before
    total = mine["converted"] + mine["refused"]
    print(f"\nencodings fuzz: {total} cases, {mine['converted']} converted "
          f"({mine['converted, no ORT kernel']} of them with no ORT CPU kernel), {mine['refused']} refused")
    # one or two broken values in a small file are refused far more often than not: 3 % of 2.0.0's
    # 400 cases convert (13), 8 % or more of the others'
    assert total > 0 and mine["converted"] >= 0.02 * total and mine["refused"] >= 0.3 * total, dict(mine)
    return mine


@pytest.mark.parametrize("version", ["2.0.0", "2.1.0"])
def test_fuzz_v2(version):
    fuzz(valid_v2(version))


def test_fuzz_v100():
    fuzz(valid_v100())


def test_fuzz_v061():
    fuzz(valid_v061())


@pytest.mark.parametrize("strategy", [valid_v2("2.0.0"), valid_v2("2.1.0"), valid_v100(), valid_v061()],
                         ids=["2.0.0", "2.1.0", "1.0.0", "0.6.1"])
def test_every_starting_point_converts(strategy):
    """Without this, a fuzz suite whose valid files were all refused would pass by refusing."""

    @settings(max_examples=25, deadline=None, derandomize=True, database=None)
    @given(strategy)
    def run(data):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = encodings_to_onnx_qdq(MODEL, data)
        onnx.checker.check_model(result, full_check=True)

    run()


# -- hostile files: external data that leads out of the model's folder --------------------------------
def _external(name: str, values: np.ndarray, location: str, extra: tuple = ()) -> onnx.TensorProto:
    tensor = numpy_helper.from_array(values, name)
    tensor.ClearField("raw_data")
    tensor.data_location = T.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(values.nbytes)), *extra):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _hostile_models(folder, location: str, extra: tuple) -> dict[str, str]:
    """A float model and a Q/DQ model in ``folder`` whose weights name ``location``."""
    x = helper.make_tensor_value_info("x", T.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", T.FLOAT, [2, 8])
    opset = [helper.make_opsetid("", 17)]
    w = np.zeros((8, 8), np.float32)
    float_model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "f", [x], [y], [_external("W", w, location, extra)]),
        opset_imports=opset)
    qdq_model = helper.make_model(helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Wq", "s"], ["Wd"]), helper.make_node("MatMul", ["x", "Wd"], ["y"])],
        "q", [x], [y], [_external("Wq", w.astype(np.int8), location, extra), _external("s", np.array(0.5, np.float32), location, extra)]),
        opset_imports=opset)
    paths = {}
    for kind, model in (("float", float_model), ("qdq", qdq_model)):
        paths[kind] = str(folder / f"{kind}.onnx")
        onnx.save(model, paths[kind])
    return paths


def _readers():
    import torch

    from onnxport import (
        ONNXModel,
        check_target,
        compare_layers,
        compare_onnx,
        compare_qdq,
        qdq_report,
        qdq_stats,
        save_model,
        verify_onnx,
    )
    from onnxport.encodings import onnx_qdq_to_encodings

    linear = torch.nn.Linear(8, 8, bias=False).eval()
    sample = torch.randn(2, 8)
    enc = {"version": "2.0.0", "encodings": [{"name": "W", "output_dtype": "int8", "y_scale": 0.1}]}
    return {
        "ONNXModel": lambda p, out: ONNXModel(p["float"]),
        "encodings": lambda p, out: encodings_to_onnx_qdq(p["float"], enc),
        "encodings prequantized": lambda p, out: encodings_to_onnx_qdq(p["float"], enc, prequantize_constants=True),
        "streaming save": lambda p, out: save_model(_loaded_header(p["float"]), out),
        "qdq_stats": lambda p, out: qdq_stats(p["qdq"]),
        "qdq_report": lambda p, out: qdq_report(p["qdq"], ort=False),
        "check_target": lambda p, out: check_target(p["qdq"], "onnxruntime"),
        "onnx_qdq_to_encodings": lambda p, out: onnx_qdq_to_encodings(p["qdq"]),
        "compare_onnx": lambda p, out: compare_onnx(linear, p["float"], sample),
        "verify_onnx": lambda p, out: verify_onnx(linear, p["float"], sample),
        "compare_qdq": lambda p, out: compare_qdq(linear, p["qdq"], sample),
        "compare_layers": lambda p, out: compare_layers(None, p["qdq"], sample, optimized=True),
    }


def _loaded_header(path: str) -> onnx.ModelProto:
    """The model as encodings_to_onnx_qdq hands back one whose weights stay on disk."""
    model = onnx.load(path, load_external_data=False)
    model.metadata_props.add(key="onnxport.external_data_dir", value=os.path.dirname(path))
    return model


HOSTILE = {
    "parent": ("../outside.bin", ()),
    "absolute": (None, ()),  # the outside file's absolute path
    "through a subfolder": ("sub/../../outside.bin", ()),
    "a link that leads out": ("link.bin", ()),
    "basepath": ("outside.bin", (("basepath", None),)),
}


@pytest.mark.parametrize("reader", list(_readers()))
@pytest.mark.parametrize("how", list(HOSTILE))
def test_external_data_outside_the_model_folder_is_refused_by_every_reader(tmp_path, how, reader):
    from onnxport.errors import UnsafeExternalDataError

    secret = tmp_path / "outside.bin"
    secret.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "link.bin").symlink_to(secret)
    location, extra = HOSTILE[how]
    location = location or str(secret)
    extra = tuple((k, v or str(tmp_path)) for k, v in extra)
    paths = _hostile_models(folder, location, extra)
    out = tmp_path / "out"
    out.mkdir()
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    with pytest.raises(UnsafeExternalDataError, match="outside|absolute path|basepath"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _readers()[reader](paths, out / "m.onnx")
    assert list(out.iterdir()) == [] and {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


# -- hostile files: huge inputs are refused fast --------------------------------------------------------
def _deep(depth: int) -> list:
    value: list | float = 0.1
    for _ in range(depth):
        value = [value]
    return value


def _lpbq_stranger(i: int) -> dict:
    return {"name": f"stranger_{i}", "output_dtype": "int4", "block_size": 2, "axis": 0,
            "y_scale": {"x": [[3, 5]] * 4, "x_scale": [0.01] * 4, "axis": 0}}


HUGE = {
    "100,000 unknown names (2.1.0 LPBQ meta)": lambda: {"version": "2.1.0", "encodings": [_lpbq_stranger(i) for i in range(100_000)]},
    "100,000 unknown names (1.0.0)": lambda: {"version": "1.0.0", "param_encodings": [], "activation_encodings": [
        {"name": f"s{i}", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 8, "is_sym": False, "scale": [0.1], "offset": [0]}
        for i in range(100_000)]},
    "100,000 unknown names (0.6.1)": lambda: {"version": "0.6.1", "param_encodings": {}, "activation_encodings": {
        f"s{i}": [{"bitwidth": 8, "scale": 0.1, "offset": 0, "min": 0.0, "max": 1.0, "is_symmetric": "False", "dtype": "int"}]
        for i in range(100_000)}},
    "one name 100,000 times": lambda: {"version": "2.0.0", "encodings": [{"name": "W", "output_dtype": "int8", "y_scale": 0.1}] * 100_000},
    "2,000,000 scales, the last a string": lambda: {"version": "2.0.0", "encodings": [
        {"name": "W", "output_dtype": "int8", "axis": 1, "y_scale": [0.1] * 2_000_000 + ["0.1"]}]},
    "3,000,000 zero-points": lambda: {"version": "2.0.0", "encodings": [
        {"name": "W", "output_dtype": "int8", "axis": 1, "y_scale": [0.1] * 6, "y_zero_point": [0] * 3_000_000}]},
    "lists nested 100,000 deep": lambda: {"version": "2.0.0", "encodings": [{"name": "W", "output_dtype": "int8", "y_scale": _deep(100_000)}]},
    "an integer of 20,000 digits": lambda: {"version": "2.0.0", "encodings": [{"name": "W", "output_dtype": "int8", "y_scale": 10**20_000}]},
    "a name of 10 MB": lambda: {"version": "2.0.0", "encodings": [{"name": "W" * 10_000_000, "output_dtype": "int8", "y_scale": 0.1}]},
}
HUGE_LIMIT_S = 3


@pytest.mark.parametrize("how", list(HUGE))
def test_huge_malformed_files_are_refused_fast(how):
    import time

    data = HUGE[how]()
    start = time.perf_counter()
    with pytest.raises(InvalidArgumentError) as refusal, time_limit(2 * HUGE_LIMIT_S):
        encodings_to_onnx_qdq(MODEL, data)
    elapsed = time.perf_counter() - start
    assert elapsed < HUGE_LIMIT_S, f"refusing took {elapsed:.1f} s"
    assert len(str(refusal.value)) < 2_000, "the message repeats the input instead of naming it"
