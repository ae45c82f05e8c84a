"""A decoder's alike layers captured once and repeated (onnxport.llm.repeat): the file is the one a
capture of every layer gives, it generates what transformers generates, and layers that differ are
captured whole."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

transformers = pytest.importorskip("transformers")

from onnxport import export_decoder
from onnxport.llm import export as decoder_export
from onnxport.llm.repeat import LayerStack, layer_stack, repeat_layers

VOCAB = 128


def _llama(layers: int, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(config).eval()


def _contents(path) -> tuple[Counter, list, list, list]:
    model = onnx.load(str(path))
    weights = sorted((t.data_type, tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer)
    return (Counter(n.op_type for n in model.graph.node), weights, [str(i) for i in model.graph.input],
            [str(o) for o in model.graph.output])


@pytest.mark.slow  # two exports; the default run's repeated layers are test_llm.py's 'ort-cpu' Llama
def test_alike_layers_are_captured_once_and_the_file_is_a_whole_captures(tmp_path, monkeypatch):
    # that the repeated layers generate what transformers generates, fused for ONNX Runtime too, is
    # test_llm.py's 'ort-cpu' Llama (three layers); here the file is the whole capture's, op for op
    model = _llama(3)
    repeated = export_decoder(model, tmp_path / "repeated.onnx")
    assert repeated.repeated

    monkeypatch.setattr(decoder_export, "layer_stack", lambda *args: "every layer, for the comparison")
    whole = export_decoder(model, tmp_path / "whole.onnx")
    assert not whole.repeated
    assert _contents(repeated) == _contents(whole)


def test_layers_that_differ_are_not_repeated():
    assert "nothing to repeat" in layer_stack(_llama(2), 2)
    assert isinstance(layer_stack(_llama(3), 3), LayerStack)

    different = _llama(3)
    different.model.layers[2].self_attn.scaling = 0.5  # one layer's setting, as a sliding window would differ
    assert "layer 2 differs" in layer_stack(different, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=16))
    assert "layer_types differs" in layer_stack(gemma2, 4)


def _two_layers(second_constant: float = 2.0) -> tuple[ir.Model, dict[str, torch.Tensor]]:
    """h → per layer i: o_i = h * w_i + past_i (an output), h = Relu(o_i) * c; then Neg(h)."""
    weights = {f"stack.{i}.w": torch.full((3,), float(i + 1)) for i in range(4)}
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    pasts = [ir.Value(name=f"past.{i}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3])) for i in range(2)]
    initializers = [ir.Value(name=f"stack.{i}.w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]),
                             const_value=ir.Tensor(weights[f"stack.{i}.w"], dtype=ir.DataType.FLOAT)) for i in range(2)]
    nodes, outputs, h = [], [], x
    for i, constant in enumerate((2.0, second_constant)):
        scope = {"pkg.torch.onnx.name_scopes": repr(["", f"stack.{i}"])}
        c = ir.node("Constant", [], {"value": ir.tensor(np.array([constant], np.float32))}, metadata_props=scope)
        mul = ir.node("Mul", [h, initializers[i]], metadata_props=scope)
        add = ir.node("Add", [mul.outputs[0], pasts[i]], metadata_props=scope)
        add.outputs[0].name = f"present.{i}"
        relu = ir.node("Relu", [add.outputs[0]], metadata_props=scope)
        scaled = ir.node("Mul", [relu.outputs[0], c.outputs[0]], metadata_props=scope)
        nodes += [c, mul, add, relu, scaled]
        outputs.append(add.outputs[0])
        h = scaled.outputs[0]
    neg = ir.node("Neg", [h])
    neg.outputs[0].name = "y"
    graph = ir.Graph([x, *pasts], [neg.outputs[0], *outputs], nodes=[*nodes, neg], initializers=initializers,
                     opset_imports={"": 18})
    return ir.Model(graph, ir_version=10), weights


def _grow(model: ir.Model, weights: dict[str, torch.Tensor]) -> str | None:
    stack = LayerStack("stack", 4, None, "layers")
    return repeat_layers(model, stack, lambda i, n: [f"past.{i}"], lambda i, n: [f"present.{i}"],
                         ["x", *[f"past.{i}" for i in range(4)]], ["y", *[f"present.{i}" for i in range(4)]], weights)


def test_repeating_a_hand_built_layer_computes_every_layer():
    model, weights = _two_layers()
    assert _grow(model, weights) is None
    assert [v.name for v in model.graph.inputs] == ["x", "past.0", "past.1", "past.2", "past.3"]
    assert [v.name for v in model.graph.outputs] == ["y", "present.0", "present.1", "present.2", "present.3"]
    assert sorted(model.graph.initializers) == [f"stack.{i}.w" for i in range(4)]

    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(3).astype(np.float32) for name in ["x", *[f"past.{i}" for i in range(4)]]}
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    h, presents = feeds["x"], []
    for i in range(4):
        presents.append(h * (i + 1) + feeds[f"past.{i}"])
        h = np.maximum(presents[-1], 0) * 2
    np.testing.assert_allclose(got[0], -h, rtol=1e-6)
    for i in range(4):
        np.testing.assert_allclose(got[1 + i], presents[i], rtol=1e-6)


def test_a_second_layer_that_reads_another_constant_is_not_repeated():
    model, weights = _two_layers(second_constant=3.0)
    before = len(model.graph)
    reason = _grow(model, weights)
    assert reason is not None and "reads" in reason
    assert len(model.graph) == before and len(model.graph.inputs) == 3


class _IndexedMLP(transformers.models.llama.modeling_llama.LlamaMLP):
    """A layer whose code branches on its own index: nothing in its settings or graph of the first
    two layers tells the third one apart."""

    def forward(self, x):
        out = super().forward(x)
        return out * 3.0 if self.index >= 2 else out


@pytest.mark.slow  # 43 s on 2 cores (a template, a failed proof, then every layer), and CI is near its 30 minutes
def test_a_repeated_file_that_fails_its_proof_is_captured_whole(tmp_path):
    from onnxport.errors import PerformanceWarning

    model = _llama(3)
    for index, layer in enumerate(model.model.layers):
        layer.mlp.__class__ = _IndexedMLP
        layer.mlp.index = index
    assert isinstance(layer_stack(model, 3), LayerStack)  # alike by every check before the proof
    with pytest.warns(PerformanceWarning, match="every layer is captured instead"):
        result = export_decoder(model, tmp_path / "decoder.onnx")
    assert not result.repeated and result.agreement
