"""Layer scales folded into the layer before them (``onnxport/quantize/fold.py``)."""

from __future__ import annotations

import torch

from onnxport import Quantizer, compare_qdq, export_qdq
from onnxport.inspection.stats import ort_optimised_ops

aten = torch.ops.aten


class _ScaledBlocks(torch.nn.Module):
    """ConvNeXt's two layer scales: a conv's output channels (through a dropout), a linear's last
    axis; then a scale that varies over space and a scale on a shared weight, which must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(8, 8, 1)
        self.conv = torch.nn.Conv2d(8, 8, 1)
        self.gamma = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.linear = torch.nn.Linear(8, 8)
        self.beta = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.other = torch.nn.Conv2d(8, 8, 1)
        self.spatial = torch.nn.Parameter(torch.rand(1, 1, 6, 6) + 0.5)

    def forward(self, x):
        x = self.stem(x)
        x = x + torch.nn.functional.dropout(self.conv(x), 0.0, False) * self.gamma.reshape(1, -1, 1, 1)
        y = x.permute(0, 2, 3, 1)
        y = (y + self.beta * self.linear(y)).permute(0, 3, 1, 2)
        return y + self.other(y) * self.spatial


def _muls(model) -> int:
    return sum(1 for n in model.graph.nodes if n.target == aten.mul.Tensor)


def test_per_channel_layer_scales_fold_into_the_layer_and_the_residual_add_runs_in_int8(tmp_path):
    torch.manual_seed(0)
    model = _ScaledBlocks().eval()
    calibration = [torch.randn(4, 8, 6, 6) for _ in range(2)]
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    assert _muls(quantized) == 1  # the spatial scale stays; both channel scales are in the weights
    assert model.gamma.requires_grad and _muls(torch.export.export(model, (calibration[0],)).module()) == 3  # input untouched
    path = export_qdq(quantized, calibration[0], tmp_path / "m.onnx", dynamic_batch=True)
    ops = ort_optimised_ops(path)
    assert ops["QLinearAdd"] >= 1, dict(ops)  # conv + conv: both operands quantized now
    assert compare_qdq(quantized, path, torch.randn(8, 8, 6, 6)).outputs[0].cosine_similarity >= 0.999
    with torch.no_grad():  # the folded model is still the float model, to quantization error
        x = torch.randn(8, 8, 6, 6)
        assert torch.nn.functional.cosine_similarity(quantized(x).flatten(), model(x).flatten(), dim=0) > 0.999


class _ScaledLinear(torch.nn.Module):
    """``linear(x) * gamma``; ``tied``: the weight is read a second time."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.gamma = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.tied = tied

    def forward(self, x):
        y = self.linear(x) * self.gamma
        return y + torch.nn.functional.linear(x, self.linear.weight) if self.tied else y


def test_a_scale_on_a_weight_that_something_else_reads_is_not_folded():
    quantized = Quantizer().quantize(_ScaledLinear(tied=True).eval(), [torch.randn(4, 8)])
    assert _muls(quantized) == 1


def test_qat_keeps_the_scale_apart_from_the_weights_it_trains():
    prepared = Quantizer(method="qat").prepare(_ScaledLinear(), torch.randn(4, 8))
    assert _muls(prepared) == 1
    # the same model quantized after training does fold
    assert _muls(Quantizer().quantize(_ScaledLinear().eval(), [torch.randn(4, 8)])) == 0
