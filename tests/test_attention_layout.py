"""The key-transposition passes on hand-built attention graphs, run by ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxport._checks import run
from onnxport.passes.attention_layout import MhaCacheLayoutPass, SwapLastAxesPass
from tests.conftest import ort_optimised_ops

FLOAT = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _info(name: str, dims: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, FLOAT, dims)


def _scores(prefix: str, key_dims: list, result_dims: list, swap: bool = True) -> tuple[list, list]:
    """torch.onnx's ``q @ k.transpose(-2, -1)`` for a key of any rank: Reshape, Transpose, Reshape, MatMul
    (the targets built at run time from the key's shape, as the exporter writes them), and intermediate
    shapes to record (``swap=False``: the second Reshape reads the transposed matrices back in the key's
    own shape, which is no transposition)."""
    nodes = [
        helper.make_node("Shape", ["k"], [f"{prefix}_ks"]),
        helper.make_node("Slice", [f"{prefix}_ks", "minus2", "big"], [f"{prefix}_sd"]),
        helper.make_node("Slice", [f"{prefix}_ks", "zero", "minus2"], [f"{prefix}_lead"]),
        helper.make_node("Slice", [f"{prefix}_ks", "minus2", "minus1"], [f"{prefix}_s"]),
        helper.make_node("Slice", [f"{prefix}_ks", "minus1", "big"], [f"{prefix}_d"]),
        helper.make_node("Concat", ["minus1", f"{prefix}_sd"], [f"{prefix}_flat_shape"], axis=0),
        helper.make_node("Reshape", ["k", f"{prefix}_flat_shape"], [f"{prefix}_flat"]),
        helper.make_node("Transpose", [f"{prefix}_flat"], [f"{prefix}_flat_t"], perm=[0, 2, 1]),
        helper.make_node("Concat", [f"{prefix}_lead", *((f"{prefix}_d", f"{prefix}_s") if swap else (f"{prefix}_s", f"{prefix}_d"))],
                         [f"{prefix}_kt_shape"], axis=0),
        helper.make_node("Reshape", [f"{prefix}_flat_t", f"{prefix}_kt_shape"], [f"{prefix}_kt"]),
        helper.make_node("MatMul", ["q", f"{prefix}_kt"], ["scores" if prefix == "main" else "same"]),
    ]
    flat = ["n", key_dims[-2], key_dims[-1]]
    infos = [_info(f"{prefix}_flat", flat), _info(f"{prefix}_flat_t", [flat[0], flat[2], flat[1]]),
             _info(f"{prefix}_kt", result_dims)]
    return nodes, infos


def _scores_model(key_dims: list, result_dims: list, *, record: bool, swap: bool = True) -> onnx.ModelProto:
    """The scores in the main graph and in both branches of an If (``record``: with the intermediate
    shapes recorded on the values; without, as onnxslim leaves a key of symbolic length)."""
    main, infos = _scores("main", key_dims, result_dims, swap)

    def branch(prefix: str) -> onnx.GraphProto:
        nodes, body_infos = _scores(prefix, key_dims, result_dims, swap)
        return helper.make_graph(nodes, prefix, [], [_info("same", ["b", 2, 1, "s"])],
                                 value_info=body_infos if record else [])

    consts = [numpy_helper.from_array(np.array([v], np.int64), n)
              for n, v in (("minus2", -2), ("minus1", -1), ("zero", 0), ("big", 1 << 62))]
    nodes = [*main, helper.make_node("If", ["flag"], ["picked"], then_branch=branch("then"), else_branch=branch("else"))]
    graph = helper.make_graph(
        nodes, "g", [_info("q", ["b", 2, 1, 8]), _info("k", key_dims),
                     helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [_info("scores", ["b", 2, 1, "s"]), _info("picked", ["b", 2, 1, "s"])], consts, value_info=infos if record else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("record", [True, False], ids=["recorded shapes", "computed targets"])
def test_torch_onnx_key_transposition_becomes_one_transpose_that_ort_folds_into_the_product(record):
    model = _scores_model(["b", 2, "s", 8], ["b", 2, 8, "s"], record=record)
    graph = ir.from_proto(model)
    assert SwapLastAxesPass()(graph).modified is True
    assert SwapLastAxesPass()(graph).modified is False  # idempotent
    swapped = ir.to_proto(graph)
    onnx.checker.check_model(swapped, full_check=True)
    bodies = [a.g for n in swapped.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    for g in (swapped.graph, *bodies):  # the main graph and both branches: one Transpose, no Reshape
        transposes = [n for n in g.node if n.op_type == "Transpose"]
        assert len(transposes) == 1 and list(transposes[0].attribute[0].ints) == [0, 1, 3, 2]
        assert transposes[0].input[0] == "k" and not any(n.op_type == "Reshape" for n in g.node)
        # nothing is left computing the targets, and no constant is left unread
        assert not any(n.op_type in ("Shape", "Slice", "Concat") for n in g.node)
    assert not swapped.graph.initializer
    for length, flag in ((5, True), (9, False)):  # the same values, byte for byte, at two lengths
        feeds = {"q": RNG.standard_normal((3, 2, 1, 8)).astype(np.float32),
                 "k": RNG.standard_normal((3, 2, length, 8)).astype(np.float32), "flag": np.array(flag)}
        got, want = run(swapped, feeds, optimized=False), run(model, feeds, optimized=False)
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    # what the pass is for: ONNX Runtime multiplies by the key transposed in place, no copy
    assert "Transpose" not in ort_optimised_ops(swapped) and "Transpose" in ort_optimised_ops(model)


def test_a_reshape_the_shapes_do_not_prove_a_swap_is_left_alone():
    # the second Reshape reads the transposed matrices back in the key's own shape: no transposition
    model = _scores_model(["b", 2, "s", 8], ["b", 2, "s", 8], record=False, swap=False)
    assert SwapLastAxesPass()(ir.from_proto(model)).modified is False
    # recorded shapes that do not give back the key's leading axes prove nothing either
    graph = ir.from_proto(_scores_model(["b", 2, "s", 8], [2, "b", 8, "s"], record=True))
    for node in ir.traversal.RecursiveGraphIterator(graph.graph):  # and no target comes from the key's shape
        if node.op_type == "Shape":
            node.replace_input_with(0, graph.graph.inputs[0])
    assert SwapLastAxesPass()(graph).modified is False


def _cross_attention(bias: bool = False) -> onnx.ModelProto:
    """MultiHeadAttention reading a (B, N, S, H) cache laid out as (B, S, N·H), as onnxscript fuses it."""
    nodes = []
    for name in ("key", "value"):
        nodes += [helper.make_node("Transpose", [f"past_{name}"], [f"{name}_t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"{name}_t", "flat_shape"], [f"{name}_flat"])]
    inputs = ["q", "key_flat", "value_flat"] + (["bias"] if bias else [])
    nodes.append(helper.make_node("MultiHeadAttention", inputs, ["out"], domain="com.microsoft", num_heads=3))
    inits = [numpy_helper.from_array(np.array([0, 0, 12], np.int64), "flat_shape")]
    if bias:
        inits.append(numpy_helper.from_array(np.zeros(36, np.float32), "bias"))
    infos = [_info(f"{n}_t", ["b", "s", 3, 4]) for n in ("key", "value")]
    infos += [_info(f"{n}_flat", ["b", "s", 12]) for n in ("key", "value")]
    graph = helper.make_graph(nodes, "g", [_info("q", ["b", 1, 12]), _info("past_key", ["b", 3, "s", 4]),
                                           _info("past_value", ["b", 3, "s", 4])],
                              [_info("out", ["b", 1, 12])], inits, value_info=infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def test_multi_head_attention_reads_a_cached_key_and_value_in_its_own_layout():
    model = _cross_attention()
    graph = ir.from_proto(model)
    assert MhaCacheLayoutPass()(graph).modified is True
    assert MhaCacheLayoutPass()(graph).modified is False
    rewired = ir.to_proto(graph)
    attention = next(n for n in rewired.graph.node if n.op_type == "MultiHeadAttention")
    assert list(attention.input[1:3]) == ["past_key", "past_value"]
    assert not any(n.op_type in ("Transpose", "Reshape") for n in rewired.graph.node)
    for length in (7, 1500):
        feeds = {"q": RNG.standard_normal((2, 1, 12)).astype(np.float32),
                 "past_key": RNG.standard_normal((2, 3, length, 4)).astype(np.float32),
                 "past_value": RNG.standard_normal((2, 3, length, 4)).astype(np.float32)}
        np.testing.assert_allclose(run(rewired, feeds, optimized=False)[0], run(model, feeds, optimized=False)[0],
                                   rtol=1e-6, atol=1e-7)
    # a projection bias is the kernel's to add to a (B, S, N·H) key only: such a node is left alone
    assert MhaCacheLayoutPass()(ir.from_proto(_cross_attention(bias=True))).modified is False
