"""export_onnx on real models, run by real ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from onnxport import ONNXModel, compare_onnx, export_onnx, qdq_report, verify_onnx
from onnxport.errors import ExportRefusedError, InvalidArgumentError, PerformanceWarning
from tests.models import MobileNetV2Small, ResNet18, TinyTransformer, TwoInTwoOut


def _opset(path) -> int:
    return next(e.version for e in onnx.load(str(path), load_external_data=False).opset_import if e.domain == "")


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return ResNet18(num_classes=10).eval()


@pytest.fixture(scope="module")
def resnet_file(resnet, tmp_path_factory):
    path = tmp_path_factory.mktemp("resnet") / "resnet18.onnx"
    return export_onnx(resnet, torch.randn(2, 3, 64, 64), path)


def test_resnet18_round_trip_at_two_batch_sizes(resnet, resnet_file):
    assert _opset(resnet_file) == 17
    for batch in (1, 5):
        report = compare_onnx(resnet, resnet_file, torch.randn(batch, 3, 64, 64), rtol=1e-3, atol=1e-4)
        assert report.passed, str(report)
        assert report.outputs[0].shape == (batch, 10)
        assert report.outputs[0].cosine_similarity > 0.99999
    onnx.checker.check_model(str(resnet_file), full_check=True)


def test_opset_18_is_declared_as_asked(resnet, tmp_path):
    path = export_onnx(resnet, torch.randn(1, 3, 32, 32), tmp_path / "r18.onnx", opset_version=18, optimize=False)
    assert _opset(path) == 18
    assert verify_onnx(resnet, path, torch.randn(3, 3, 32, 32), atol=1e-4)


def test_opset_17_lowering_keeps_reduce_mean_correct(tmp_path):
    model = MobileNetV2Small().eval()  # ends in .mean((2, 3)): a ReduceMean with axes
    path = export_onnx(model, torch.randn(2, 3, 32, 32), tmp_path / "mb.onnx", opset_version=17)
    graph = onnx.load(str(path)).graph
    reduce = [n for n in graph.node if n.op_type == "ReduceMean"]
    assert reduce and all(len(n.input) == 1 for n in reduce)
    assert verify_onnx(model, path, torch.randn(4, 3, 32, 32), atol=1e-4)


def test_fixed_batch_when_asked(tmp_path):
    model = MobileNetV2Small().eval()
    path = export_onnx(model, torch.randn(2, 3, 32, 32), tmp_path / "m.onnx", dynamic_batch=False)
    shape = ONNXModel(path)._inputs[0].shape
    assert shape == [2, 3, 32, 32]
    with pytest.raises(InvalidArgumentError, match="shape"):
        ONNXModel(path)(torch.randn(3, 3, 32, 32))


def test_transformer_with_integer_tokens(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    tokens = torch.randint(0, 100, (2, 16))
    path = export_onnx(model, tokens, tmp_path / "tf.onnx")
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"MatMul", "Softmax"} <= ops
    report = compare_onnx(model, path, torch.randint(0, 100, (7, 16)), atol=1e-4)
    assert report.passed, str(report)


def test_two_inputs_two_outputs_with_names(tmp_path):
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    sample = (torch.randn(2, 3, 8, 8), torch.randn(2, 6))
    path = export_onnx(model, sample, tmp_path / "two.onnx", input_names=["image", "features"],
                       output_names=["logits", "embedding"])
    runner = ONNXModel(path)
    assert runner.input_names == ["image", "features"]
    assert runner.output_names == ["logits", "embedding"]
    report = compare_onnx(model, path, (torch.randn(3, 3, 8, 8), torch.randn(3, 6)), atol=1e-5)
    assert [o.name for o in report.outputs] == ["logits", "embedding"] and report.passed
    logits, emb = runner(features=torch.randn(4, 6), image=torch.randn(4, 3, 8, 8))
    assert logits.shape == (4, 4) and emb.shape == (4, 16)


def test_default_names_for_several_inputs_and_outputs(tmp_path):
    path = export_onnx(TwoInTwoOut().eval(), (torch.randn(2, 3, 8, 8), torch.randn(2, 6)), tmp_path / "d.onnx")
    runner = ONNXModel(path)
    assert runner.input_names == ["input_0", "input_1"] and runner.output_names == ["output_0", "output_1"]


def test_model_mode_is_restored(tmp_path):
    model = MobileNetV2Small().train()
    export_onnx(model, torch.randn(2, 3, 32, 32), tmp_path / "m.onnx")
    assert model.training and all(m.training for m in model.modules())


# -- ONNX Runtime INT8 on a trained model ---------------------------------------------------
def _top1_agreement(model, path, x) -> float:
    with torch.no_grad():
        ref = model(x).argmax(1)
    got = ONNXModel(path)(x).argmax(1)
    return float((ref == got).float().mean())


def test_static_int8_agrees_with_float_and_keeps_dynamic_batch(trained, tmp_path):
    model, (x, y) = trained
    calib = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 128, 32)]  # (inputs, target) pairs
    path = export_onnx(model, x[:1], tmp_path / "s.onnx", quantize=True, quantize_mode="static",
                       calibration_data=calib)
    graph = onnx.load(str(path)).graph
    q = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    assert q, "static quantization wrote no QuantizeLinear"
    inits = {t.name: t for t in graph.initializer}
    act_zp = {inits[n.input[2]].data_type for n in q if n.input[2] in inits}
    assert act_zp == {onnx.TensorProto.UINT8}  # uint8 activations by default
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param  # still symbolic
    assert _opset(path) == 17
    agreement = _top1_agreement(model, path, x)
    assert agreement >= 0.98, agreement
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.onnx"]  # no intermediate survives


def test_dynamic_int8_agrees_with_float(trained, tmp_path):
    model, (x, _) = trained
    with pytest.warns(PerformanceWarning, match="ConvInteger"):
        path = export_onnx(model, x[:4], tmp_path / "d.onnx", quantize=True)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "DynamicQuantizeLinear" in ops
    assert _top1_agreement(model, path, x) >= 0.97


def test_dynamic_int8_of_matmuls_in_a_transformer(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    tokens = torch.randint(0, 100, (4, 16))
    path = export_onnx(model, tokens, tmp_path / "tf.onnx", quantize=True, op_types_to_quantize=["MatMul"])
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMulInteger") + ops.count("DynamicQuantizeMatMul") >= 6
    # ORT fuses them into DynamicQuantizeMatMul: INT8 products, which the report counts as such
    assert qdq_report(path).extra["ort_int8"]["MatMul"]["int8"] >= 12
    report = compare_onnx(model, path, tokens, atol=1e-1, rtol=1e-1)
    assert report.outputs[0].cosine_similarity > 0.99, str(report)


def test_quantizing_nothing_is_loud(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    with pytest.warns(PerformanceWarning, match="quantized no operator"):
        export_onnx(model, torch.randn(2, 4), tmp_path / "n.onnx", quantize=True, op_types_to_quantize=["Conv"])


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_static_calibration_methods_and_types(trained, tmp_path, method):
    model, (x, _) = trained
    path = export_onnx(model, x[:2], tmp_path / "m.onnx", quantize=True, quantize_mode="static",
                       calibration_data=[x[:64]], calibration_method=method, activation_type="int8")
    graph = onnx.load(str(path)).graph
    inits = {t.name: t for t in graph.initializer}
    zps = {inits[n.input[2]].data_type for n in graph.node if n.op_type == "QuantizeLinear" and n.input[2] in inits}
    assert zps == {onnx.TensorProto.INT8}
    assert _top1_agreement(model, path, x) >= 0.95


# -- Bad input: a clear error before anything is written -------------------------------------
SAMPLE = torch.randn(2, 3, 16, 16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "not a model"}, "model must be a torch.nn.Module"),
        ({"sample": [1, 2]}, "sample must be a torch.Tensor"),
        ({"sample": None}, "sample must be a torch.Tensor"),
        ({"quantize": True, "quantize_mode": "fast"}, "quantize_mode must be one of 'dynamic', 'static'"),
        ({"quantize": True, "quantize_mode": "static"}, "needs calibration_data"),
        ({"quantize": True, "quantize_mode": "static", "calibration_data": [torch.randn(2, 3, 8, 8)]},
         "calibration_data batch 0 .* does not match"),
        ({"quantize": True, "quantize_mode": "static", "calibration_data": []}, "yielded no batches"),
        ({"quantize": True, "quantize_mode": "static", "calibration_data": torch.randn(2, 3, 16, 16)},
         "calibration_data must be an iterable of batches"),
        ({"opset_version": 11}, "opset_version must be an integer from 13"),
        ({"opset_version": 99}, "opset_version must be an integer from 13"),
        ({"input_names": ["a", "b"]}, "input_names has 2 names but the model has 1"),
        ({"calibration_method": "kl"}, "calibration_method must be one of"),
    ],
)
def test_bad_input_is_refused_before_writing(guarded, kwargs, message):
    args = {"model": MobileNetV2Small().eval(), "sample": SAMPLE, "output_path": guarded} | kwargs
    with pytest.raises(InvalidArgumentError, match=message):
        export_onnx(**args)


def test_unwritable_or_missing_directory(guarded, tmp_path):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        export_onnx(MobileNetV2Small().eval(), SAMPLE, tmp_path / "missing" / "m.onnx")


class _Untraceable(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export refuses
            return x * 2
        return x - 1


def test_failed_export_keeps_previous_file(guarded):
    with pytest.raises(ExportRefusedError, match="torch.onnx.export") as refused:
        export_onnx(_Untraceable(), SAMPLE, guarded)
    message = str(refused.value)  # names the model and the line of its code, without colour codes
    assert "could not capture _Untraceable" in message and "test_export.py:" in message and "\x1b[" not in message


@pytest.mark.slow
def test_model_over_2gb_is_written_with_external_data(tmp_path):
    # 23,200 x 23,200 float32 = 2.15 GB of weights: over protobuf's limit.
    model = torch.nn.Linear(23_200, 23_200, bias=False).eval()
    path = export_onnx(model, torch.randn(1, 23_200), tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    assert (tmp_path / "big.onnx").stat().st_size < 1_000_000
    assert (tmp_path / "big.onnx.data").stat().st_size > 2**31
    x = torch.randn(2, 23_200)
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(ONNXModel(path).run_numpy(x)[0], ref, rtol=1e-3, atol=1e-3)


class _CheckedInput(torch.nn.Module):
    """A data check written as transformers writes them (``torch._check`` on a tensor, RT-DETRv2)."""

    def forward(self, x):
        torch._check_tensor_all(x.abs() >= 0, lambda: "magnitudes are never negative")
        return x * 2


def test_a_data_check_on_a_tensor_leaves_nothing_in_the_file(tmp_path):
    # torch.onnx drops the assertion but kept the all-true test it reads, which it cannot translate
    path = export_onnx(_CheckedInput().eval(), SAMPLE, tmp_path / "checked.onnx")
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["Mul"]
    np.testing.assert_array_equal(ONNXModel(path)(SAMPLE.numpy()), SAMPLE.numpy() * 2)


class _InvertedMask(torch.nn.Module):
    """XLNet's ``1.0 - attention_mask`` on an integer mask, and an integer minus an integer mask."""

    def forward(self, mask, scale):
        return (1.0 - mask)[None] * scale, 3 - mask


def test_a_number_minus_an_integer_tensor_promotes_as_torch_does(tmp_path):
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    scale = torch.tensor(2.5)
    path = export_onnx(_InvertedMask().eval(), (mask, scale), tmp_path / "mask.onnx",
                       dynamic_axes={"input_0": {0: "batch", 1: "sequence"}})
    other = torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 0]])
    inverted, shifted = ONNXModel(path).run_numpy(other, scale)
    assert inverted.dtype == np.float32 and shifted.dtype == np.int64
    expected = _InvertedMask()(other, scale)
    np.testing.assert_array_equal(inverted, expected[0].numpy())
    np.testing.assert_array_equal(shifted, expected[1].numpy())
