"""encodings_to_onnx_qdq on models whose weights stay on disk: large encodings files read entry by
entry, prequantized weights quantized a slice at a time and kept in scratch until ``save_model``
streams them, and a failing write that leaves nothing behind. (The 28 GB run is in
``bench/encodings.py``; these use the same code paths at test size.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxport import encodings_to_onnx_qdq, save_model
from onnxport.encodings import convert, formats, reading
from onnxport.encodings.formats import Encoding
from onnxport.errors import InvalidArgumentError
from tests.conftest import listing
from tests.test_encodings_fuzz import MODEL, valid_v061, valid_v2, valid_v100

RNG = np.random.default_rng(11)
W1 = RNG.standard_normal((64, 32)).astype(np.float32)
W2 = RNG.standard_normal((32, 16)).astype(np.float32)
X = RNG.standard_normal((2, 64)).astype(np.float32)


def on_disk(folder) -> str:
    """x (2, 64) → MatMul(W1) → Relu → MatMul(W2) → y, every weight in external data."""
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 16])],
                              [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")])
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path),
                    save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return str(path)


ENCODINGS = {"version": "2.0.0", "encodings": [
    {"name": "W1", "output_dtype": "int4", "axis": 0, "block_size": 16,
     "y_scale": (np.abs(W1.reshape(4, 16, 32)).max(axis=1) / 7).astype(np.float32).tolist()},
    {"name": "W2", "output_dtype": "int8", "axis": 1, "y_scale": (np.abs(W2).max(axis=0) / 127).astype(np.float32).tolist()},
    {"name": "r", "output_dtype": "uint8", "y_scale": 0.02},
]}


def run(path_or_model) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = path_or_model if isinstance(path_or_model, str) else path_or_model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


# -- large entries are held as outlines and read again when written ----------------------------------------
def _conversions(monkeypatch, model, encodings, **kwargs) -> tuple[onnx.ModelProto, onnx.ModelProto, list[str]]:
    """The conversion with every entry's values held, and with every multi-scale entry outlined
    (its values set aside in a file and read back when written); the names read back, in order."""
    monkeypatch.setattr(convert, "_OUTLINE_BYTES", 2**62)
    held = encodings_to_onnx_qdq(model, encodings, **kwargs)
    again: list[str] = []
    values = convert._SetAside.values

    def counted(self, outline):
        again.append(outline.name)
        return values(self, outline)

    monkeypatch.setattr(convert._SetAside, "values", counted)
    monkeypatch.setattr(convert, "_OUTLINE_BYTES", -1)
    outlined = encodings_to_onnx_qdq(model, encodings, **kwargs)
    return held, outlined, again


def _canonical(model: onnx.ModelProto) -> tuple:
    """A model's nodes and initializers whatever their order (outlines write a moved weight right
    after its source, instead of after every other entry)."""
    nodes = sorted(n.SerializeToString() for n in model.graph.node)
    inits = sorted((t.name, numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer)
    return nodes, inits, [o.SerializeToString() for o in model.graph.output]


@pytest.mark.parametrize("prequantize", [False, True])
def test_outlined_entries_convert_exactly_like_held_ones_moved_weights_too(monkeypatch, prequantize):
    """A 7B model's int4 grids are set aside as they are read and read back one at a time; the
    file is the same, including weights moved through a Transpose chain (blocks re-laid)."""
    w = RNG.standard_normal((64, 32)).astype(np.float32)  # read through two Transposes: moved twice
    v = RNG.standard_normal((32, 16)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("Transpose", ["Wt"], ["Wtt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Wtt"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["rr"]),
             helper.make_node("MatMul", ["rr", "V"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 16])],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V"),
                               numpy_helper.from_array(np.array([2, 32], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    blocks = np.abs(w.reshape(4, 16, 32)).max(axis=1)  # block 16 along axis 0 (in)
    encodings = {"version": "2.0.0", "encodings": [
        {"name": "W", "output_dtype": "int4", "axis": 0, "block_size": 16,
         "y_scale": (blocks / 7).astype(np.float32).tolist()},
        {"name": "V", "output_dtype": "int4", "axis": 0, "block_size": 16,
         "per_block_int_scale": np.clip(np.ceil(np.abs(v.reshape(2, 16, 16)).max(axis=1) / 7 / 0.01), 1, 16).astype(int).tolist(),
         "per_channel_float_scale": [[0.01] * 16]},
        {"name": "x", "output_dtype": "uint8", "y_scale": 0.03, "y_zero_point": 128},
        {"name": "r", "output_dtype": "uint8", "y_scale": 0.05},
    ]}
    held, outlined, again = _conversions(monkeypatch, model, encodings, prequantize_constants=prequantize)
    assert again == ["W", "V"]  # only the multi-scale entries, in the file's order
    assert _canonical(outlined) == _canonical(held)
    quantized = {n.input[0] for n in outlined.graph.node if n.op_type == "QuantizeLinear"}
    assert {"Wt", "Wtt"} <= quantized  # each moved weight took W's blocks, re-laid
    x = RNG.standard_normal((2, 64)).astype(np.float32)

    def out(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    np.testing.assert_array_equal(out(outlined), out(held))


@pytest.mark.parametrize("strategy", [valid_v2("2.0.0"), valid_v2("2.1.0"), valid_v100(), valid_v061()],
                         ids=["2.0.0", "2.1.0", "1.0.0", "0.6.1"])
def test_outlined_entries_convert_exactly_like_held_ones_in_every_version(strategy, monkeypatch):
    @settings(max_examples=10, deadline=None, derandomize=True, database=None)
    @given(strategy)
    def check(data):
        held, outlined, _ = _conversions(monkeypatch, MODEL, data)
        assert _canonical(outlined) == _canonical(held)

    check()


def test_the_insert_pass_refuses_an_outline_it_has_no_values_for():
    """An outline's arrays are stand-ins (zeros): written as they are, they would be a wrong file."""
    import collections

    import onnx_ir as ir

    from onnxport.encodings.formats import parse_encodings

    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W1"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 32])], [numpy_helper.from_array(W1, "W1")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    entry = parse_encodings({"version": "2.0.0", "encodings": ENCODINGS["encodings"][:1]}).entries[0]
    outline = convert._outline(entry)
    assert outline.outlined and outline.scale.shape == entry.scale.shape and outline.scale.strides == (0, 0)
    with pytest.raises(ValueError, match="'W1' is an outline"):
        convert.InsertEncodingsPass(collections.deque([outline]), prequantize=False, scratch=None)(model)


# -- large encodings files are read one entry at a time ------------------------------------------------
@pytest.mark.parametrize("strategy", [valid_v2("2.0.0"), valid_v2("2.1.0"), valid_v100(), valid_v061()],
                         ids=["2.0.0", "2.1.0", "1.0.0", "0.6.1"])
def test_a_streamed_encodings_file_converts_exactly_like_a_loaded_one(strategy, tmp_path, monkeypatch):
    @settings(max_examples=15, deadline=None, derandomize=True, database=None)
    @given(strategy)
    def check(data):
        path = tmp_path / "m.encodings"
        path.write_text(json.dumps(data))
        loaded = encodings_to_onnx_qdq(MODEL, str(path))
        monkeypatch.setattr(reading, "STREAM_ABOVE_BYTES", 0)
        assert isinstance(formats.load_encodings(str(path)), formats.StreamedEncodings)
        streamed = encodings_to_onnx_qdq(MODEL, str(path))
        monkeypatch.setattr(reading, "STREAM_ABOVE_BYTES", 64 * 2**20)
        assert streamed.SerializeToString() == loaded.SerializeToString()

    check()


@pytest.mark.parametrize("text, message", [
    ('{"version": "2.0.0", "encodings": [{"name": "x", ', "not valid JSON"),
    ('{"version": "2.0.0", "encodings": {"x": 1}}', "needs an 'encodings' list, not dict"),
    ('{"version": "2.0.0"}', "needs an 'encodings' list, not NoneType"),
    ('{"version": "1.0.0", "param_encodings": {"x": []}}', "'param_encodings' of a 1.0.0 encodings file must be a list"),
    ('{"version": "2.0.0", "encodings": [{"name": "x", "output_dtype": "uint8", "y_scale": "0.1"}]}', "'x'.*string"),
])
def test_a_streamed_file_refuses_what_a_loaded_one_refuses(text, message, tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "STREAM_ABOVE_BYTES", 0)
    path = tmp_path / "bad.encodings"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=message):
        encodings_to_onnx_qdq(MODEL, str(path))


# -- prequantization a slice at a time, kept on disk ----------------------------------------------------
@pytest.mark.parametrize("entry", [
    Encoding("w", "int8", np.float32(0.05), np.int64(3)),
    Encoding("w", "int8", np.linspace(0.01, 0.05, 12, dtype=np.float32), None, axis=0),
    Encoding("w", "uint8", np.linspace(0.01, 0.05, 10, dtype=np.float32), np.arange(10) * 20, axis=1),
    Encoding("w", "int4", np.full((3, 10), 0.3, np.float32), None, axis=0, block_size=4),
    Encoding("w", "uint4", np.full((12, 5), 0.3, np.float32), np.full((12, 5), 8), axis=1, block_size=2),
    Encoding("w", "float8e4m3fn", np.float32(0.001)),
])
def test_quantizing_in_slices_gives_the_integers_of_quantize_linear(entry, monkeypatch):
    w = RNG.standard_normal((12, 10)).astype(np.float32)
    monkeypatch.setattr(convert, "_CHUNK_ELEMENTS", 7)  # many slices, none aligned with a block
    sliced = convert.quantize_array(w, entry, entry.scale)
    node = helper.make_node("QuantizeLinear", ["w", "s", "z"], ["q"], **({"axis": entry.axis} if entry.axis is not None else {}),
                            **({"block_size": entry.block_size} if entry.block_size else {}))
    ty = convert.NUMPY_TYPES[entry.dtype]
    z = np.zeros(np.shape(entry.scale), ty) if entry.zero_point is None else np.asarray(entry.zero_point).astype(ty)
    q_type = formats.DTYPES[entry.dtype].onnx_type
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("w", T.FLOAT, w.shape)],
                              [helper.make_tensor_value_info("q", q_type, w.shape)],
                              [numpy_helper.from_array(np.asarray(entry.scale, np.float32), "s"), numpy_helper.from_array(z, "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    from onnx.reference import ReferenceEvaluator

    expected = ReferenceEvaluator(model).run(None, {"w": w})[0]
    assert np.array_equal(sliced.astype(np.float32), np.asarray(expected).astype(np.float32))
    monkeypatch.setattr(convert, "_CHUNK_ELEMENTS", 1 << 22)  # one slice: the same integers
    assert np.array_equal(sliced.astype(np.float32), convert.quantize_array(w, entry, entry.scale).astype(np.float32))


def test_prequantized_weights_of_an_on_disk_model_stay_on_disk_until_saved(tmp_path):
    source = on_disk(tmp_path)
    q = encodings_to_onnx_qdq(source, ENCODINGS, prequantize_constants=True)
    stored = {t.name: t for t in q.graph.initializer}
    for name in ("W1_q", "W2_q"):
        assert stored[name].data_location == T.EXTERNAL and not stored[name].raw_data  # in scratch, not in memory
    assert "W1" not in stored and "W2" not in stored
    (tmp_path / "out").mkdir()
    out = save_model(q, tmp_path / "out" / "q.onnx")
    assert sorted(listing(tmp_path / "out")) == ["q.onnx", "q.onnx.data"]
    written = onnx.load_model(str(out))  # self-contained: nothing refers to the scratch folder
    assert all(e.key != "basepath" for t in written.graph.initializer for e in t.external_data)
    loaded = onnx.load_model(source)
    in_memory = encodings_to_onnx_qdq(loaded, ENCODINGS, prequantize_constants=True)
    by_name = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    for t in in_memory.graph.initializer:
        assert np.array_equal(by_name[t.name].astype(np.float64), numpy_helper.to_array(t).astype(np.float64)), t.name
    live = encodings_to_onnx_qdq(loaded, ENCODINGS)  # Q/DQ pairs: ORT quantizes the weights itself
    np.testing.assert_array_equal(run(str(out)), run(live))


def test_truncated_or_missing_external_data_is_a_named_error_before_any_work(tmp_path):
    source = on_disk(tmp_path)
    data = tmp_path / "model.onnx.data"
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(InvalidArgumentError, match=r"Tensor 'W2' lives at bytes .* holds only"):
        encodings_to_onnx_qdq(source, ENCODINGS)
    data.unlink()
    with pytest.raises(InvalidArgumentError, match=r"Tensor 'W1' lives in external data file .* does not exist"):
        encodings_to_onnx_qdq(source, ENCODINGS)
    data.write_bytes(whole)
    q = encodings_to_onnx_qdq(source, ENCODINGS)  # converted; its weights still on disk
    previous = tmp_path / "out.onnx"
    previous.write_bytes(b"a previous good file")
    data.write_bytes(whole[:100])  # the source shrinks before the save
    before = listing(tmp_path)
    with pytest.raises(InvalidArgumentError, match="'W1'.*holds only 100 bytes"):
        save_model(q, previous)
    assert listing(tmp_path) == before


def test_a_write_that_fails_part_way_leaves_the_previous_output_untouched(tmp_path):
    """A real failing write: the file-size limit of the writing process is set below the weights."""
    source = on_disk(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "q.onnx").write_bytes(b"previous output")
    before = listing(out)
    script = textwrap.dedent(f"""
        import json, resource, signal
        from onnxport import encodings_to_onnx_qdq, save_model
        from onnxport.errors import WriteError
        q = encodings_to_onnx_qdq({source!r}, json.loads({json.dumps(ENCODINGS)!r}))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
        try:
            save_model(q, {str(out / 'q.onnx')!r}, external_data=True)
        except WriteError as error:
            print("refused:", error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "refused: Writing" in result.stdout and "previous file is untouched" in result.stdout
    assert listing(out) == before


def test_scratch_tensors_read_back_and_convert_back(tmp_path):
    """A converted on-disk model answers onnx_qdq_to_encodings while its tensors are in scratch."""
    from onnxport import onnx_qdq_to_encodings

    q = encodings_to_onnx_qdq(on_disk(tmp_path), ENCODINGS)
    back = {e["name"]: e for e in onnx_qdq_to_encodings(q)["encodings"]}
    assert back["W1"]["y_scale"] == ENCODINGS["encodings"][0]["y_scale"]
    assert back["W2"]["y_scale"] == ENCODINGS["encodings"][1]["y_scale"]


def test_ml_dtypes_int4_is_what_the_scratch_packs():
    tensor = numpy_helper.from_array(np.array([-8, 7, 1], ml_dtypes.int4), "t")
    assert tensor.data_type == T.INT4 and len(tensor.raw_data) == 2
