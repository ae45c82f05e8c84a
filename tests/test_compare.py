"""The comparison model: runs give results that can be saved and compared later, strategies judge
each output, one report type answers ``bool``, ``str`` and ``as_dict``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from onnxport import (
    InvalidArgumentError,
    LayerReport,
    Quantizer,
    Report,
    RunResults,
    compare_layers,
    compare_onnx,
    compare_qdq,
    compare_runs,
    export_onnx,
    export_qdq,
    run_onnx,
    run_torch,
    verify_onnx,
)
from onnxport.compare import CosineAtLeast, Exact, ScaledAllclose, TopOneAtLeast, WithinFloor


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU())
        self.a = torch.nn.Linear(32, 5)
        self.b = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.a(h), self.b(h)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str, torch.Tensor]:
    torch.manual_seed(0)
    model = TwoHeads().eval()
    x = torch.randn(16, 12)
    path = str(tmp_path_factory.mktemp("compare") / "two.onnx")
    export_onnx(model, x[:1], path, input_names=["x"], output_names=["a", "b"], dynamic_batch=True)
    return model, path, x


def test_runs_saved_and_compared_later_give_the_same_report(exported, tmp_path) -> None:
    model, path, x = exported
    reference, got = run_torch(model, x), run_onnx(path, {"x": x})
    assert got.names == ["a", "b"] and reference.n_samples == got.n_samples == 16
    reference.save(tmp_path / "torch.npz")
    got.save(tmp_path / "ort.npz")
    later = compare_runs(RunResults.load(tmp_path / "ort.npz"), RunResults.load(tmp_path / "torch.npz"), ScaledAllclose())
    now = compare_runs(got, reference, ScaledAllclose())
    assert later.as_dict() == now.as_dict() and bool(later)
    assert later.runners == ("onnxruntime (default level)", "torch")
    loaded = RunResults.load(tmp_path / "ort.npz")
    assert all(np.array_equal(loaded.outputs[n], got.outputs[n]) for n in got.names)
    assert loaded.meta["file"] == path


def test_exact_and_per_output_tolerances(exported) -> None:
    _model, path, x = exported
    got = run_onnx(path, x)
    assert bool(compare_runs(got, got, Exact()))
    nudged = RunResults("nudged", {"a": got.outputs["a"], "b": got.outputs["b"] + 1e-3}, got.n_samples)
    report = compare_runs(nudged, got, Exact())
    assert [o.passed for o in report.outputs] == [True, False] and not report
    assert [o.name for o in report.failed()] == ["b"]
    # one output may have its own, looser, criterion
    loose = compare_runs(nudged, got, Exact(), per_output={"b": ScaledAllclose(atol=1e-2)})
    assert bool(loose) and "b: within atol 0.01" in loose.strategy
    with pytest.raises(InvalidArgumentError, match="per_output names \\['c'\\]"):
        compare_runs(nudged, got, Exact(), per_output={"c": Exact()})


def test_a_file_of_another_model_fails_every_strategy(exported, tmp_path) -> None:
    model, path, x = exported
    torch.manual_seed(1)
    other = TwoHeads().eval()
    other_path = str(tmp_path / "other.onnx")
    export_onnx(other, x[:1], other_path, input_names=["x"], output_names=["a", "b"], dynamic_batch=True)
    report = compare_onnx(model, other_path, x)
    assert isinstance(report, Report) and not report and report.passed is False
    assert not verify_onnx(model, other_path, x) and verify_onnx(model, path, x)
    assert "NO" in str(report)
    reference, got = run_torch(model, x), run_onnx(other_path, x)
    for strategy in (Exact(), ScaledAllclose(1e-2, 1e-2), CosineAtLeast(0.99), TopOneAtLeast(0.99)):
        assert not compare_runs(got, reference, strategy), strategy


def test_report_reads_and_saves(exported, tmp_path) -> None:
    model, path, x = exported
    report = compare_onnx(model, path, x, rtol=1e-3, atol=1e-5)
    assert report.rtol == 1e-3 and report.atol == 1e-5 and report.n_samples == 16
    assert [o.shape for o in report.outputs] == [(16, 5), (16, 3)]
    text = str(report)
    assert "within atol 1e-05" in text and "yes" in text
    saved = json.loads(report.save(tmp_path / "report.json").read_text())
    assert saved["passed"] is True and saved["outputs"][1]["name"] == "b"


def test_a_measurement_has_no_verdict_until_given_a_criterion(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6)).eval()
    x = torch.randn(32, 12)
    quantized = Quantizer(backend="pt2e", target="onnxruntime").quantize(model, [x[i : i + 8] for i in range(0, 32, 8)])
    path = str(tmp_path / "q.onnx")
    export_qdq(quantized, x[:8], path)
    measured = compare_qdq(quantized, path, x)
    assert measured.passed is None
    with pytest.raises(InvalidArgumentError, match="no verdict"):
        bool(measured)
    judged = compare_qdq(quantized, path, x, rounding_floor=True)
    assert judged.passed is not None and "rounding floor" in judged.strategy
    assert bool(judged) == all(o.within_floor for o in judged.outputs)
    # the same figures, judged again by another strategy, without running anything
    reference = run_torch(quantized, x, onnx_path=path)
    again = compare_runs(run_onnx(path, x), reference, WithinFloor(),
                         floors={o.name: o.rounding_floor for o in judged.outputs})
    assert [o.cosine_similarity for o in again.outputs] == pytest.approx([o.cosine_similarity for o in judged.outputs])
    layers = compare_layers(quantized, path, x)
    assert isinstance(layers, Report) and isinstance(layers, LayerReport)
    assert bool(layers) == (layers.first_divergence is None) and layers.as_dict()["passed"] == bool(layers)
    assert [o.name for o in layers.outputs] == [o.name for o in judged.outputs]


def test_bad_results_files_are_named(tmp_path) -> None:
    results = RunResults("r", {"y": np.zeros(3, np.float32)}, 3)
    with pytest.raises(InvalidArgumentError, match="ending in .npz"):
        results.save(tmp_path / "r.json")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        RunResults.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "plain.npz", y=np.zeros(3))
    with pytest.raises(InvalidArgumentError, match="not a file written by RunResults.save"):
        RunResults.load(tmp_path / "plain.npz")
    with pytest.raises(InvalidArgumentError, match="gave 1 outputs but"):
        compare_runs(results, RunResults("s", {"y": np.zeros(3), "z": np.zeros(3)}, 3))
    with pytest.raises(InvalidArgumentError, match="atol must be a number"):
        ScaledAllclose(atol=-1)
    assert not (tmp_path / "r.json").exists()
