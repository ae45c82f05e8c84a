"""The model zoo (real transformers model code, small configs), every path on every model: the
float export at its default opset with a dynamic batch against PyTorch, and each deployment
preset's Q/DQ file against the pt2e model it came from; every file also runs in OpenVINO, which
must agree with ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
import transformers  # noqa: F401  a test dependency: missing, the suite must fail, not skip

from tests.conftest import activation_products, assert_faithful, families
from tests.zoo import LENGTHS, TOKENS, zoo

ZOO = {entry.name: entry for entry in zoo()}
SEQUENCE = {"input_ids": {0: "batch", 1: "sequence"}}


def _first(outputs) -> np.ndarray:
    return np.asarray(outputs[0] if isinstance(outputs, (list, tuple)) else outputs)


def _openvino(path, x: np.ndarray) -> np.ndarray:
    import openvino as ov

    # f32: OpenVINO's CPU plugin otherwise computes in bf16 where the processor has it; one thread:
    # with two, its fused residual convs answer differently from call to call on an AVX2 EPYC
    # (docs/targets.md)
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    return np.asarray(compiled([x])[compiled.outputs[0]])


def _assert_fusable(path) -> None:
    """The exporter's GELU (erf form) and rsqrt reach ONNX Runtime in forms it runs fused
    (Gelu/BiasGelu, SimplifiedLayerNormalization): none of their float pieces is left. A GELU
    that reads a DequantizeLinear (Whisper's conv stem) is written as ORT's own Gelu in an
    'onnxruntime' file, since ORT gives each reader of that input its own copy and no fusion
    would see one x."""
    from onnxport.inspection.stats import ort_optimised_ops

    ops = ort_optimised_ops(path)
    assert not ops["Erf"] and not ops["Reciprocal"], dict(ops)


# one of each kind by default: plain, depthwise and squeeze-excite convolutions, patch and window
# attention, an encoder, a decoder and audio frames (ConvNeXt, RegNet, DistilBERT, RoBERTa and GPT-2
# repeat these: -m slow)
@pytest.mark.parametrize("name", families(list(ZOO), by_default=("ResNet", "MobileNetV2", "EfficientNet", "ViT", "Swin",
                                                                 "BERT", "Llama", "Whisper encoder")))
def test_float_export_matches_torch_and_runs_the_same_in_openvino(tmp_path, name):
    from onnxport import ONNXModel, compare_onnx, export_onnx

    entry = ZOO[name]
    model, sample = entry.model(), entry.sample()
    # text models with a symbolic sequence too (by forward's name for the input, as users write
    # it), run shorter than traced, as traced and longer
    axes, lengths = (SEQUENCE, LENGTHS) if entry.kind == "tokens" else (None, (None,))
    path = export_onnx(model, sample, tmp_path / "model.onnx", dynamic_axes=axes)  # default opset 17, dynamic batch
    for length in lengths:
        report = compare_onnx(model, path, entry.sample(batch=3, seed=1, length=length), atol=1e-4, rtol=1e-3)
        assert report.passed, (length, str(report))
        other = entry.sample(batch=3, seed=2, length=length)
        ort_first = _first(ONNXModel(path)(other))
        ov_first = _openvino(path, other.numpy())
        assert ov_first.shape == ort_first.shape
        np.testing.assert_allclose(ov_first, ort_first, atol=1e-3, rtol=1e-3)
        # the comparisons mean something only if the model's output depends on its input
        assert np.ptp(ort_first, axis=0).max() > 1e-3 * max(1.0, np.abs(ort_first).max())
        if entry.kind != "audio":  # logits: the same class everywhere
            assert (ov_first.argmax(-1) == ort_first.argmax(-1)).all()
    _assert_fusable(path)


def test_whisper_encoder_frames_are_refused_by_its_line(tmp_path):
    """Whisper's encoder checks its frame count against a fixed length: the axis cannot be symbolic."""
    from onnxport import export_onnx
    from onnxport.errors import InvalidArgumentError

    entry = ZOO["Whisper encoder"]
    with pytest.raises(InvalidArgumentError, match=r"'input' axis 2 \('frames'\) to 32 \(at modeling_whisper\.py:\d+"):
        export_onnx(entry.model(), entry.sample(), tmp_path / "w.onnx",
                    dynamic_axes={"input_features": {0: "batch", 2: "frames"}})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_every_target_exports_agrees_with_its_pt2e_model_and_runs_in_openvino(tmp_path, name):
    """For each preset: Quantizer + export_qdq (its rules checked on the file inside the export);
    every layer of the file computes what the pt2e model computes from the same inputs; the whole
    file agrees with the model; OpenVINO loads and runs the file and picks the same classes."""
    from onnxport import ONNXModel, Quantizer, compare_layers, export_qdq

    entry = ZOO[name]
    model = entry.model()
    text = entry.kind == "tokens"
    # text models captured with a symbolic sequence, calibrated on two lengths
    calibration = [entry.sample(batch=4, seed=s, length=n if text else None) for s, n in ((10, 16), (11, 24))]
    check = entry.sample(batch=4, seed=3)
    for target in ("tensorrt", "onnxruntime", "qnn"):
        quantized = Quantizer(target=target).quantize(model, calibration, dynamic_axes=SEQUENCE if text else None)
        path = export_qdq(quantized, entry.sample(), tmp_path / f"{target}.onnx", dynamic_batch=True)
        layers = compare_layers(quantized, path, check)
        assert layers.first_divergence is None, (target, str(layers))
        # The 'onnxruntime' file as ORT deploys it on this CPU (portable weights: exact U8S8 with or
        # without VNNI); the others by their ONNX semantics, since ORT's CPU is not their consumer.
        # Random weights make a deep net chaotic, so the bound is the model's own one-ulp floor,
        # which both kinds of CPU meet; the per-layer check above carries the exact proof.
        assert_faithful(quantized, path, check)
        for length in LENGTHS if text else ():  # as faithful shorter and longer than traced, in both runtimes
            if length != TOKENS:
                other = entry.sample(batch=4, seed=4, length=length)
                assert_faithful(quantized, path, other)
                assert _openvino(path, other.numpy()).shape == _first(ONNXModel(path)(other)).shape
        if target == "onnxruntime":
            _assert_fusable(path)
        ort_first = _first(ONNXModel(path)(check))
        ov_first = _openvino(path, check.numpy())
        assert ov_first.shape == ort_first.shape
        if target != "onnxruntime":
            # TensorRT's and QNN's files keep int8 weights on [-127, 127] (their consumers are not
            # x86 CPUs); OpenVINO's U8S8 kernels saturate on them on x86 without VNNI (the zoo's
            # MobileNetV2 'tensorrt' file: OpenVINO picks ORT's class on 1 of 4 inputs there), so
            # only the portable file is held to agree on every CPU
            continue
        # OpenVINO's INT8 kernels round differently (a step apart already at the input's
        # quantization) and, for the same reason, drift further on a random-weight net
        cosine = float(np.dot(ov_first.ravel(), ort_first.ravel())
                       / (np.linalg.norm(ov_first) * np.linalg.norm(ort_first)))
        assert cosine >= 0.9, (target, cosine)
        if entry.kind != "audio":
            assert (ov_first.argmax(-1) == ort_first.argmax(-1)).mean() >= 0.75, target


def _with_mask(entry, batch: int, seed: int, by_name: bool):
    """``(input_ids, attention_mask)`` with the tail of every other row padded away; by keyword
    (a dict) when ``by_name``."""
    import torch

    ids = entry.sample(batch=batch, seed=seed)
    mask = torch.ones_like(ids)
    mask[::2, -5:] = 0
    return {"input_ids": ids, "attention_mask": mask} if by_name else (ids, mask)


@pytest.mark.slow
@pytest.mark.parametrize("name, by_name", [("BERT", False), ("GPT-2", True)])
def test_text_models_called_with_an_attention_mask_in_every_function(tmp_path, name, by_name):
    """As users call them: ``model(input_ids, attention_mask)`` or ``model(input_ids=…,
    attention_mask=…)``, padding included, in every function (the sensitivity search too). GPT-2
    takes ``past_key_values`` second, so its mask can only be given by keyword."""
    from onnxport import (
        ONNXModel,
        Quantizer,
        compare_layers,
        compare_onnx,
        export_onnx,
        export_qdq,
        qdq_report,
        sensitivity,
        verify_qdq,
    )
    from onnxport.inspection.stats import ort_optimised_ops

    entry = ZOO[name]
    model = entry.model()
    sample, check = _with_mask(entry, 2, 0, by_name), _with_mask(entry, 4, 3, by_name)
    fp32 = export_onnx(model, sample, tmp_path / "fp32.onnx")
    assert compare_onnx(model, fp32, check, atol=1e-4, rtol=1e-3).passed
    names = [i.name for i in ONNXModel(fp32).session.get_inputs()]
    assert names == (["input_ids", "attention_mask"] if by_name else ["input_0", "input_1"])
    quantized = Quantizer(target="onnxruntime").quantize(model, [_with_mask(entry, 4, s, by_name) for s in (10, 11)])
    path = export_qdq(quantized, sample, tmp_path / "qdq.onnx", dynamic_batch=True)
    assert [i.name for i in ONNXModel(path).session.get_inputs()] == names
    assert_faithful(quantized, path, check)
    assert verify_qdq(quantized, path, check) >= 0.75
    assert compare_layers(quantized, path, check).first_divergence is None
    # every linear layer in INT8; what ORT runs in float is attention's products, left so on purpose
    report = qdq_report(path)
    assert report.extra["ort_int8"]["MatMul"]["float"] == activation_products(path) > 0
    assert all("two activations" in op.why_float for op in report.float_ops), str(report)
    first_linear = next(n for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D"))
    ranking = sensitivity(model, [_with_mask(entry, 4, 10, by_name)], [check], quantizer=Quantizer(target="onnxruntime"),
                          layers=[first_linear])
    assert [name for name, _ in ranking] == [first_linear]
    for file in (fp32, path):  # every GELU runs as one fused kernel, in the float file and between pairs
        ops = ort_optimised_ops(file)
        assert not ops["Erf"] and ops["Gelu"] + ops["BiasGelu"] + ops["FastGelu"] >= 2, (file.name, ops)
    ids, mask = check.values() if by_name else check
    with_padding = _first(ONNXModel(path)(ids, mask))
    without = _first(ONNXModel(path)(ids, mask.clone().fill_(1)))
    assert not np.allclose(with_padding, without)  # the mask reaches the attention


@pytest.mark.parametrize("name", families(["GPT-2", "Llama"], by_default=("Llama",)))
def test_decoders_as_loaded_with_their_key_value_cache_on_export_without_it(tmp_path, name):
    """``from_pretrained`` leaves ``config.use_cache`` on, and the model then returns a ``Cache``
    object that torch.export cannot return: every function captures the whole-sequence graph
    without it, and the model keeps its setting."""
    from onnxport import Quantizer, compare_onnx, export_onnx, export_qdq

    entry = ZOO[name]
    model = entry.model()
    model.config.use_cache = True
    sample, check = _with_mask(entry, 2, 0, True), _with_mask(entry, 3, 3, True)
    fp32 = export_onnx(model, sample, tmp_path / "fp32.onnx")
    assert compare_onnx(model, fp32, check, atol=1e-4, rtol=1e-3).passed
    quantized = Quantizer(target="onnxruntime").quantize(model, [_with_mask(entry, 4, s, True) for s in (10, 11)])
    path = export_qdq(quantized, sample, tmp_path / "qdq.onnx", dynamic_batch=True)
    assert_faithful(quantized, path, check)
    assert model.config.use_cache is True
