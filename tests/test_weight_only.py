"""Weight-only INT4/INT8 (torchao) exported as blocked DequantizeLinear at opset 21.

The models are Hugging Face ``transformers`` Llama models built from small configs (public
model code, random weights, nothing downloaded), quantized by the real torchao, exported by the
real torch.onnx, checked by the real onnx checker and run by the real ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import transformers  # a test dependency: missing, the suite must fail, not skip
from torch import nn

from onnxport import (
    Quantizer,
    compare_qdq,
    encodings_to_onnx_qdq,
    export_qdq,
    onnx_qdq_to_encodings,
    qdq_report,
    qdq_stats,
    quant_spec,
    strip_qdq,
)
from onnxport._checks import run
from onnxport.errors import ExportRefusedError, InvalidArgumentError, PerformanceWarning
from onnxport.exporters.weight_only import check_weights_faithful, file_weights, quantized_weights

IDS = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))


def _llama(tie: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False, tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _linears(model: nn.Module) -> int:
    return sum(type(m) is nn.Linear for m in model.modules())


def _logits(model: nn.Module, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(ids).logits.numpy()


@pytest.mark.parametrize(
    "method, kwargs, bits, blocked",
    [
        ("int4_weight_only", {"group_size": 32}, 4, True),
        ("int4_weight_only", {"group_size": 64, "symmetric": False}, 4, True),
        ("int4_weight_only", {"qscheme": "per_channel"}, 4, False),
        ("int8_weight_only", {}, 8, False),
        ("int8_weight_only", {"qscheme": "per_group", "group_size": 32}, 8, True),
    ],
)
def test_weight_only_file_is_torchaos_weights_and_runs_as_matmulnbits(llama, tmp_path, method, kwargs, bits, blocked):
    q = Quantizer(backend="torchao", method=method, **kwargs).quantize(llama)
    path = export_qdq(q, IDS, tmp_path / "w.onnx")
    onnx.checker.check_model(str(path), full_check=True)
    header = onnx.load(str(path))
    assert [o.version for o in header.opset_import if o.domain == ""] == [21]
    n = _linears(llama)
    stats = qdq_stats(path)
    assert (stats.n_quantize, stats.n_dequantize) == (0, n)
    # A group as wide as the layer is one scale per channel, written per-axis.
    group = kwargs.get("group_size", 128)
    n_blocked = sum(type(m) is nn.Linear and m.in_features > group for m in llama.modules()) if blocked else 0
    assert n_blocked > 0 or not blocked
    assert stats.n_int4 == (n if bits == 4 else 0) and stats.n_blocked == n_blocked
    assert stats.n_nonzero_zero_point == (n if kwargs.get("symmetric") is False else 0)
    # No float copy of a quantized weight is left in the file.
    scales = {n.input[1] for n in header.graph.node if n.op_type == "DequantizeLinear"}
    float_bytes = sum(t.ByteSize() for t in header.graph.initializer
                      if t.data_type == onnx.TensorProto.FLOAT and t.name not in scales)
    embedding = llama.model.embed_tokens.weight.numel() * 4
    assert float_bytes < embedding * 1.1

    # Independently of the export's own check: the integers in the file are torchao's, transposed.
    found = file_weights(path)
    for name, module in q.named_modules():
        if type(module) is nn.Linear:
            entry = found[f"{name}.weight"]
            assert np.array_equal(entry["q"], module.weight.qdata.numpy().T)
            assert entry["readers"] == ["MatMul"]
    report = qdq_report(path)
    assert report.extra["ort_matmul_nbits"] == n
    assert "MatMulNBits" in str(report)

    # Unoptimised, the file computes what the torchao model computes, up to float rounding.
    got = run(path, {"input": IDS.numpy()}, optimized=False)[0]
    want = _logits(q, IDS)
    assert np.max(np.abs(got - want)) < 1e-5
    comparison = compare_qdq(q, path, IDS)
    assert comparison.outputs[0].cosine_similarity >= 0.9999 and comparison.outputs[0].top1_agreement == 1.0
    assert quant_spec(q).weight_only and quant_spec(q).weight_bits == bits


def test_tied_embeddings_need_both_readers_quantized(tmp_path):
    tied = _llama(tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(InvalidArgumentError, match="shared with 'model.embed_tokens'.*quantize_embeddings=True"):
        Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(tied)
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32, quantize_embeddings=True).quantize(tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and type(tied.lm_head.weight) is nn.Parameter
    path = export_qdq(q, IDS, tmp_path / "tied.onnx")
    found = file_weights(path)
    embedding = found["model.embed_tokens.weight"]
    assert embedding["readers"] == ["Gather"] and (embedding["axis"], embedding["block_size"]) == (1, 32)
    # The embedding (tokens x width, blocks along the width) and lm_head (width x tokens,
    # blocks down axis 0) are the same integers in the two layouts their readers need.
    assert np.array_equal(embedding["q"], found["lm_head.weight"]["q"].T)
    assert qdq_report(path).extra["ort_matmul_nbits"] == _linears(tied)
    got = run(path, {"input": IDS.numpy()}, optimized=False)[0]
    assert np.max(np.abs(got - _logits(q, IDS))) < 1e-5


def test_original_model_is_untouched_and_not_copied(llama):
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(llama)
    assert all(torch.equal(before[k], v) for k, v in llama.state_dict().items())
    assert all(type(p) is nn.Parameter for p in llama.parameters())
    # Float tensors the recipe leaves alone are shared with the original, not copied.
    assert q.model.norm.weight is llama.model.norm.weight
    assert len(quantized_weights(q)) == _linears(llama)


def test_dynamic_batch_and_a_plain_module(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16)).eval()
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=16).quantize(model)
    path = export_qdq(q, torch.randn(2, 64), tmp_path / "mlp.onnx", dynamic_batch=True)
    x = torch.randn(5, 64)
    got = run(path, {"input": x.numpy()}, optimized=False)[0]
    with torch.no_grad():
        assert np.max(np.abs(got - q(x).numpy())) < 1e-5
    assert qdq_report(path).extra["ort_matmul_nbits"] == 2


def test_encodings_round_trip_of_an_int4_file(llama, tmp_path):
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32, symmetric=False).quantize(llama)
    path = export_qdq(q, IDS, tmp_path / "w.onnx")
    encodings = onnx_qdq_to_encodings(path)
    assert encodings["version"] == "2.0.0"
    entry = encodings["encodings"][0]
    assert entry["output_dtype"] == "int4" and entry["block_size"] == 32 and "y_zero_point" in entry
    back = encodings_to_onnx_qdq(strip_qdq(onnx.load(str(path))), encodings, prequantize_constants=True,
                                 force_activation_as=None)
    onnx.save(back, str(tmp_path / "back.onnx"))
    assert onnx_qdq_to_encodings(tmp_path / "back.onnx") == encodings
    a, b = file_weights(path), file_weights(tmp_path / "back.onnx")
    assert len(a) == len(b) == _linears(llama)
    for x, y in zip(a.values(), b.values()):
        assert np.array_equal(x["q"], y["q"]) and x["scale"].tobytes() == y["scale"].tobytes()
        assert np.array_equal(x["zp"], y["zp"]) and (x["axis"], x["block_size"]) == (y["axis"], y["block_size"])


def test_the_faithfulness_check_catches_a_changed_integer(tmp_path):
    torch.manual_seed(0)
    q = Quantizer(backend="torchao", method="int8_weight_only").quantize(nn.Sequential(nn.Linear(32, 16)).eval())
    path = export_qdq(q, torch.randn(1, 32), tmp_path / "w.onnx")
    weights = quantized_weights(q)
    check_weights_faithful(path, weights)
    model = onnx.load(str(path))
    tensor = next(t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8)
    values = onnx.numpy_helper.to_array(tensor).copy()
    values.flat[3] = values.flat[3] + 1 if values.flat[3] < 127 else 0
    tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save(model, str(tmp_path / "changed.onnx"))
    with pytest.raises(ExportRefusedError, match="'0'.*integers differ from torchao's"):
        check_weights_faithful(tmp_path / "changed.onnx", weights)


def test_a_block_onnx_runtime_cannot_fuse_is_said(tmp_path):
    torch.manual_seed(0)
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=8).quantize(nn.Sequential(nn.Linear(32, 16)))
    with pytest.warns(PerformanceWarning, match="block of 8 elements.*power of two from 16"):
        path = export_qdq(q, torch.randn(1, 32), tmp_path / "w.onnx")
    assert qdq_report(path).extra["ort_matmul_nbits"] == 0


# -- bad input: a clear error before anything is written -------------------------------------------
def test_group_size_that_does_not_divide_is_refused():
    with pytest.raises(InvalidArgumentError, match="group_size=48 does not divide the input features of '0' \\(64\\)"):
        Quantizer(backend="torchao", method="int4_weight_only", group_size=48).quantize(nn.Sequential(nn.Linear(64, 8)))


@pytest.mark.parametrize("kwargs, message", [
    ({"opset_version": 18}, "from opset 21.*opset 18 has no such form.*opset_version=21"),
    ({"activation_dtype": "uint8"}, "quantizes weights only.*Drop activation_dtype"),
])
def test_weight_only_export_refusals(guarded, kwargs, message):
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(nn.Sequential(nn.Linear(64, 8)))
    with pytest.raises(InvalidArgumentError, match=message):
        export_qdq(q, torch.randn(1, 64), guarded, **kwargs)


def test_weight_only_construction_errors():
    with pytest.raises(InvalidArgumentError, match="quantize_embeddings=True is for the torchao weight-only"):
        Quantizer(quantize_embeddings=True)
    with pytest.raises(ValueError, match="qscheme must be one of 'per_group', 'per_channel'"):
        Quantizer(backend="torchao", method="int4_weight_only", qscheme="per_tensor")
    with pytest.raises(InvalidArgumentError, match="no nn.Linear"):
        Quantizer(backend="torchao", method="int8_weight_only").quantize(nn.Sequential(nn.ReLU()))

    class ScaledLinear(nn.Linear):  # a subclass may compute otherwise with its weight (timm's heads are one)
        def forward(self, x):
            return nn.functional.linear(x, 2 * self.weight, self.bias)

    with pytest.raises(InvalidArgumentError, match=r"subclasses of them are left float.*'1' \(.*ScaledLinear\)"):
        Quantizer(backend="torchao", method="int8_weight_only").quantize(nn.Sequential(nn.ReLU(), ScaledLinear(4, 2)))



def test_external_data_path_writes_a_complete_checked_pair(tmp_path, monkeypatch):
    """The >2 GB path (weights in <name>.data), exercised on a small model by lowering the limit."""
    from onnxport._core import io as _io

    monkeypatch.setattr(_io, "EXTERNAL_DATA_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(model)
    path = export_qdq(q, torch.randn(1, 64), tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    header = onnx.load(str(path), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in header.graph.initializer)
    check_weights_faithful(path, quantized_weights(q))
    x = torch.randn(1, 64)
    got = run(path, {"input": x.numpy()}, optimized=False)[0]
    with torch.no_grad():
        assert np.max(np.abs(got - q(x).numpy())) < 1e-5
    assert qdq_report(path).extra["ort_matmul_nbits"] == 2


def test_a_2d_linear_with_relu_loses_the_fusion_and_is_said(tmp_path):
    """ONNX Runtime turns a 2-D MatMul+Add+Relu into FusedGemm before its DequantizeLinear fusion
    runs: that layer stays dequantize + FusedGemm, and the export says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(model)
    with pytest.warns(PerformanceWarning, match="fused 1 of the 2 quantized MatMuls"):
        path = export_qdq(q, torch.randn(1, 64), tmp_path / "w.onnx")
    assert qdq_report(path).extra["ort_matmul_nbits"] == 1


def _torchao_direct(config) -> nn.Module:
    """A Linear quantized by torchao itself, not through Quantizer (so it carries no QuantSpec)."""
    from torchao.quantization import quantize_

    model = nn.Sequential(nn.Linear(32, 8))
    quantize_(model, config)
    return model


def _int8_tensor_layout():
    from torchao.quantization import Int8WeightOnlyConfig

    return export_qdq(_torchao_direct(Int8WeightOnlyConfig()), torch.randn(1, 32), "out.onnx")


def _int2_weights():
    from torchao.quantization import IntxWeightOnlyConfig

    return export_qdq(_torchao_direct(IntxWeightOnlyConfig(weight_dtype=torch.int2)), torch.randn(1, 32), "out.onnx")


def _bf16_scales():
    q = Quantizer(backend="torchao", method="int8_weight_only").quantize(nn.Sequential(nn.Linear(32, 8)).to(torch.bfloat16))
    return export_qdq(q, torch.randn(1, 32, dtype=torch.bfloat16), "out.onnx")


def _embedding_with_max_norm():
    model = nn.Sequential(nn.Embedding(32, 16, max_norm=1.0), nn.Linear(16, 8))
    return Quantizer(backend="torchao", method="int4_weight_only", group_size=16, quantize_embeddings=True).quantize(model)


@pytest.mark.parametrize("make, message", [
    (_embedding_with_max_norm, "max_norm=1.0"),
    (_int8_tensor_layout, "holds a Int8Tensor weight"),
    (_int2_weights, "stores torch.int2 weights"),
    (_bf16_scales, "torch.bfloat16 scales"),
])
def test_weights_with_no_faithful_form_are_refused_by_name(tmp_path, monkeypatch, make, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=message):
        make()
    assert list(tmp_path.iterdir()) == []


class _KeywordLinears(torch.nn.Module):
    """Called with keyword inputs, as Hugging Face models are; the second input is optional."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    def forward(self, x, scale=None):
        y = self.b(torch.relu(self.a(x)))
        return y if scale is None else y * scale


def test_a_weight_only_model_called_with_keyword_inputs_stores_every_weight(tmp_path):
    # the stand-in copy must take the keyword inputs itself: a forward replaced on the model for
    # them, copied along, would call the model whose torchao weights the stand-ins replace
    torch.manual_seed(0)
    quantized = Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(_KeywordLinears().eval())
    path = export_qdq(quantized, {"x": torch.randn(2, 64)}, tmp_path / "kw.onnx")
    graph = onnx.load(str(path)).graph
    assert [v.name for v in graph.input] == ["x"]
    assert sum(n.op_type == "DequantizeLinear" for n in graph.node) == 2


class _SameShapedLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_small_same_shaped_weights_keep_one_dequantizer_each(tmp_path):
    # the exporter's optimizer merges equal initializers up to 1024 elements: stand-ins left empty
    # often share zeroed pages, and merged, one layer's DequantizeLinear went missing
    from onnxport.exporters.weight_only import export_copy

    torch.manual_seed(0)
    quantized = Quantizer(backend="torchao", method="int8_weight_only").quantize(_SameShapedLinears().eval())
    weights = quantized_weights(quantized)
    stand_ins = [layer.weight_t for layer in export_copy(quantized, weights).layers]
    assert all(not torch.equal(a, b) for i, a in enumerate(stand_ins) for b in stand_ins[i + 1:])
    for attempt in range(2):  # a second export in one process is where it showed
        path = export_qdq(quantized, torch.randn(2, 16), tmp_path / f"same{attempt}.onnx")
        assert sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(path)).graph.node) == 4


@pytest.mark.parametrize("method", ["int4_weight_only", "int8_weight_only"])
def test_dequantizing_once_computes_torchaos_numbers_and_gives_its_weights_back(llama, method):
    # the decoder's proof decodes with torchao's model; its weights dequantized once for that
    # (not at every step), the logits must be torchao's to the bit, and the model left as it was
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from onnxport.quantize.weight_only import dequantized_once, quantize_weight_only

    q = quantize_weight_only(llama, method, group_size=32, symmetric=True, embeddings=False)
    weights = {name: p for name, p in q.named_parameters() if isinstance(p.data, IntxUnpackedToInt8Tensor)}
    assert len(weights) == _linears(llama)
    expected = _logits(q, IDS)
    with dequantized_once(q) as same:
        assert same is q and not any(isinstance(p.data, IntxUnpackedToInt8Tensor) for p in q.parameters())
        np.testing.assert_array_equal(_logits(q, IDS), expected)
    assert all(dict(q.named_parameters())[name] is p for name, p in weights.items())
    np.testing.assert_array_equal(_logits(q, IDS), expected)
