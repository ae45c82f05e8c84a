"""Samples given by keyword (a dict), as Hugging Face models are called: every function takes
them, the files' inputs carry their names, and the model passed in is left as it was."""

from __future__ import annotations

import pytest
import torch

from onnxport import (
    ONNXModel,
    Quantizer,
    compare_layers,
    compare_onnx,
    compare_qdq,
    export_onnx,
    export_qdq,
    verify_qdq,
)
from onnxport.errors import InvalidArgumentError


class _Masked(torch.nn.Module):
    """``mask`` is the third parameter, after one that is left at its default (GPT-2's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, past=None, mask=None):
        y = torch.relu(self.proj(x))
        if mask is not None:
            y = y * mask.unsqueeze(-1)
        return self.head(y.sum(1))


def _batch(seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 5)
    mask[::2, -2:] = 0
    return {"x": torch.randn(n, 5, 8, generator=generator), "mask": mask}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return _Masked().eval()


def test_float_export_by_keyword_names_the_inputs_and_leaves_the_model_alone(model, tmp_path):
    path = export_onnx(model, _batch(0), tmp_path / "m.onnx")
    assert "forward" not in vars(model)  # the positional forward was only borrowed for the capture
    assert [i.name for i in ONNXModel(path).session.get_inputs()] == ["x", "mask"]
    assert compare_onnx(model, path, _batch(1)).passed
    assert compare_onnx(model, path, dict(reversed(_batch(1).items()))).passed  # fed to the file by name
    # the mask is used: a file that dropped it would agree with an unmasked call
    unmasked = {"x": _batch(1)["x"], "mask": torch.ones(4, 5)}
    assert not torch.allclose(model(**_batch(1)), model(**unmasked))
    assert compare_onnx(model, path, unmasked).passed


def test_quantized_by_keyword_through_every_function(model, tmp_path):
    quantized = Quantizer(target="onnxruntime").quantize(model, [_batch(s) for s in (2, 3)])
    sample = _batch(4)
    path = export_qdq(quantized, sample, tmp_path / "q.onnx", dynamic_batch=True)
    assert [i.name for i in ONNXModel(path).session.get_inputs()] == ["x", "mask"]
    reordered = {"mask": sample["mask"], "x": sample["x"]}  # matched by name, not by order
    assert compare_qdq(quantized, path, reordered).outputs[0].cosine_similarity >= 0.999
    assert compare_layers(quantized, path, sample).first_divergence is None
    assert verify_qdq(quantized, path, _batch(5, n=8)) >= 7 / 8  # two classes among the 8: not vacuous
    with pytest.raises(InvalidArgumentError, match=r"quantized with \['x', 'mask'\]"):
        export_qdq(quantized, {"x": sample["x"]}, tmp_path / "bad.onnx")
    assert not (tmp_path / "bad.onnx").exists()


def test_qat_by_keyword_trains_converts_and_exports_by_name(model, tmp_path):
    quantizer = Quantizer(method="qat", target="onnxruntime")
    prepared = quantizer.prepare(model, _batch(0))
    optimiser = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for seed in range(3):
        batch = _batch(10 + seed)
        loss = prepared(**batch).pow(2).mean()  # the trainable copy takes the same keywords
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    quantized = quantizer.convert(prepared)
    sample = {"mask": _batch(4)["mask"], "x": _batch(4)["x"]}  # another order than the capture's
    path = export_qdq(quantized, sample, tmp_path / "qat.onnx")
    assert [i.name for i in ONNXModel(path).session.get_inputs()] == ["x", "mask"]
    assert compare_qdq(quantized, path, sample).outputs[0].cosine_similarity >= 0.999
    # the names live on the converted model: a dict missing one is refused before anything is written
    with pytest.raises(InvalidArgumentError, match=r"quantized with \['x', 'mask'\]"):
        export_qdq(quantized, {"mask": sample["mask"]}, tmp_path / "bad.onnx")
    assert not (tmp_path / "bad.onnx").exists()


def test_bad_keyword_samples_are_refused_before_anything_is_written(model, tmp_path):
    with pytest.raises(InvalidArgumentError, match="leave the key out"):
        export_onnx(model, {"x": torch.randn(2, 5, 8), "mask": None}, tmp_path / "a.onnx")
    with pytest.raises(InvalidArgumentError, match="empty dict"):
        export_onnx(model, {}, tmp_path / "b.onnx")
    with pytest.raises(InvalidArgumentError, match="does not match"):
        Quantizer().quantize(model, [_batch(0), {"x": torch.randn(4, 5, 8)}])  # a batch without the mask
    from onnxport import sensitivity

    with pytest.raises(InvalidArgumentError, match=r"eval_data gives positional tuples but calibration_data gives "
                                                   r"the keyword inputs \['mask', 'x'\]"):
        sensitivity(model, [_batch(0)], [(torch.randn(4, 5, 8),)])
    assert not list(tmp_path.iterdir())


def test_the_sensitivity_search_reads_keyword_batches_in_any_key_order(model, tmp_path):
    """The search captures once from dicts and measures on dicts whose keys come in another order;
    the model it returns takes the same dicts in every function."""
    from onnxport import quantize_within_budget, sensitivity

    calibration = [_batch(0), _batch(1)]
    evaluation = [{"mask": b["mask"], "x": b["x"]} for b in (_batch(2), _batch(3))]
    ranking = sensitivity(model, calibration, evaluation, quantizer=Quantizer(target="onnxruntime"))
    assert sorted(name for name, _ in ranking) == ["head", "proj"]
    result = quantize_within_budget(model, calibration, evaluation, budget=0.5, quantizer=Quantizer(target="onnxruntime"))
    assert result.value >= 0.5 and result.latency["ms"] > 0
    sample = _batch(4)
    path = export_qdq(result.model, sample, tmp_path / "budget.onnx")
    assert compare_qdq(result.model, path, sample).outputs[0].cosine_similarity >= 0.999
    assert "forward" not in vars(model)  # the positional forward was only the capture's


@pytest.mark.parametrize("sample_kind", ["dict", "tuple"])
def test_the_axes_and_names_given_at_quantize_are_the_files(tmp_path, sample_kind):
    import onnx

    model = _Masked().eval()
    axes = {"x": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 1: "sequence"}}
    quantized = Quantizer(target="onnxruntime").quantize(model, [_batch(0), _batch(1)], dynamic_axes=axes)
    sample = _batch(2)
    path = export_qdq(quantized, sample if sample_kind == "dict" else (sample["x"], sample["mask"]),
                      tmp_path / "m.onnx")  # no dynamic_batch or dynamic_axes restated here
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert dims == {"x": ["batch", "sequence", 8], "mask": ["batch", "sequence"]}
    # without batch in dynamic_axes the seed's default holds: dynamic_batch=False keeps the sample's batch
    plain = Quantizer(target="onnxruntime").quantize(model, [_batch(0)], dynamic_axes={"x": {1: "sequence"},
                                                                                        "mask": {1: "sequence"}})
    graph = onnx.load(str(export_qdq(plain, sample, tmp_path / "p.onnx")), load_external_data=False).graph
    assert [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim][:2] == [4, "sequence"]
