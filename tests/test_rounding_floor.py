"""rounding_floor and compare_qdq(rounding_floor=True): the model against itself with its float
ops rounding an ulp differently, beside the file."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from onnxport import Quantizer, compare_qdq, export_qdq, rounding_floor
from onnxport.errors import InvalidArgumentError
from onnxport.rounding import perturbed_runs
from tests.models import ResNet18

SAMPLE = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3))
_QD = torch.ops.quantized_decomposed


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    model = ResNet18(num_classes=10).eval()
    return Quantizer(target="onnxruntime").quantize(model, [torch.randn(4, 3, 32, 32) for _ in range(2)])


class _ExactOps(nn.Module):
    """Only ops every runtime computes exactly: dequantization, views, data movement, ReLU, max."""

    def forward(self, x):
        q = torch.clamp(torch.round(x * 20), -128, 127).to(torch.int8)
        x = _QD.dequantize_per_tensor.default(q, 0.05, 3, -128, 127, torch.int8)
        x = torch.relu(torch.cat([x, x.flip(1)], 1))
        return x.amax(dim=-1).reshape(x.shape[0], -1)


class _Quantizes(nn.Module):
    def forward(self, x):
        q = _QD.quantize_per_tensor.default(x, 0.5, 0, -128, 127, torch.int8)
        return _QD.dequantize_per_tensor.default(q, 0.5, 0, -128, 127, torch.int8)


class _Sums(nn.Module):
    def forward(self, x):
        return (x.abs() * 1.1 + 0.5).sum(dim=(2, 3))  # positive terms: no cancellation to magnify an ulp


def _plain_and_perturbed(model, sample=SAMPLE):
    with torch.no_grad():
        plain = model(sample).numpy()
        return plain, perturbed_runs(model, [(sample,)], seeds=2, ulps=1.0)


def test_exact_ops_are_left_alone_and_arithmetic_is_perturbed_by_about_an_ulp():
    plain, runs = _plain_and_perturbed(_ExactOps())
    assert all(np.array_equal(plain, run[0]) for run in runs)
    plain, runs = _plain_and_perturbed(_Sums())
    first, second = runs[0][0], runs[1][0]
    assert not np.array_equal(plain, first) and not np.array_equal(first, second)  # each seed its own noise
    relative = np.abs(first / plain - 1)
    assert relative.max() < 8 * 2.0**-24 and relative.mean() > 0.1 * 2.0**-24


def test_a_quantizer_rounds_its_input_an_ulp_off_so_only_values_on_a_boundary_move():
    # ONNX divides by the scale where torch multiplies by its reciprocal: a value exactly halfway
    # between two steps may round either way; one a tenth of a step off may not
    halves = torch.arange(-40, 40, dtype=torch.float32).reshape(4, 20) * 0.5 + 0.25
    plain, runs = _plain_and_perturbed(_Quantizes(), halves)
    moved = np.mean(plain != runs[0][0])
    assert 0.05 < moved < 0.8 and np.abs(plain - runs[0][0]).max() == 0.5  # one step, at most
    plain, runs = _plain_and_perturbed(_Quantizes(), halves + 0.05)
    assert all(np.array_equal(plain, run[0]) for run in runs)


def test_floor_of_a_quantized_model_is_seeded_and_close_to_one(quantized):
    floors = rounding_floor(quantized, SAMPLE, seeds=2)
    assert len(floors) == 1 and len(floors[0]) == 2
    assert all(0.999 < c <= 1.0 for c in floors[0])
    assert rounding_floor(quantized, SAMPLE, seeds=2) == floors
    with torch.no_grad():
        plain = quantized(SAMPLE).numpy()
        perturbed = perturbed_runs(quantized, [(SAMPLE,)], seeds=1, ulps=1.0)[0][0]
    assert not np.array_equal(plain, perturbed)  # the float logits after the last pair move


def test_compare_qdq_puts_the_file_beside_the_floor_and_a_wrong_file_far_below_it(quantized, tmp_path):
    path = export_qdq(quantized, SAMPLE[:1], tmp_path / "m.onnx", dynamic_batch=True)
    plain = compare_qdq(quantized, path, SAMPLE)
    report = compare_qdq(quantized, path, SAMPLE, n_batches=2, rounding_floor=True, floor_seeds=2)
    out = report.outputs[0]
    assert plain.outputs[0].rounding_floor is None and "rounding floor" not in str(plain)
    assert len(out.rounding_floor) == 2 and "rounding floor" in str(report)
    assert out.cosine_similarity == pytest.approx(plain.outputs[0].cosine_similarity, abs=1e-12)
    assert out.cosine_similarity > min(out.rounding_floor) - 1e-3
    # the same file with one weight's scales doubled computes something else: far below the floor
    model = onnx.load(str(path))
    dequantize = next(n for n in model.graph.node if n.op_type == "DequantizeLinear"
                      and any(i.name == n.input[0] and i.data_type == onnx.TensorProto.INT8 for i in model.graph.initializer))
    scale = next(i for i in model.graph.initializer if i.name == dequantize.input[1])
    scale.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(scale) * 2, scale.name))
    onnx.save(model, str(tmp_path / "wrong.onnx"))
    wrong = compare_qdq(quantized, tmp_path / "wrong.onnx", SAMPLE, rounding_floor=True, floor_seeds=2).outputs[0]
    assert wrong.cosine_similarity < min(wrong.rounding_floor) - 0.01


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"seeds": 0}, "seeds must be a positive integer"), ({"seeds": True}, "seeds must be a positive integer"),
     ({"ulps": 0}, "ulps must be a positive number"), ({"ulps": "1"}, "ulps must be a positive number")],
)
def test_bad_floor_arguments(quantized, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        rounding_floor(quantized, SAMPLE, **kwargs)


def test_bad_compare_qdq_floor_arguments(quantized, tmp_path):
    with pytest.raises(InvalidArgumentError, match="rounding_floor must be True or False"):
        compare_qdq(quantized, tmp_path / "never.onnx", SAMPLE, rounding_floor="yes")
    with pytest.raises(InvalidArgumentError, match="seeds must be a positive integer"):
        compare_qdq(quantized, tmp_path / "never.onnx", SAMPLE, rounding_floor=True, floor_seeds=0)


def test_an_output_that_does_not_depend_on_the_input_is_reported_as_a_vacuous_comparison(quantized, tmp_path):
    from onnxport.compare.quantized import VacuousCheckWarning

    path = export_qdq(quantized, SAMPLE[:1], tmp_path / "m.onnx", dynamic_batch=True)
    # four different inputs, apart by far less than the input's quantization step: one output
    near = SAMPLE[:1] + 1e-6 * torch.randn(4, *SAMPLE.shape[1:], generator=torch.Generator().manual_seed(1))
    with pytest.warns(VacuousCheckWarning, match="nearly the same for every input"):
        assert compare_qdq(quantized, path, near).outputs[0].cosine_similarity == pytest.approx(1.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", VacuousCheckWarning)
        compare_qdq(quantized, path, SAMPLE)  # inputs that change the output: no warning
        # one input repeated (a second batch size grown from a batch of one) tells nothing either
        # way: its repeated output is not a sign of an output independent of its input
        compare_qdq(quantized, path, SAMPLE[:1].expand(3, -1, -1, -1).contiguous())
