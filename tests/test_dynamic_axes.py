"""Symbolic axes beyond the batch: ``dynamic_axes`` on ``export_onnx``, ``Quantizer.quantize`` and
``export_qdq`` (pt2e and weight-only), each file run at lengths other than the traced one.

Models are real: transformers code from the zoo (random weights, small configs), the test suite's
CNN, and a hand-written model whose code fixes its sequence length.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from onnxport import Quantizer, compare_onnx, compare_qdq, export_onnx, export_qdq
from onnxport._checks import run
from onnxport._core.axes import resolve_axes, second_size
from onnxport.errors import InvalidArgumentError
from onnxport.inspection.stats import ort_optimised_ops
from tests.conftest import activation_products
from tests.zoo import VOCAB, zoo

SEQ = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}


def _dims(path) -> dict[str, list]:
    header = onnx.load(str(path), load_external_data=False)
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in header.graph.input}


def _tokens(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def bert():
    return next(z for z in zoo() if z.name == "BERT").model()


# -- the argument ---------------------------------------------------------------------------
def _resolve(spec, dynamic_batch=False, aliases=None):
    inputs = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    return resolve_axes(spec, dynamic_batch=dynamic_batch, names=["input_ids", "attention_mask"], inputs=inputs,
                        aliases=aliases)


def test_dynamic_axes_forms():
    assert _resolve({"input_ids": [0, 1], "attention_mask": [1]}) == {
        "input_ids": {0: "batch", 1: "axis_1"}, "attention_mask": {1: "axis_1"}}
    assert _resolve({"input_ids": {-1: "sequence"}}, dynamic_batch=True) == {
        "input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch"}}
    assert _resolve({"ids": {1: "sequence"}}, aliases={"ids": "input_ids"}) == {"input_ids": {1: "sequence"}}
    assert _resolve(None) == {}


@pytest.mark.parametrize("spec, message", [
    ({"token_ids": {1: "sequence"}}, "names the input 'token_ids', which the model does not have; its inputs are 'input_ids', 'attention_mask'"),
    ({"input_ids": {2: "sequence"}}, "names axis 2, but 'input_ids' has 2 dimension(s)"),
    ({"input_ids": {1: "a sequence"}}, "an axis name must be an identifier"),
    ({"input_ids": {"1": "sequence"}}, "axes are integers"),
    ("sequence", "must be a dict from input name"),
])
def test_bad_dynamic_axes_are_named(spec, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _resolve(spec)


def test_a_shared_name_needs_one_size():
    inputs = (torch.zeros(2, 16), torch.zeros(2, 8))
    with pytest.raises(InvalidArgumentError, match="same name 'sequence'.*sizes differ \\(8 and 16\\)"):
        resolve_axes({"a": {1: "sequence"}, "b": {1: "sequence"}}, dynamic_batch=False, names=["a", "b"], inputs=inputs)


def test_second_size_grows_every_symbolic_axis_once():
    feeds = {"input_ids": np.arange(6).reshape(2, 3), "other": np.zeros((2, 4))}
    grown = second_size(feeds, {"input_ids": {0: "batch", 1: "sequence"}})
    assert grown["input_ids"].shape == (3, 4) and grown["other"].shape == (2, 4)
    assert grown["input_ids"][2, :3].tolist() == [0, 1, 2] and grown["input_ids"][:, 3].tolist() == [2, 5, 2]


# -- a model that fixes its length -----------------------------------------------------------
class FixedLength(nn.Module):
    """Builds its mask with a Python int taken from the input's shape: the length is a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("causal", torch.triu(torch.ones(16, 16), 1))

    def forward(self, x):
        n = int(x.shape[1])  # the specialising line
        return self.linear(x) + self.causal[:n, :n].sum(-1, keepdim=True)


_LINE = FixedLength.forward.__code__.co_firstlineno + 1


@pytest.mark.parametrize("flow", ["export_onnx", "quantize", "qat"])
def test_an_axis_the_model_fixes_is_refused_with_its_line(tmp_path, flow):
    x = torch.randn(2, 16, 8)
    axes = {"x": {1: "sequence"}}  # by forward's parameter name
    with pytest.raises(InvalidArgumentError) as info:
        if flow == "export_onnx":
            export_onnx(FixedLength(), x, tmp_path / "m.onnx", dynamic_axes=axes)
        elif flow == "quantize":
            Quantizer().quantize(FixedLength(), [x], dynamic_axes=axes)
        else:
            Quantizer(method="qat").prepare(FixedLength(), x, dynamic_axes=axes)
    text = str(info.value)
    assert "'input' axis 1 ('sequence') to 16" in text and f"test_dynamic_axes.py:{_LINE}, in forward" in text
    assert list(tmp_path.iterdir()) == []


def test_export_qdq_refuses_an_axis_the_capture_fixed(tmp_path, bert):
    q = Quantizer(target="onnxruntime").quantize(bert, [_tokens(2, 16)])
    with pytest.raises(InvalidArgumentError, match="'input_ids' axis 1 \\('sequence'\\) symbolic, but the model was captured"):
        export_qdq(q, _tokens(2, 16), tmp_path / "q.onnx", dynamic_axes=SEQ)
    assert list(tmp_path.iterdir()) == []


# -- text: float, pt2e, weight-only -------------------------------------------------------------
def _with_segments(tokens: dict) -> dict:
    segments = torch.zeros_like(tokens["input_ids"])
    segments[:, tokens["input_ids"].shape[1] // 2:] = 1
    return {**tokens, "token_type_ids": segments}


def test_bert_float_file_runs_at_any_length(tmp_path, bert):
    axes = {**SEQ, "token_type_ids": {0: "batch", 1: "sequence"}}
    path = export_onnx(bert, _with_segments(_tokens(2, 16)), tmp_path / "bert.onnx", dynamic_axes=axes)
    assert _dims(path) == {name: ["batch", "sequence"] for name in ("input_ids", "attention_mask", "token_type_ids")}
    for length in (5, 16, 40):  # shorter than traced, traced, longer (the position table holds 64)
        report = compare_onnx(bert, path, _with_segments(_tokens(3, length, seed=length)))
        assert report.passed, (length, str(report))


def test_bert_quantized_with_a_symbolic_sequence_is_faithful_at_every_length(tmp_path, bert):
    calibration = [_tokens(2, length, seed=length) for length in (8, 16, 24, 12)]
    q = Quantizer(target="onnxruntime").quantize(bert, calibration, dynamic_axes=SEQ)
    path = export_qdq(q, _tokens(2, 16), tmp_path / "bert_q.onnx", dynamic_batch=True)
    assert _dims(path) == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    for length in (5, 16, 40):
        report = compare_qdq(q, path, _tokens(3, length, seed=100 + length), rounding_floor=True)
        assert all(o.within_floor for o in report.outputs), (length, str(report))

    # scales are constants of the file, never a function of the length: a sample of another
    # length gives the same file
    other = export_qdq(q, _tokens(2, 24), tmp_path / "bert_q24.onnx", dynamic_batch=True)
    a, b = onnx.load(str(path)), onnx.load(str(other))
    assert [(t.name, t.raw_data) for t in a.graph.initializer] == [(t.name, t.raw_data) for t in b.graph.initializer]

    # ONNX Runtime fuses the dynamic file at least as well as the static one: every linear layer
    # in INT8 (in the static file ORT first turns six MatMul+Add pairs into Gemm, which its QDQ
    # fusion then leaves in float), the same norms, GELUs and softmaxes; float MatMuls are only
    # attention's products, which the preset leaves float
    static = export_qdq(q, _tokens(2, 16), tmp_path / "bert_static.onnx", dynamic_axes={})
    assert _dims(static) == {"input_ids": [2, 16], "attention_mask": [2, 16]}
    dynamic, fixed = _fused(path), _fused(static)
    products = activation_products(path)
    assert products == 2 * bert.config.num_hidden_layers
    assert dynamic["int8 linear"] >= fixed["int8 linear"] and dynamic["float linear"] == products
    assert all(dynamic[k] == fixed[k] for k in ("norm", "gelu", "softmax")) and dynamic["unfused pieces"] == 0


_KINDS = {
    "int8 linear": {"QGemm", "MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulNBits",
                    "QLinearConv", "QAttention"},
    "float linear": {"Gemm", "FusedGemm", "MatMul", "FusedMatMul"},
    "norm": {"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
             "SkipSimplifiedLayerNormalization"},
    "gelu": {"Gelu", "BiasGelu", "FastGelu", "QuickGelu"},
    "softmax": {"Softmax"},
    "unfused pieces": {"Erf", "Reciprocal", "Pow", "Sqrt", "ReduceMean"},
}


def _fused(path) -> dict[str, int]:
    """What ORT's optimised graph computes, by kind: how a linear layer runs (ORT's MatMul+Add to
    Gemm fusion needs static shapes, so a dynamic file holds MatMul where a static one holds Gemm:
    the same MLAS kernel), and the fusions of norms, GELU and softmax."""
    ops = ort_optimised_ops(path)
    return {kind: sum(ops[op] for op in members) for kind, members in _KINDS.items()}


def test_float_bert_keeps_its_fusions_with_a_symbolic_sequence(tmp_path, bert):
    dynamic = export_onnx(bert, _tokens(2, 16), tmp_path / "d.onnx", dynamic_axes=SEQ)
    static = export_onnx(bert, _tokens(2, 16), tmp_path / "s.onnx", dynamic_batch=False)
    fused = _fused(dynamic)
    assert fused == _fused(static), (fused, _fused(static))
    assert fused["norm"] and fused["gelu"] and not fused["unfused pieces"]


def test_weight_only_llama_runs_at_any_length(tmp_path):
    llama = next(z for z in zoo() if z.name == "Llama").model()
    q = Quantizer(backend="torchao", method="int4_weight_only", group_size=32).quantize(llama)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    path = export_qdq(q, ids, tmp_path / "llama.onnx", dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}})
    assert _dims(path) == {"input": ["batch", "sequence"]}  # a positional sample: named by forward
    for length in (3, 30):
        longer = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        got = run(path, {"input": longer.numpy()}, optimized=False)[0]
        with torch.no_grad():
            want = q(longer).logits.numpy()
        assert np.max(np.abs(got - want)) < 1e-4


# -- images: height and width ---------------------------------------------------------------
def test_cnn_traced_at_one_size_runs_at_another(tmp_path):
    model = next(z for z in zoo() if z.name == "ResNet").model()  # transformers' ResNet, measured norms
    image = {"pixel_values": {0: "batch", 2: "height", 3: "width"}}  # forward's name for the input
    path = export_onnx(model, torch.randn(2, 3, 64, 64), tmp_path / "cnn.onnx", dynamic_axes=image)
    assert _dims(path)["input"] == ["batch", 3, "height", "width"]
    assert compare_onnx(model, path, torch.randn(2, 3, 96, 80), atol=1e-4, rtol=1e-3).passed

    calibration = [torch.randn(2, 3, 64, 64), torch.randn(2, 3, 96, 96)]
    q = Quantizer(target="onnxruntime").quantize(model, calibration, dynamic_axes={"pixel_values": {2: "height", 3: "width"}})
    qpath = export_qdq(q, torch.randn(2, 3, 64, 64), tmp_path / "cnn_q.onnx")
    assert _dims(qpath)["input"] == [2, 3, "height", "width"]
    report = compare_qdq(q, qpath, torch.randn(2, 3, 80, 112), rounding_floor=True)
    assert all(o.within_floor for o in report.outputs), str(report)
