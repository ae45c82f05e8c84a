"""sensitivity and quantize_within_budget on the trained test classifier, with one layer whose
quantization was made deliberately bad: a single weight 2000x its neighbours under per-tensor
weight quantization crushes every other weight of that layer onto a few steps."""

from __future__ import annotations

import pytest
import torch

from onnxport import Quantizer, quant_spec, quantize_within_budget, sensitivity
from onnxport.debug.sensitivity import score
from onnxport.errors import InvalidArgumentError

PER_TENSOR = Quantizer(qscheme="per_tensor")


@pytest.fixture(scope="module")
def spoiled(trained):
    model, (x, _) = trained
    model = __import__("copy").deepcopy(model)
    with torch.no_grad():
        model.conv3.weight[0, 0, 1, 1] *= 2000.0
    calibration = [x[i:i + 32] for i in range(0, 128, 32)]
    return model, calibration, [x[200:328]]


def test_the_spoiled_layer_ranks_first(spoiled):
    model, calibration, evaluation = spoiled
    ranking = sensitivity(model, calibration, evaluation, quantizer=PER_TENSOR)
    assert next(name for name, _ in ranking) == "conv3"
    assert {name for name, _ in ranking} == {"conv1", "conv2", "conv3", "fc"}
    assert ranking[0][1] > 10 * max(abs(gain) for _, gain in ranking[1:])
    top1 = sensitivity(model, calibration, evaluation, quantizer=PER_TENSOR, metric="top1", layers=["conv3", "conv1"])
    assert next(name for name, _ in top1) == "conv3"


def test_the_budget_keeps_fewer_layers_float_than_the_first_n(spoiled):
    model, calibration, evaluation = spoiled
    result = quantize_within_budget(model, calibration, evaluation, budget=0.99, quantizer=PER_TENSOR)
    assert result.fully_quantized_value < 0.99 <= result.value
    assert result.float_layers == ("conv3",) and quant_spec(result.model).float_layers == ("conv3",)
    assert "conv3" in str(result) and result.trials == 1 + 4 + 1  # full, one per layer, then k = 1 meets it
    reference = model(evaluation[0]).detach()
    order = ["conv1", "conv2", "conv3", "fc"]  # the naive choice: the first N layers in model order
    naive = next(n for n in range(1, 5) if score(reference, Quantizer(qscheme="per_tensor", float_layers=order[:n])
                                                   .quantize(model, calibration)(evaluation[0]).detach(), "cosine") >= 0.99)
    assert naive > len(result.float_layers)
    # the float layer really is float in the model: one weight fewer is quantized
    def weight_quantizers(quantized):
        return sum(1 for n in quantized.graph.nodes if n.op == "call_function" and "dequantize_per" in str(n.target)
                   and getattr(n.args[0], "op", None) == "get_attr"  # weights are stored quantized
                   and n.args[-1] != torch.int32)  # the int32 biases beside them are not weights

    assert weight_quantizers(result.model) == weight_quantizers(PER_TENSOR.quantize(model, calibration)) - 1


def test_a_ranking_is_reused_instead_of_measured_again(spoiled):
    model, calibration, evaluation = spoiled
    ranking = sensitivity(model, calibration, evaluation, quantizer=PER_TENSOR)
    result = quantize_within_budget(model, calibration, evaluation, budget=0.99, quantizer=PER_TENSOR, ranking=ranking)
    assert result.float_layers == ("conv3",) and result.trials == 2  # full, then the choice


def test_a_budget_nothing_meets_is_refused_clearly(spoiled):
    model, calibration, evaluation = spoiled
    with pytest.raises(InvalidArgumentError, match=r"No set of float layers meets the budget.*max_float_layers"):
        quantize_within_budget(model, calibration, evaluation, budget=0.9999999, quantizer=PER_TENSOR, max_float_layers=1)


def test_bad_arguments(spoiled):
    model, calibration, evaluation = spoiled
    with pytest.raises(InvalidArgumentError, match="metric must be one of"):
        sensitivity(model, calibration, evaluation, metric="mse")
    with pytest.raises(InvalidArgumentError, match="budget must be a number"):
        quantize_within_budget(model, calibration, evaluation, budget=2)
    with pytest.raises(InvalidArgumentError, match="float_layers names 'conv9'.*Did you mean"):
        sensitivity(model, calibration, evaluation, layers=["conv9"])
    with pytest.raises(InvalidArgumentError, match="float_layers must be a list"):
        Quantizer(float_layers="conv1")
    with pytest.raises(InvalidArgumentError, match="quantizer must be a Quantizer"):
        sensitivity(model, calibration, evaluation, quantizer=Quantizer(backend="torchao", method="int8_weight_only"))


@pytest.mark.parametrize("need, limit", [(1, 54), (13, 54), (54, 54), (7, 7), (None, 20)])
def test_the_fewest_float_layers_are_found_in_logarithmic_trials(need, limit):
    from onnxport.debug.sensitivity import _fewest

    calls = []

    def measure(k):
        calls.append(k)
        return (1.0 if need is not None and k >= need else 0.5), f"model with {k}"

    found = _fewest(measure, limit, budget=0.9)
    if need is None:
        assert found is None
    else:
        assert found == (need, 1.0, f"model with {need}")
    assert len(calls) <= 2 * max(1, limit).bit_length() + 1 and len(set(calls)) == len(calls)


def test_with_a_target_the_result_reports_its_onnx_runtime_latency(spoiled):
    model, calibration, evaluation = spoiled
    result = quantize_within_budget(model, calibration, evaluation, budget=0.5, quantizer=Quantizer(target="onnxruntime"))
    assert result.float_layers == () and result.trials == 1  # fully quantized already meets this budget
    assert result.latency["ms"] > 0 and result.latency["fp32_ms"] > 0
    assert result.latency["speedup_vs_fp32"] == pytest.approx(result.latency["fp32_ms"] / result.latency["ms"])
    assert "ONNX Runtime:" in str(result)
