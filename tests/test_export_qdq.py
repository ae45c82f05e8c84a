"""export_qdq end to end: real pt2e models, the real exporter, onnx.checker and ONNX Runtime."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
import torch
from torch import nn

from onnxport import (
    ONNXModel,
    Quantizer,
    compare_qdq,
    export_qdq,
    qdq_report,
    qdq_stats,
    quant_spec,
    verify_qdq,
)
from onnxport._checks import run
from onnxport.compare.quantized import VacuousCheckWarning
from onnxport.errors import InvalidArgumentError
from onnxport.exporters.translation import exporter_translates_pt2e, fallback_table
from tests.models import MobileNetV2Small, ResNet18, TinyTransformer, TwoInTwoOut, with_statistics

SAMPLE = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _opset(path) -> int:
    return next(e.version for e in onnx.load(str(path), load_external_data=False).opset_import if e.domain == "")


def _outputs(path, x, optimized):
    return run(path, {"input": x.numpy()}, optimized=optimized)


@pytest.fixture(scope="module")
def resnet_models():
    torch.manual_seed(0)
    model = ResNet18(num_classes=10).eval()
    calib = [torch.randn(4, 3, 32, 32) for _ in range(2)]
    return Quantizer().quantize(model, calib), Quantizer(qdq_placement="skip_conv_add").quantize(model, calib)


@pytest.fixture(scope="module")
def resnet_files(resnet_models, tmp_path_factory):
    q, q_skip = resnet_models
    out = tmp_path_factory.mktemp("qdq")
    return {
        "int8": export_qdq(q, SAMPLE, out / "int8.onnx"),
        "opset17": export_qdq(q, SAMPLE, out / "opset17.onnx", opset_version=17),
        "uint8": export_qdq(q, SAMPLE, out / "uint8.onnx", activation_dtype="uint8"),
        "skip": export_qdq(q_skip, SAMPLE, out / "skip.onnx"),
    }


def test_resnet18_acceptance_figures(resnet_files):
    stats = {k: qdq_stats(v) for k, v in resnet_files.items()}
    assert stats["int8"].n_per_channel == 21  # the seed's figure: weights per channel, biases float
    assert stats["int8"].n_nonzero_zero_point == 0 and stats["int8"].n_unquantized_conv_add == 0
    assert stats["skip"].n_unquantized_conv_add == 8
    u8 = stats["uint8"]
    assert u8.n_uint8 == u8.n_nonzero_zero_point == stats["int8"].n_quantize + (stats["int8"].n_dequantize - 21)
    assert u8.n_per_channel == 21
    assert stats["opset17"] == stats["int8"]
    assert sorted(p.name for p in resnet_files["int8"].parent.iterdir()) == [
        "int8.onnx", "opset17.onnx", "skip.onnx", "uint8.onnx"]


def test_opset17_declares_17_and_is_byte_identical_to_18(resnet_files):
    p17, p18 = resnet_files["opset17"], resnet_files["int8"]
    assert _opset(p17) == 17 and _opset(p18) == 18
    onnx.checker.check_model(str(p17), full_check=True)
    x = torch.randn(4, 3, 32, 32)
    assert [o.tobytes() for o in _outputs(p17, x, False)] == [o.tobytes() for o in _outputs(p18, x, False)]


def test_every_conv_has_kernel_shape_and_stripping_changes_nothing(resnet_files, tmp_path):
    model = onnx.load(str(resnet_files["int8"]))
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 20 and all(any(a.name == "kernel_shape" for a in n.attribute) for n in convs)
    report = qdq_report(resnet_files["int8"])
    assert report.missing_kernel_shape == () and not report.float_ops
    for n in convs:
        keep = [a for a in n.attribute if a.name != "kernel_shape"]
        del n.attribute[:]
        n.attribute.extend(keep)
    stripped = tmp_path / "stripped.onnx"
    onnx.save(model, str(stripped))
    x = torch.randn(4, 3, 32, 32)
    assert [o.tobytes() for o in _outputs(stripped, x, True)] == [o.tobytes() for o in _outputs(resnet_files["int8"], x, True)]


def test_file_carries_the_model_scales_exactly(resnet_models, resnet_files):
    from onnxport.inspection.checks import file_qparams, model_qparams

    q, _ = resnet_models
    assert file_qparams(ir.load(resnet_files["int8"])) == model_qparams(q)


def test_uint8_is_byte_identical_to_int8_unoptimised(resnet_files):
    x = torch.randn(4, 3, 32, 32)
    a = _outputs(resnet_files["uint8"], x, False)
    b = _outputs(resnet_files["int8"], x, False)
    assert [o.tobytes() for o in a] == [o.tobytes() for o in b]
    _outputs(resnet_files["uint8"], x, True)  # loads and runs at ORT's default level too


def test_agreement_with_pytorch_on_a_trained_classifier(trained, tmp_path):
    model, (x, y) = trained
    q = Quantizer().quantize(model, [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)])
    path = export_qdq(q, x[:8], tmp_path / "tiny.onnx", dynamic_batch=True)
    agreement = verify_qdq(q, path, x, n_batches=4)
    assert type(agreement) is float and agreement >= 0.99, agreement  # the seed's signature: a plain float
    comparison = compare_qdq(q, path, x[:64])
    out = comparison.outputs[0]
    assert out.top1_agreement >= 0.99 and out.cosine_similarity > 0.999
    assert out.output_scale is not None and out.max_error_in_steps is not None
    for batch in (1, 13):  # a symbolic batch runs at any size
        assert ONNXModel(path)(x[:batch]).shape == (batch, 4)


def test_mobilenet_and_transformer_export_at_opset_17(tmp_path):
    torch.manual_seed(0)
    # measured batch-norm statistics: with the initial ones its output is the same for every input
    mb = with_statistics(MobileNetV2Small(), (8, 3, 32, 32))
    qmb = Quantizer().quantize(mb, [torch.randn(4, 3, 32, 32)])
    path = export_qdq(qmb, torch.randn(4, 3, 32, 32), tmp_path / "mb.onnx", opset_version=17)
    stats = qdq_stats(path)
    assert stats.n_per_channel == 20 and _opset(path) == 17  # weights per channel; biases float (the seed's)
    assert compare_qdq(qmb, path, torch.randn(8, 3, 32, 32), n_batches=2).outputs[0].cosine_similarity > 0.99
    tf = TinyTransformer().eval()
    qtf = Quantizer().quantize(tf, [torch.randint(0, 100, (4, 16))])
    tokens = torch.randint(0, 100, (4, 16))
    ptf = export_qdq(qtf, tokens, tmp_path / "tf.onnx", opset_version=17)
    report = qdq_report(ptf)
    assert _opset(ptf) == 17
    assert sum(op.quantized for op in report.compute_ops if op.op_type in ("MatMul", "Gemm")) >= 13 + 4
    assert compare_qdq(qtf, ptf, tokens).outputs[0].cosine_similarity > 0.999


def test_two_inputs_two_outputs_dynamic(tmp_path):
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    sample = (torch.randn(4, 3, 8, 8), torch.randn(4, 6))
    q = Quantizer().quantize(model, [sample])
    path = export_qdq(q, sample, tmp_path / "two.onnx", dynamic_batch=True, input_names=["image", "features"],
                      output_names=["logits", "embedding"])
    runner = ONNXModel(path)
    assert runner.input_names == ["image", "features"] and runner.output_names == ["logits", "embedding"]
    logits, emb = runner(torch.randn(7, 3, 8, 8), torch.randn(7, 6))
    assert logits.shape == (7, 4) and emb.shape == (7, 16)
    comparison = compare_qdq(q, path, sample)
    assert [o.name for o in comparison.outputs] == ["logits", "embedding"]
    assert all(o.cosine_similarity > 0.99 for o in comparison.outputs)


def test_native_translation_is_used_and_the_fallback_agrees(resnet_models, tmp_path):
    from onnxport._core.capture import torch_program

    assert exporter_translates_pt2e()  # torch 2.13 + onnxscript 0.7 translate pt2e themselves
    q, _ = resnet_models
    kwargs = {"opset_version": 18, "input_names": ["input"], "output_names": ["output"], "axes": {}}
    native = torch_program(q, (SAMPLE,), **kwargs).model_proto
    ours = torch_program(q, (SAMPLE,), custom_translation_table=fallback_table(), **kwargs).model_proto
    feeds = {"input": SAMPLE.numpy()}
    assert [o.tobytes() for o in run(ours, feeds, optimized=False)] == [o.tobytes() for o in run(native, feeds, optimized=False)]
    assert qdq_stats(ours).as_dict() == qdq_stats(native).as_dict()


# -- refusals: a clear error, and nothing written ---------------------------------------------------
def test_torchao_dynamic_models_are_refused_naming_the_precision(guarded):
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    qd = Quantizer(backend="torchao", method="int8_dynamic").quantize(model)
    with pytest.raises(InvalidArgumentError, match="quantized torchao int8_dynamic W8Adyn.*backend='torchao'.*run time"):
        export_qdq(qd, torch.randn(2, 16), guarded)


def test_float_model_is_refused_with_a_pointer_to_export_onnx(guarded):
    with pytest.raises(InvalidArgumentError, match="carries no quantize/dequantize.*export_onnx"):
        export_qdq(nn.Linear(4, 2), torch.randn(2, 4), guarded)


def test_affine_model_refuses_uint8(guarded, resnet_models):
    torch.manual_seed(0)
    with pytest.warns(UserWarning):
        quantizer = Quantizer(symmetric=False)
    q = quantizer.quantize(TwoInTwoOut().eval(), [(torch.randn(4, 3, 8, 8), torch.randn(4, 6))])
    with pytest.raises(InvalidArgumentError, match="zero-points .* symmetric=False"):
        export_qdq(q, (torch.randn(4, 3, 8, 8), torch.randn(4, 6)), guarded, activation_dtype="uint8")


def test_dynamic_batch_needs_a_dynamic_capture(guarded):
    q = Quantizer().quantize(TwoInTwoOut().eval(), [(torch.randn(4, 3, 8, 8), torch.randn(4, 6))], dynamic_batch=False)
    with pytest.raises(InvalidArgumentError, match="dynamic_batch=True"):
        export_qdq(q, (torch.randn(4, 3, 8, 8), torch.randn(4, 6)), guarded, dynamic_batch=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"activation_dtype": "uint4"}, "activation_dtype must be 'int8'"),
        ({"opset_version": 12}, "opset_version must be an integer from 13"),
        ({"sample": "x"}, "sample must be a torch.Tensor"),
        ({"output_names": ["a", "b"]}, "output_names has 2 names"),
    ],
)
def test_bad_arguments(guarded, resnet_models, kwargs, message):
    args = {"model": resnet_models[0], "sample": SAMPLE, "output_path": guarded} | kwargs
    with pytest.raises(InvalidArgumentError, match=message):
        export_qdq(**args)


def test_verify_qdq_bad_batches_and_vacuous_warning(resnet_files, resnet_models):
    q, _ = resnet_models
    with pytest.raises(InvalidArgumentError, match="does not split into 3 equal batches"):
        verify_qdq(q, resnet_files["int8"], SAMPLE, n_batches=3)
    with pytest.raises(InvalidArgumentError, match="n_batches must be a positive integer"):
        verify_qdq(q, resnet_files["int8"], SAMPLE, n_batches=0)
    with pytest.raises(InvalidArgumentError, match="empty"):
        verify_qdq(q, resnet_files["int8"], SAMPLE[:0])
    constant = torch.zeros(4, 3, 32, 32)
    with pytest.warns(VacuousCheckWarning, match="vacuous"):
        assert verify_qdq(q, resnet_files["int8"], constant) == 1.0


def test_a_pt2e_model_without_a_record_is_exported(resnet_models, tmp_path):
    import copy

    from onnxport.quantize.spec import SPEC_ATTRIBUTE

    q = copy.deepcopy(resnet_models[0])
    q.__dict__.pop(SPEC_ATTRIBUTE, None)
    q.meta.pop(SPEC_ATTRIBUTE, None)
    assert quant_spec(q) is None  # made by "another quantizer"
    path = export_qdq(q, SAMPLE, tmp_path / "untagged.onnx")
    assert qdq_stats(path).n_per_channel == 21


def test_a_wide_head_past_the_exporters_folding_limit_is_exported_with_stored_parameters(tmp_path):
    """A language model's vocabulary-wide head: torch.onnx leaves its 32,000 zero-points as a
    Cast computed at run time, which the faithfulness check could not read (GPT-2 and Llama at
    real vocabulary sizes were refused)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32000)).eval()
    x = torch.randn(2, 4, 32)
    quantized = Quantizer().quantize(model, [x])
    path = export_qdq(quantized, x, tmp_path / "head.onnx", dynamic_batch=True)
    graph = onnx.load(str(path)).graph
    made_by = {o: n.op_type for n in graph.node for o in n.output}
    assert all(made_by.get(i) != "Cast" for n in graph.node if n.op_type == "DequantizeLinear" for i in n.input[1:])
    assert qdq_stats(path).n_per_channel == 2
    assert compare_qdq(quantized, path, torch.randn(3, 4, 32)).outputs[0].cosine_similarity > 0.9999


class _EfficientChannelAttention(nn.Module):
    """ECA (timm's ecaresnet): a Conv1d(1, 1, k) across the pooled channels gates the conv output;
    its weight is quantized per channel with a single channel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.eca = nn.Conv1d(1, 1, 3, padding=1, bias=False)

    def forward(self, x):
        y = self.conv(x)
        gate = torch.sigmoid(self.eca(y.mean((2, 3)).unsqueeze(1))).transpose(1, 2).unsqueeze(-1)
        return y * gate


@pytest.mark.parametrize("target", [None, "onnxruntime"])
def test_a_single_channel_per_channel_weight_is_carried_and_checked(tmp_path, target):
    # its one-element per-axis DequantizeLinear was not counted as per-channel in the file, so the
    # faithfulness check refused every model with ECA (8 of ecaresnet26t's 72 weights "missing")
    torch.manual_seed(0)
    model = _EfficientChannelAttention().eval()
    quantized = Quantizer(target=target).quantize(model, [torch.randn(4, 3, 8, 8) for _ in range(2)])
    path = export_qdq(quantized, torch.randn(2, 3, 8, 8), tmp_path / "eca.onnx", dynamic_batch=True)
    graph = onnx.load(str(path)).graph
    weights = {i.name: i for i in graph.initializer}
    one = [n for n in graph.node if n.op_type == "DequantizeLinear" and list(weights[n.input[1]].dims) == [1]
           if n.input[1] in weights]
    assert len(one) == 1 and onnx.numpy_helper.to_array(weights[one[0].input[0]]).shape == (1, 1, 3)
    assert compare_qdq(quantized, path, torch.randn(4, 3, 8, 8)).outputs[0].cosine_similarity > 0.999


class _UnreadHead(nn.Module):
    """A segmentation model's auxiliary head computed and dropped (DPT): its last op is a dropout,
    which fx keeps though nothing reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.auxiliary = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Dropout(0.1))

    def forward(self, x):
        self.auxiliary(x)
        return self.conv(x)


def test_a_branch_no_output_reads_is_no_part_of_the_files_promise(tmp_path):
    # the pt2e graph keeps the head's quantized conv, the file does not: its weights were counted
    # "missing" and DPT's INT8 file was refused
    torch.manual_seed(0)
    quantized = Quantizer().quantize(_UnreadHead().eval(), [torch.randn(4, 3, 8, 8) for _ in range(2)])
    assert sum(n.target is torch.ops.aten.dropout.default for n in quantized.graph.nodes) == 1
    path = export_qdq(quantized, torch.randn(2, 3, 8, 8), tmp_path / "head.onnx", dynamic_batch=True)
    graph = onnx.load(str(path)).graph
    assert sum(n.op_type == "Conv" for n in graph.node) == 1 and qdq_stats(path).n_per_channel == 1
    assert compare_qdq(quantized, path, torch.randn(4, 3, 8, 8)).outputs[0].cosine_similarity > 0.999
