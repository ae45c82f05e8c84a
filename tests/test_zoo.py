"""The model zoo (real transformers model code, small configs): the float path on every model —
export_onnx at its default opset with a dynamic batch, compare_onnx against the PyTorch model,
and the file loaded and run by both ONNX Runtime and OpenVINO with the same result."""

from __future__ import annotations

import numpy as np
import pytest

from tests.zoo import zoo

pytest.importorskip("transformers")
ZOO = {entry.name: entry for entry in zoo()}


@pytest.mark.parametrize("name", list(ZOO))
def test_float_export_matches_torch_and_runs_the_same_in_openvino(tmp_path, name):
    import openvino as ov

    from onnxport import ONNXModel, compare_onnx, export_onnx

    entry = ZOO[name]
    model, sample = entry.model(), entry.sample()
    path = export_onnx(model, sample, tmp_path / "model.onnx")  # default opset 17, dynamic batch
    report = compare_onnx(model, path, entry.sample(batch=3, seed=1), atol=1e-4, rtol=1e-3)
    assert report.passed, str(report)
    other = entry.sample(batch=3, seed=2)
    ort_outputs = ONNXModel(path)(other)
    ort_first = np.asarray(ort_outputs[0] if isinstance(ort_outputs, (list, tuple)) else ort_outputs)
    # f32: OpenVINO's CPU plugin otherwise computes in bf16 where the processor has it
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ov_first = np.asarray(compiled([other.numpy()])[compiled.outputs[0]])
    assert ov_first.shape == ort_first.shape
    np.testing.assert_allclose(ov_first, ort_first, atol=1e-3, rtol=1e-3)
    if entry.kind != "audio":  # logits: the same class everywhere
        assert (ov_first.argmax(-1) == ort_first.argmax(-1)).all()



@pytest.mark.slow
@pytest.mark.parametrize("name", ["BERT", "GPT-2", "Llama", "Whisper encoder"])
@pytest.mark.parametrize("target", ["onnxruntime", "qnn"])
def test_transformers_meet_the_onnxruntime_and_qnn_targets(tmp_path, name, target):
    """Transformer graphs hold constants pt2e quantizes with the activation spec (position
    tables, masks): the target's rules must hold on the file and the file must agree with its
    pt2e model."""
    from onnxport import Quantizer, compare_qdq, export_qdq

    entry = ZOO[name]
    model = entry.model()
    quantized = Quantizer(target=target).quantize(model, [entry.sample(batch=4, seed=s) for s in (10, 11)])
    path = export_qdq(quantized, entry.sample(), tmp_path / "model.onnx", dynamic_batch=True)  # check_target inside
    first = compare_qdq(quantized, path, entry.sample(batch=4, seed=3)).outputs[0]
    assert first.cosine_similarity >= 0.999, first
