"""The dynamic scheme: ``Quantizer(activations='dynamic')`` (pt2e, activations quantized at run time)
written by export_qdq as DynamicQuantizeLinear + MatMulInteger, proven within the model's rounding
floor; its passes on hand-built graphs; the portable weight rule on integer-op weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import transformers

from onnxport import Quantizer, check_target, export_onnx, export_qdq, qdq_stats
from onnxport.errors import InvalidArgumentError
from onnxport.passes.dynamic_matmul import DynamicQuantizePass, MatMulIntegerPass
from onnxport.runtime import make_session


def _hand_built() -> ir.Model:
    """x → DynamicQuantizeLinear → QuantizeLinear(x, its scale, its zero-point) → DequantizeLinear
    → MatMul with a dequantized int8 [4, 3] weight, per column."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4]))
    dql = ir.node("DynamicQuantizeLinear", [x], num_outputs=3)
    q = ir.node("QuantizeLinear", [x, dql.outputs[1], dql.outputs[2]])
    dq = ir.node("DequantizeLinear", [q.outputs[0], dql.outputs[1], dql.outputs[2]])
    w = ir.Value(name="w", const_value=ir.tensor(np.arange(-6, 6, dtype=np.int8).reshape(4, 3)))
    s = ir.Value(name="s", const_value=ir.tensor(np.array([0.5, 0.25, 0.125], np.float32)))
    wdq = ir.node("DequantizeLinear", [w, s], {"axis": 1})
    mm = ir.node("MatMul", [dq.outputs[0], wdq.outputs[0]])
    mm.outputs[0].name, mm.outputs[0].type, mm.outputs[0].shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape([2, 3])
    graph = ir.Graph([x], [mm.outputs[0]], nodes=[dql, q, dq, wdq, mm], initializers=[w, s], opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=10)


def test_the_passes_on_a_hand_built_graph_are_honest_and_idempotent():
    model = _hand_built()
    feeds = {"x": np.array([[0.3, -1.2, 2.5, 0.0], [1.0, 0.7, -0.4, 0.9]], np.float32)}
    before = make_session(ir.serde.serialize_model(model).SerializeToString(), optimized=False).run(None, feeds)[0]
    assert DynamicQuantizePass()(model).modified
    assert not DynamicQuantizePass()(model).modified
    assert [n.op_type for n in model.graph] == ["DynamicQuantizeLinear", "DequantizeLinear", "DequantizeLinear", "MatMul"]
    assert MatMulIntegerPass()(model).modified
    assert not MatMulIntegerPass()(model).modified
    assert [n.op_type for n in model.graph] == ["DynamicQuantizeLinear", "MatMulInteger", "Cast", "Mul", "Mul"]
    assert [v.name for v in model.graph.outputs] == ["y"]
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    after = make_session(proto.SerializeToString(), optimized=False).run(None, feeds)[0]
    # the integer sum is exact: the float graph's result, within a float32 rounding of its terms
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def _trained_bert() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-layer BERT trained for a few seconds to tell whether token 7 occurs in a sequence."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    ids = torch.randint(8, 40, (256, 12))
    labels = torch.randint(0, 2, (256,))
    ids[labels == 1, torch.randint(1, 12, (int(labels.sum()),))] = 7
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(3):
        for start in range(0, 256, 32):
            loss = model(input_ids=ids[start:start + 32], labels=labels[start:start + 32]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval(), ids, labels


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def test_a_trained_transformer_without_calibration_data(tmp_path):
    bert, ids, labels = _trained_bert()
    model = _Logits(bert).eval()
    with torch.no_grad():
        assert (model(ids, torch.ones_like(ids)).argmax(-1) == labels).float().mean() > 0.9  # it learned the task
    sample = {"input_ids": ids[:4], "attention_mask": torch.ones_like(ids[:4])}
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    quantized = Quantizer(activations="dynamic").quantize(model, [sample], dynamic_axes=axes)  # one example batch
    path = export_qdq(quantized, sample, tmp_path / "bert_dynamic.onnx", dynamic_batch=True)

    onnx.checker.check_model(str(path), full_check=True)
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulInteger") == 14 and "QuantizeLinear" not in ops and "DequantizeLinear" not in ops
    assert [[d.dim_param for d in v.type.tensor_type.shape.dim] for v in graph.input] == [["batch", "sequence"]] * 2
    stats = qdq_stats(path)
    assert stats.n_integer_ops == 14 and stats.n_dynamic_quantize == 10  # q, k and v share one
    assert check_target(path, "onnxruntime") == []  # uint8 activations, int8 weights on [-64, 64]
    weights = [onnx.numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert weights and all(w.min() >= -64 and w.max() <= 64 for w in weights)

    # as deployed (ORT's fused DynamicQuantizeMatMul), at the sample's length and a longer one
    session = make_session(path, optimized=True)
    for length in (12, 9):
        feeds = {"input_ids": ids[:, :length].numpy(), "attention_mask": np.ones((256, length), np.int64)}
        got = session.run(None, feeds)[0]
        with torch.no_grad():
            expected = quantized(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"]))
        expected = expected.numpy()
        cosine = float((got * expected).sum() / np.linalg.norm(got) / np.linalg.norm(expected))
        assert cosine >= 0.9999 and np.array_equal(got.argmax(-1), expected.argmax(-1))


def test_the_portable_rule_reads_integer_op_weights(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    float_file = export_onnx(model, torch.randn(2, 16), tmp_path / "float.onnx")
    quantize_dynamic(str(float_file), str(tmp_path / "ort.onnx"), weight_type=QuantType.QInt8)
    problems = check_target(tmp_path / "ort.onnx", "onnxruntime")
    assert problems and all("MatMulInteger" in p and "beyond [-64, 64]" in p for p in problems)


@pytest.mark.parametrize("kwargs, message", [
    ({"target": "tensorrt"}, "target='tensorrt' does not run as INT8"),
    ({"backend": "torchao", "method": "int8_dynamic"}, "activations='dynamic' is a pt2e scheme"),
    ({"method": "qat"}, "activations='dynamic' is a pt2e scheme"),
    ({"skip_activations": ["0"]}, "with activations='dynamic' nothing's output is quantized"),
    ({"activations": "runtime"}, "activations must be one of"),
])
def test_dynamic_refusals_name_the_argument(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Quantizer(**{"activations": "dynamic", **kwargs})


def test_export_refuses_an_int8_activation_dtype_for_run_time_quantization(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    quantized = Quantizer(activations="dynamic").quantize(model, [torch.randn(2, 8)])
    with pytest.raises(InvalidArgumentError, match="DynamicQuantizeLinear does in uint8 only"):
        export_qdq(quantized, torch.randn(2, 8), tmp_path / "m.onnx", activation_dtype="int8")
    assert not (tmp_path / "m.onnx").exists()
