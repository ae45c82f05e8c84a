"""``target='openvino'``: files OpenVINO's CPU plugin runs in INT8 (read from its runtime graph)
and that, as the plugin deploys them, compute what their pt2e model computes.

The models are trained in the test (the demo's CNN on drawn shapes, a small transformer on a
token-counting task), so agreement is judged with a trained model's margins.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import openvino  # a test dependency: missing, the suite must fail, not skip
import pytest
import torch

from onnxport import Quantizer, check_target, export_qdq, quant_spec
from onnxport.demo import DemoNet, draw_images
from onnxport.rounding import cosine
from tests.models import TinyTransformer
from tests.test_portable import _token_task, _train

#: the plugin's layer types that multiply by a weight or an activation
_PRODUCTS = ("Convolution", "GroupConvolution", "FullyConnected", "MatMul")


def openvino_runtime(path, threads: int | None = 1) -> tuple[Counter, object]:
    """(layer type, runtime precision) of every op in the CPU plugin's compiled graph, and the model
    (one inference thread unless asked: with two, OpenVINO 2026.4's fused residual convs answer
    differently from call to call on an AVX2 EPYC; docs/targets.md)."""

    config = {"INFERENCE_PRECISION_HINT": "f32", **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
    compiled = openvino.Core().compile_model(str(path), "CPU", config)
    counts: Counter = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        counts[info["layerType"].astype(str), info["runtimePrecision"].astype(str)] += 1
    return counts, compiled


def _deployed(quantized, path, sample: torch.Tensor) -> tuple[Counter, float, float]:
    counts, compiled = openvino_runtime(path)
    got = np.asarray(compiled([sample.numpy()])[compiled.outputs[0]])
    with torch.no_grad():
        want = quantized(sample).numpy()
    return counts, cosine(got, want), float((got.argmax(-1) == want.argmax(-1)).mean())


def _float_products(counts: Counter) -> dict:
    return {key: n for key, n in counts.items() if key[0] in _PRODUCTS and key[1].lower() not in ("i8", "u8")}


@pytest.fixture(scope="module")
def trained_cnn():
    torch.manual_seed(0)
    x, y = draw_images(1024, seed=0, size=24)
    model = _train(DemoNet(width=16), lambda step: (x[(step * 64) % 1024:][:64], y[(step * 64) % 1024:][:64]), 100)
    return model, [x[i:i + 64] for i in range(0, 512, 64)], draw_images(256, seed=1, size=24)[0]


def test_openvino_file_runs_every_conv_in_int8_and_agrees_with_its_model(tmp_path, trained_cnn):
    model, calibration, test_x = trained_cnn
    quantized = Quantizer(target="openvino").quantize(model, calibration)
    spec = quant_spec(quantized)
    assert spec.target == "openvino" and spec.weight_range == "portable"
    path = export_qdq(quantized, test_x[:4], tmp_path / "cnn.onnx", dynamic_batch=True)
    assert check_target(path, "openvino") == []
    counts, agreement, top1 = _deployed(quantized, path, test_x)
    assert not _float_products(counts), counts
    assert sum(n for (layer, _), n in counts.items() if layer == "Convolution") >= 4
    assert agreement >= 0.9999 and top1 == 1.0, (agreement, top1)


def test_openvino_file_of_a_transformer_multiplies_in_int8(tmp_path):
    torch.manual_seed(0)
    tokens, labels = _token_task(2048, seed=0)
    model = _train(TinyTransformer(), lambda step: (tokens[(step * 64) % 2048:][:64], labels[(step * 64) % 2048:][:64]), 300)
    test_tokens, _ = _token_task(256, seed=1)
    quantized = Quantizer(target="openvino").quantize(model, [tokens[i:i + 64] for i in range(0, 512, 64)])
    path = export_qdq(quantized, test_tokens[:4], tmp_path / "t.onnx", dynamic_batch=True)
    assert check_target(path, "openvino") == []
    counts, agreement, top1 = _deployed(quantized, path, test_tokens)
    int8 = sum(n for (layer, precision), n in counts.items() if layer in _PRODUCTS and precision.lower() in ("i8", "u8"))
    assert int8 >= 4, counts
    assert agreement >= 0.9999 and top1 == 1.0, (agreement, top1)


def test_full_range_weights_break_the_openvino_rule(tmp_path, trained_cnn):
    model, calibration, test_x = trained_cnn
    full = Quantizer(target="openvino", weight_range="full").quantize(model, calibration)
    path = export_qdq(full, test_x[:4], tmp_path / "full.onnx")
    assert check_target(path, "openvino") == []  # the file records the opt-out
    # a file that does not record it is held to the portable rule
    import onnx

    header = onnx.load(str(path))
    del header.metadata_props[:]
    problems = check_target(header, "openvino")
    assert problems and all("beyond [-64, 64]" in p and "OpenVINO" in p for p in problems)


class _ResidualBlocks(torch.nn.Module):
    """Two residual blocks: an identity shortcut, then a strided one with a projection conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.body = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.down = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.project = torch.nn.Conv2d(8, 16, 1, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = torch.relu(self.body(x) + x)
        return torch.relu(self.down(x) + self.project(x))


def test_openvino_adds_a_residual_into_its_conv_unrounded_so_the_conv_output_stays_float(tmp_path):
    torch.manual_seed(0)
    model = _ResidualBlocks().eval()
    calibration = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    quantized = Quantizer(target="openvino").quantize(model, calibration)
    adds = [n for n in quantized.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    dequantized = lambda node: "dequantize" in str(node.target)
    assert len(adds) == 2
    # the identity block: the conv's output reaches the Add float, the shortcut through its pair
    assert [dequantized(a) for a in adds[0].args] == [False, True]
    # the projection block: the plugin sums the earlier conv (quantized) into the later one (float)
    assert sorted(dequantized(a) for a in adds[1].args) == [False, True]
    path = export_qdq(quantized, calibration[0], tmp_path / "res.onnx", dynamic_batch=True)
    assert check_target(path, "openvino") == []
    counts, compiled = openvino_runtime(path)
    assert counts["Convolution", "u8"] == 4 and not _float_products(counts), counts
    x = torch.randn(8, 3, 16, 16)
    got = np.asarray(compiled([x.numpy()])[compiled.outputs[0]])
    with torch.no_grad():
        want = quantized(x).numpy()
    # the output is the last ReLU's pair: count the plugin's departures from the model in its steps
    step = float(next(n for n in reversed(quantized.graph.nodes) if "dequantize" in str(n.target)).args[1])
    steps = np.abs(got - want) / step
    # with the conv outputs paired: a step apart at 22% of the outputs (exact without; AVX-512 Xeon)
    assert steps.max() <= 1.01 and (steps > 0.5).mean() < 0.01, (steps.max(), (steps > 0.5).mean())
