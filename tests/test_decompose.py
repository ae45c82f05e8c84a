"""The rewrites that run before annotation: each computes what the node it replaces computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onnxport import Quantizer, compare_qdq, export_qdq, qdq_report
from onnxport.inspection.stats import ort_optimised_ops
from onnxport.quantize.decompose import split_attention, split_silu

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _Attention(torch.nn.Module):
    """Projections around one SDPA call, with the mask kinds transformers passes."""

    def __init__(self, mask: str, kv_heads: int = 4) -> None:
        super().__init__()
        self.mask, self.kv_heads = mask, kv_heads
        self.q = torch.nn.Linear(32, 32)
        self.kv = torch.nn.Linear(32, 2 * 8 * kv_heads)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2 * self.kv_heads, 8).transpose(1, 2).chunk(2, dim=1)
        mask = None
        if self.mask == "bool":
            mask = torch.ones(n, n, dtype=torch.bool).tril()
        elif self.mask == "float":
            mask = torch.zeros(b, 1, n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != 4)
        return self.out(y.transpose(1, 2).reshape(b, n, 32))


def _captured(model, x):
    return torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()


@pytest.mark.parametrize("mask, kv_heads", [("none", 4), ("bool", 4), ("float", 4), ("none", 2)])
def test_split_attention_computes_what_sdpa_computed(mask, kv_heads):
    torch.manual_seed(0)
    model, x = _Attention(mask, kv_heads).eval(), torch.randn(3, 6, 32)
    graph = _captured(model, x)
    assert any(n.target == SDPA for n in graph.graph.nodes)
    split = split_attention(graph)
    targets = [n.target for n in split.graph.nodes]
    assert SDPA not in targets and targets.count(torch.ops.aten.matmul.default) == 2
    other = torch.randn(5, 6, 32)  # another batch size: the symbolic batch survived the rewrite
    torch.testing.assert_close(split(other), model(other), atol=1e-5, rtol=1e-5)
    split_attention(split)  # idempotent: a second run finds no attention left to split
    assert [n.target for n in split.graph.nodes] == targets


def test_split_silu_computes_what_silu_computed():
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU()).eval(), torch.randn(2, 8)
    split = split_silu(_captured(model, x))
    targets = [n.target for n in split.graph.nodes]
    assert torch.ops.aten.silu.default not in targets and torch.ops.aten.sigmoid.default in targets
    torch.testing.assert_close(split(x), model(x), atol=1e-6, rtol=1e-6)


def test_openvino_preset_quantizes_both_attention_products_and_onnxruntime_leaves_them_float(tmp_path):
    torch.manual_seed(0)
    model = _Attention("float").eval()
    calibration = [torch.randn(4, 6, 32) for _ in range(2)]
    check = torch.randn(8, 6, 32)
    split = Quantizer(target="openvino").quantize(model, calibration)
    assert not any(n.target == SDPA for n in split.graph.nodes)
    path = export_qdq(split, calibration[0], tmp_path / "openvino.onnx", dynamic_batch=True)
    products = [op for op in qdq_report(path, ort=False).compute_ops if op.op_type == "MatMul"]
    assert len(products) == 5 and all(op.quantized for op in products)  # three projections, two products
    assert compare_qdq(split, path, check).outputs[0].cosine_similarity >= 0.999
    with torch.no_grad():
        reference, ours = model(check).flatten(), split(check).flatten()
    assert F.cosine_similarity(reference, ours, dim=0) >= 0.99  # still attention, quantized
    # ORT's INT8 product of two activations is no faster than its float one: the 'onnxruntime'
    # preset keeps attention whole, its projections in INT8, and the report says why the rest is float
    whole = Quantizer(target="onnxruntime").quantize(model, calibration)
    assert any(n.target == SDPA for n in whole.graph.nodes)
    path = export_qdq(whole, calibration[0], tmp_path / "onnxruntime.onnx", dynamic_batch=True)
    ops = ort_optimised_ops(path)
    assert ops["MatMulIntegerToFloat"] + ops["QGemm"] + ops["QLinearMatMul"] == 3
    report = qdq_report(path, ort=False)
    reasons = [op.why_float for op in report.compute_ops if not op.quantized]
    assert len(reasons) == 2 and all("two activations" in why for why in reasons), reasons
    assert compare_qdq(whole, path, check, rounding_floor=True).outputs[0].within_floor
    # the default preset keeps attention whole too
    default = Quantizer().quantize(model, calibration)
    assert any(n.target == SDPA for n in default.graph.nodes)
