"""ONNXModel, compare_onnx and verify_onnx."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxport import ONNXModel, compare_onnx, export_onnx, verify_onnx
from onnxport.errors import InvalidArgumentError
from tests.models import TwoInTwoOut


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    path = export_onnx(model, (torch.randn(2, 3, 8, 8), torch.randn(2, 6)),
                       tmp_path_factory.mktemp("two") / "two.onnx", input_names=["image", "features"])
    return model, path


def test_torch_in_torch_out_numpy_in_numpy_out(two):
    _, path = two
    runner = ONNXModel(path)
    image, feats = torch.randn(3, 3, 8, 8), torch.randn(3, 6)
    out_t = runner(image, feats)
    assert isinstance(out_t, tuple) and all(isinstance(t, torch.Tensor) for t in out_t)
    out_n = runner(image.numpy(), feats.numpy())
    assert all(isinstance(a, np.ndarray) for a in out_n)
    np.testing.assert_array_equal(out_t[0].numpy(), out_n[0])
    by_name = runner(features=feats, image=image)
    np.testing.assert_array_equal(by_name[1].numpy(), out_n[1])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda r: r(torch.randn(2, 3, 8, 8)), "Missing input.*features"),
        (lambda r: r(torch.randn(2, 3, 8, 8), torch.randn(2, 6), torch.randn(1)), "3 positional inputs"),
        (lambda r: r(torch.randn(2, 3, 8, 8), torch.randn(2, 6, dtype=torch.float64)), "'features' has dtype float64.*float32"),
        (lambda r: r(torch.randn(2, 3, 9, 8), torch.randn(2, 6)), r"'image' has shape \[2, 3, 9, 8\]"),
        (lambda r: r(torch.randn(2, 3, 8, 8), feats=torch.randn(2, 6)), "Unknown input 'feats'"),
        (lambda r: r([1.0], torch.randn(2, 6)), "'image' must be a torch.Tensor or numpy array"),
    ],
)
def test_bad_calls_name_the_input(two, call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call(ONNXModel(two[1]))


def test_repr_names_warmup_and_devices(two):
    runner = ONNXModel(two[1])
    assert "image: float['batch', 3, 8, 8]" in repr(runner)
    assert runner.warmup(2) is runner
    with pytest.raises(InvalidArgumentError, match="device must be"):
        ONNXModel(two[1], device="tpu")


def test_cuda_without_the_provider_is_an_error_not_a_cpu_fallback(two):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has the CUDA provider")
    with pytest.raises(InvalidArgumentError, match="CUDAExecutionProvider"):
        ONNXModel(two[1], device="cuda:0")


def test_compare_reports_which_output_disagrees(two):
    model, path = two
    sample = (torch.randn(4, 3, 8, 8), torch.randn(4, 6))
    assert verify_onnx(model, path, sample) is True  # the seed's signature: a plain bool
    changed = TwoInTwoOut().eval()
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        changed.head.bias += 0.5  # only the first output (logits) moves
    report = compare_onnx(changed, path, sample)
    assert not report.passed
    logits, embedding = report.outputs
    assert not logits.passed and logits.max_abs_error == pytest.approx(0.5, abs=1e-4)
    assert embedding.passed and embedding.max_abs_error < 1e-5
    assert "NO" in str(report)
    assert not verify_onnx(changed, path, sample)


def test_missing_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match="not an ONNX file"):
        ONNXModel(tmp_path / "nope.onnx")


def test_latency_is_measured_on_validated_inputs(two):
    runner = ONNXModel(two[1])
    ms = runner.latency_ms(torch.randn(2, 3, 8, 8), torch.randn(2, 6), repeat=3, warmup=1)
    assert isinstance(ms, float) and ms > 0
    with pytest.raises(InvalidArgumentError, match="Missing input"):
        runner.latency_ms(torch.randn(2, 3, 8, 8))


class _Offsets(torch.nn.Module):
    """Outputs near ±50 beside one near zero; ``offset`` moves only the one near zero."""

    def __init__(self, offset: float = 0.0):
        super().__init__()
        self.offset = offset

    def forward(self, x):
        total = x.sum(1)
        return torch.stack([50 + total, -50 + total, 1e-3 * total + self.offset], 1)


def test_tolerance_scales_with_the_outputs_magnitude(tmp_path):
    sample = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    path = export_onnx(_Offsets(), sample, tmp_path / "offsets.onnx")
    # 2e-4 next to values of 50 is float rounding's size (1e-5 of the output's largest magnitude
    # is 5e-4), though 20x numpy.allclose's atol: passes; 1e-2 does not
    near = compare_onnx(_Offsets(2e-4), path, sample)
    assert near.passed and near.outputs[0].max_abs_error == pytest.approx(2e-4, rel=0.05)
    assert not compare_onnx(_Offsets(1e-2), path, sample).passed
    # within ±1 the rule is numpy.allclose's: 2e-4 on an element near zero fails
    small = tmp_path / "small.onnx"
    export_onnx(torch.nn.Sequential(_Offsets(), torch.nn.Tanh()), sample * 0, small)
    assert not compare_onnx(torch.nn.Sequential(_Offsets(2e-4), torch.nn.Tanh()), small, sample * 0).passed
