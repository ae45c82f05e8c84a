"""compare_layers: a pt2e model against its own Q/DQ file, tensor by tensor, on real exports."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from onnxport import LayerReport, Quantizer, compare_layers, export_qdq
from onnxport.errors import InvalidArgumentError
from tests.models import ResNet18, TinyTransformer


class GeluMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.fixture(scope="module")
def resnet_file(tmp_path_factory):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 32, 32)
    quantized = Quantizer().quantize(ResNet18(num_classes=10).eval(), [x[:4], x[4:]])
    path = tmp_path_factory.mktemp("layers") / "resnet.onnx"
    export_qdq(quantized, x[:2], path, dynamic_batch=True)
    return quantized, path, x[:4]


def _tamper_dequantize_scale(path, out, factor=1.5):
    """Give one activation DequantizeLinear in the middle of the graph its own, wrong scale."""
    model = onnx.load(str(path))
    readers = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and not n.input[0].startswith("_frozen")]
    target = readers[len(readers) // 2]
    scale = next(t for t in model.graph.initializer if t.name == target.input[1])
    model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(factor), "tampered"))
    target.input[1] = "tampered"
    onnx.save(model, str(out))
    return target.name


def test_an_untouched_file_follows_its_model_within_rounding(resnet_file):
    quantized, path, x = resnet_file
    report = compare_layers(quantized, path, x)
    assert isinstance(report, LayerReport) and report.first_divergence is None
    layers = [r for r in report.rows if r.kind == "layer"]
    assert len(layers) >= 20 and all(r.torch_node for r in layers)  # every quantizer found its counterpart
    # Fed the model's own inputs, every layer of the file computes what the model computes...
    assert all(r.isolated_error_in_steps <= 1 for r in layers)
    # ...and where one-step rounding flips add up (torch quantizes x * (1/scale), ONNX x / scale)
    # the rows say so instead of blaming a layer.
    assert all(r.cause == "propagated" for r in report.rows if r.error_in_steps is not None and r.error_in_steps > 1.001)
    assert "follows the model" in str(report) or "no defect" in str(report)
    json.dumps(report.as_dict())


def test_a_changed_dequantize_scale_is_found_where_it_is(resnet_file, tmp_path):
    quantized, path, x = resnet_file
    tampered = tmp_path / "tampered.onnx"
    node = _tamper_dequantize_scale(path, tampered)
    report = compare_layers(quantized, tampered, x)
    first = report.first_divergence
    assert first is not None and first.onnx_node == node and first.cause == "qparams"
    assert first.error_in_steps > 1 and "scale" in first.note
    before = [r for r in report.rows if r.index < first.index and r.error_in_steps is not None]
    assert before and all(r.cause in (None, "rounding", "propagated") for r in before)  # no defect before it
    after = [r for r in report.rows if r.index > first.index and r.cause not in (None, "rounding")]
    assert after and {r.cause for r in after} == {"propagated"}  # consequences, not further defects
    assert f"first divergence: DequantizeLinear '{node}'" in str(report)


def test_a_float_op_that_computes_something_else_is_a_float_kernel_divergence(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(16, 16)
    quantized = Quantizer().quantize(GeluMLP().eval(), [x])
    path = tmp_path / "gelu.onnx"
    export_qdq(quantized, x, path, dynamic_batch=True)
    model = onnx.load(str(path))
    erf = next(n for n in model.graph.node if n.op_type == "Erf")  # exact GELU: x/2 * (1 + erf(x/sqrt 2))
    erf.op_type = "Tanh"  # a different function in the same place
    swapped = tmp_path / "swapped.onnx"
    onnx.save(model, str(swapped))
    assert compare_layers(quantized, path, x).first_divergence is None
    first = compare_layers(quantized, swapped, x).first_divergence
    assert first is not None and first.cause == "float_kernel" and first.kind == "layer"
    assert any(op.startswith("Tanh") for op in first.segment)


class PaddedInputConv(torch.nn.Module):
    """TensorFlow-style 'same' padding on the model's input, as transformers' MobileNetV2 writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.pad(x, (0, 1, 0, 1))).relu()


def test_a_pad_moved_into_the_conv_is_compared_on_the_region_it_pads(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 15, 15)
    quantized = Quantizer().quantize(PaddedInputConv().eval(), [x])
    path = tmp_path / "padded.onnx"
    export_qdq(quantized, x[:2], path, dynamic_batch=True)
    model = onnx.load(str(path))
    assert "Pad" not in [n.op_type for n in model.graph.node]  # the pad is the Conv's now...
    first_q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    assert first_q.input[0] == model.graph.input[0].name  # ...and the input's quantizer reads x itself
    report = compare_layers(quantized, path, x)
    assert report.first_divergence is None, str(report)
    row = next(r for r in report.rows if r.kind == "layer")
    assert row.shape == (3, 15, 15) and row.torch_node == "pad" and row.error_in_steps <= 1.001
    assert all(r.cause != "structure" for r in report.rows)


def test_a_transformer_file_follows_its_model(tmp_path):
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (8, 16))
    quantized = Quantizer().quantize(TinyTransformer().eval(), [tokens[:4], tokens[4:]])
    path = tmp_path / "transformer.onnx"
    export_qdq(quantized, tokens[:2], path)
    report = compare_layers(quantized, path, tokens, n_batches=4)
    assert report.first_divergence is None, str(report)
    ops = {r.op for r in report.rows if r.kind == "layer"}
    assert {"LayerNormalization", "Softmax", "Gather"} <= ops
    assert str(compare_layers(quantized, path, tokens)) == str(report)  # the file's fixed batch of 2 splits it
    with pytest.raises(InvalidArgumentError, match="fixed batch of 2, which does not divide 7"):
        compare_layers(quantized, path, tokens[:7])
    # ONNX Runtime's fused kernels, on a file made for them (portable weights: exact U8S8 on any x86)
    for_ort = Quantizer(target="onnxruntime").quantize(TinyTransformer().eval(), [tokens[:4], tokens[4:]])
    export_qdq(for_ort, tokens[:2], tmp_path / "ort.onnx")
    optimised = compare_layers(None, tmp_path / "ort.onnx", tokens, optimized=True)
    assert optimised.optimized and optimised.rows
    assert all(r.error_in_steps <= 4 for r in optimised.rows)  # fusion rounding stays a few steps


def test_bad_arguments_are_named(resnet_file, tmp_path):
    quantized, path, x = resnet_file
    with pytest.raises(InvalidArgumentError, match="missing.onnx' does not exist"):
        compare_layers(quantized, tmp_path / "missing.onnx", x)
    (tmp_path / "garbage.onnx").write_bytes(b"\x07not onnx")
    with pytest.raises(InvalidArgumentError, match="is not a readable ONNX model"):
        compare_layers(quantized, tmp_path / "garbage.onnx", x)
    with pytest.raises(InvalidArgumentError, match="GraphModule"):
        compare_layers(ResNet18(num_classes=10).eval(), path, x)
    with pytest.raises(InvalidArgumentError, match=r"\.png"):
        compare_layers(quantized, path, x).plot(tmp_path / "report.jpg")


def test_the_picture(resnet_file, tmp_path):
    pytest.importorskip("matplotlib")
    quantized, path, x = resnet_file
    tampered = tmp_path / "tampered.onnx"
    _tamper_dequantize_scale(path, tampered)
    picture = compare_layers(quantized, tampered, x).plot(tmp_path / "layers.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_debug_prints_writes_json_and_exits_1_on_a_divergence(resnet_file, tmp_path):
    quantized, path, x = resnet_file
    program = tmp_path / "quantized.pt2"
    torch.export.save(torch.export.export(quantized, (x[:2],)), str(program))
    tampered = tmp_path / "tampered.onnx"
    node = _tamper_dequantize_scale(path, tampered)
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "onnxport", "debug", str(program), str(tampered), "--input-shape", "2,3,32,32", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 1, result.stderr
    assert f"'{node}'" in result.stdout and "qparams" in result.stdout
    assert json.loads(out.read_text())["first_divergence"]["onnx_node"] == node
    clean = subprocess.run(cmd[:5] + [str(path), "--input-shape", "2,3,32,32"], capture_output=True, text=True, check=False)
    assert clean.returncode == 0 and "follows the model" in clean.stdout, clean.stderr


def test_a_sample_larger_than_the_files_fixed_batch_is_run_in_batches_of_it(tmp_path):
    """The file says its batch: every comparison cuts the sample into batches of it, without
    n_batches, and refuses by name a sample that is not a multiple of it."""
    from onnxport import compare_onnx, compare_qdq, export_onnx, verify_onnx, verify_qdq

    torch.manual_seed(0)
    model = GeluMLP().eval()
    x = torch.randn(16, 16)
    quantized = Quantizer().quantize(model, [x[:8], x[8:]])
    qdq_path, float_path = tmp_path / "fixed8.onnx", tmp_path / "float8.onnx"
    export_qdq(quantized, x[:8], qdq_path)  # a fixed batch of 8
    export_onnx(model, x[:8], float_path)
    header = onnx.load(str(qdq_path))
    assert header.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 8
    layers = compare_layers(quantized, qdq_path, x)
    assert layers.first_divergence is None
    comparison = compare_qdq(quantized, qdq_path, x, optimized=False)  # the file's ONNX semantics
    assert comparison.n_samples == 16 and comparison.outputs[0].cosine_similarity > 0.9999
    whole = compare_qdq(quantized, qdq_path, x, n_batches=2, optimized=False)  # the seed's explicit form still works
    assert whole.outputs[0].max_abs_error == comparison.outputs[0].max_abs_error
    assert 0.0 <= verify_qdq(quantized, qdq_path, x) <= 1.0
    assert compare_onnx(model, float_path, x).passed and verify_onnx(model, float_path, x)
    with pytest.raises(InvalidArgumentError, match="fixed batch of 8, which does not divide 12"):
        compare_qdq(quantized, qdq_path, x[:12])
