"""The front door's ``timm:NAME`` source.

timm imports torchvision, and no torchvision build loads beside torch's CPU wheel (the one the
README's install and CI use): the export tests run where timm imports (torch's default build with
its torchvision, docs/testing.md says how); where it does not, the refusal is what is tested. The
argument checks run everywhere: they come before timm is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from onnxport import export_pretrained
from onnxport.errors import DependencyError, InvalidArgumentError


def _timm_imports() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - a torchvision built for another torch raises RuntimeError
        return False
    return True


TIMM = _timm_imports()
needs_timm = pytest.mark.skipif(not TIMM, reason="timm cannot be imported beside this torch (docs/testing.md)")


def _run(path: Path, pixels: torch.Tensor) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"pixel_values": pixels.numpy()})


@pytest.mark.parametrize(("source", "options", "message"), [
    ("timm:", {}, "names no model"),
    ("timm:hf-hub:timm/resnet18.a1_in1k", {}, "nothing is downloaded"),
    ("timm:resnet18", {"task": "fill-mask"}, "not one a timm model does"),
    ("timm:resnet18", {"weights": "no/such/weights.pth"}, "is not a file"),
    (".", {"weights": "weights.pth"}, "weights are read only for a 'timm:NAME' source"),
])
def test_bad_timm_arguments_are_named_before_anything_is_written(tmp_path: Path, source: str, options: dict,
                                                                 message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        export_pretrained(source, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(TIMM, reason="timm imports here: the export tests run instead")
def test_timm_that_cannot_be_imported_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DependencyError, match=r"needs timm.*torchvision built for this torch"):
        export_pretrained("timm:resnet18", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cli = subprocess.run([sys.executable, "-m", "onnxport.cli", "export", "timm:resnet18", "-o", str(tmp_path / "o")],
                         capture_output=True, text=True, check=False)
    assert cli.returncode == 5, cli.stderr
    assert "needs timm" in cli.stderr and not (tmp_path / "o").exists()


@needs_timm
def test_timm_classifier_file_computes_the_model_with_a_symbolic_batch(tmp_path: Path) -> None:
    import timm
    from timm.data import resolve_model_data_config

    torch.manual_seed(0)  # the random weights: the same seed builds the same model below
    result = export_pretrained("timm:test_vit", tmp_path / "out")
    torch.manual_seed(0)
    model = timm.create_model("test_vit").eval()
    assert result.task == "image-classification" and result.inputs == ["pixel_values"]
    assert result.outputs == ["logits"] and result.axes == {"pixel_values": {0: "batch"}}
    assert all(proof["passed"] for proof in result.proofs) and len(result.proofs) == 2
    pixels = torch.randn(3, *resolve_model_data_config(model)["input_size"])  # a batch the proofs did not use
    (logits,) = _run(result.path, pixels)
    with torch.no_grad():
        expected = model(pixels).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))
    record = json.loads((result.folder / "onnxport.json").read_text())
    data = resolve_model_data_config(model)
    assert record["preprocessing"]["mean"] == list(data["mean"])
    assert record["preprocessing"]["input_size"] == list(data["input_size"])
    assert record["source"] == "timm test_vit"


@needs_timm
def test_timm_weights_from_a_training_checkpoint_with_its_own_classes(tmp_path: Path) -> None:
    """A fine-tuned checkpoint (7 classes, saved by a DataParallel training loop) is read by timm's
    own reader; the file computes that model, not a fresh one."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=7).eval()
    checkpoint = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}
    torch.save(checkpoint, tmp_path / "checkpoint.pth")
    pixels = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        expected = model(pixels).numpy()

    # the README's command
    cli = subprocess.run([sys.executable, "-m", "onnxport.cli", "export", "timm:test_resnet", "-o", str(tmp_path / "out"),
                          "--weights", str(tmp_path / "checkpoint.pth")], capture_output=True, text=True, check=False)
    assert cli.returncode == 0, cli.stderr
    assert "outputs logits" in cli.stdout and "float floor" in cli.stdout
    (logits,) = _run(tmp_path / "out" / "model.onnx", pixels)
    assert logits.shape == (2, 7)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))

    # the embedding of the same checkpoint: the classifier's input, the head left out
    embedded = export_pretrained("timm:test_resnet", tmp_path / "emb", task="image-feature-extraction",
                                 weights=tmp_path / "checkpoint.pth")
    assert embedded.outputs == ["pooler_output"]
    (features,) = _run(embedded.path, pixels)
    with torch.no_grad():
        pooled = model.forward_head(model.forward_features(pixels), pre_logits=True).numpy()
    np.testing.assert_allclose(features, pooled, rtol=1e-4, atol=1e-4 * float(np.abs(pooled).max()))

    other = timm.create_model("test_vit", num_classes=7)
    torch.save(other.state_dict(), tmp_path / "vit.pth")
    with pytest.raises(InvalidArgumentError, match="do not fit this model"):
        export_pretrained("timm:test_resnet", tmp_path / "bad", weights=tmp_path / "vit.pth")
    assert not (tmp_path / "bad").exists()


@needs_timm
def test_timm_int8_calibrated_on_images_through_timms_own_transform(tmp_path: Path) -> None:
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):  # sizes unlike the model's: timm's transform resizes and crops them
        Image.fromarray(rng.integers(0, 256, (200 + 10 * i, 240, 3), dtype=np.uint8)).save(images / f"{i}.png")
    result = export_pretrained("timm:test_efficientnet", tmp_path / "out", quantize="int8", calibration=images)
    # six images of other sizes made one batch of the model's pixels: without timm's transform the
    # folder would be refused (it has no preprocessor_config.json)
    assert result.quantization is not None and result.quantization["calibration_batches"] == 1
    assert [proof["size"] for proof in result.proofs] == ["first calibration batch"] and result.proofs[0]["passed"]
    (logits,) = _run(result.path, torch.randn(2, 3, 160, 160))
    assert logits.shape == (2, 1000) and np.isfinite(logits).all()
    with pytest.raises(InvalidArgumentError, match="no model 'no_such_net'"):
        export_pretrained("timm:no_such_net", tmp_path / "none")


@needs_timm
def test_a_timm_model_in_memory_exports_as_it_computes_and_is_given_back_as_it_was(tmp_path: Path) -> None:
    """A model fine-tuned in memory (in training mode, with its own classes): the file computes its
    logits, or the input of its classifier, and the model keeps its weights and its mode."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_vit", num_classes=5).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = export_pretrained(model, tmp_path / "out")
    pooled = export_pretrained(model, tmp_path / "emb", task="image-feature-extraction")
    assert all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    pixels = torch.randn(3, 3, 160, 160)
    with torch.no_grad():
        model.eval()
        logits, features = model(pixels).numpy(), model.forward_head(model.forward_features(pixels), pre_logits=True)
    assert result.outputs == ["logits"] and pooled.outputs == ["pooler_output"]
    (got,) = _run(result.path, pixels)
    np.testing.assert_allclose(got, logits, rtol=1e-4, atol=1e-4 * float(np.abs(logits).max()))
    (got,) = _run(pooled.path, pixels)
    assert got.shape == (3, model.num_features)
    np.testing.assert_allclose(got, features.numpy(), rtol=1e-4, atol=1e-4 * float(features.abs().max()))
    record = json.loads((result.folder / "onnxport.json").read_text())
    assert record["source"] == "timm VisionTransformer given in memory" and record["preprocessing"]["input_size"]
