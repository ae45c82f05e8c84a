"""Quantizer: our pt2e annotation, placements, QAT, torchao recipes and the precision record."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from onnxport import Quantizer, QuantSpec, precision_table, quant_spec
from onnxport.errors import ExportRefusedError, InvalidArgumentError
from onnxport.quantize.calibration import read_calibration
from tests.models import MobileNetV2Small, ResNet18, TinyTransformer, TwoInTwoOut

qd = torch.ops.quantized_decomposed
Q_OPS = (qd.quantize_per_tensor.default, qd.quantize_per_channel.default)
DQ_OPS = (qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default)


def _ops(model, target):
    return [n for n in model.graph.nodes if n.op == "call_function" and n.target == target]


def _is_dq(arg) -> bool:
    return isinstance(arg, torch.fx.Node) and arg.target in DQ_OPS


def _per_channel(model, dtype=torch.int8):
    """Per-channel DQ nodes of one stored type: int8 weights, or the int32 biases beside them."""
    return [n for n in _ops(model, qd.dequantize_per_channel.default) if n.args[6] == dtype]


def _zero_points(model):
    """Every zero-point a quantize/dequantize node of the converted graph uses."""
    zps = []
    for node in model.graph.nodes:
        if node.op != "call_function" or node.target not in Q_OPS + DQ_OPS:
            continue
        zp = node.args[2]
        if isinstance(zp, torch.fx.Node):  # per-channel zero-points live in an attribute
            zp = getattr(model, zp.target)
            zps.extend(int(v) for v in zp.reshape(-1))
        else:
            zps.append(int(zp))
    return zps


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return ResNet18(num_classes=10).eval()


@pytest.fixture(scope="module")
def resnet_calibration():
    torch.manual_seed(1)
    return [torch.randn(4, 3, 32, 32) for _ in range(2)]


@pytest.fixture(scope="module")
def q_resnet(resnet, resnet_calibration):
    return Quantizer().quantize(resnet, resnet_calibration)


@pytest.fixture(scope="module")
def q_resnet_skip(resnet, resnet_calibration):
    return Quantizer(qdq_placement="skip_conv_add").quantize(resnet, resnet_calibration)


def test_resnet18_every_conv_add_and_classifier_quantized(q_resnet):
    assert len(_per_channel(q_resnet)) == 21  # 20 convs + fc
    assert len(_per_channel(q_resnet, torch.int32)) == 0  # the seed's float biases, which TensorRT reads as they are
    for conv in _ops(q_resnet, torch.ops.aten.conv2d.default) + _ops(q_resnet, torch.ops.aten.linear.default):
        assert _is_dq(conv.args[0]) and conv.args[1].target == qd.dequantize_per_channel.default
        assert conv.args[1].args[3] == 0  # per output channel
    adds = _ops(q_resnet, torch.ops.aten.add_.Tensor)
    assert len(adds) == 8 and all(_is_dq(a.args[0]) and _is_dq(a.args[1]) for a in adds)
    assert set(_zero_points(q_resnet)) == {0}
    assert len(_ops(q_resnet, qd.quantize_per_tensor.default)) == 33


@pytest.mark.parametrize("target", ["onnxruntime", "qnn"])
def test_targets_that_read_int32_biases_get_them_rounded_in_the_model(resnet, resnet_calibration, target):
    """ONNX Runtime would round a float bias beside dequantized inputs to int32 itself (QNN reads
    int32 biases): the model rounds them first, at input scale x weight scale."""
    q = Quantizer(target=target).quantize(resnet, resnet_calibration)
    assert len(_per_channel(q, torch.int32)) == 21
    for conv in _ops(q, torch.ops.aten.conv2d.default) + _ops(q, torch.ops.aten.linear.default):
        bias = conv.args[2]
        assert bias.target == qd.dequantize_per_channel.default and bias.args[6] == torch.int32
        weight_scales, bias_scales = (getattr(q, n.args[1].target) for n in (conv.args[1], bias))
        input_scale = conv.args[0].args[1]
        torch.testing.assert_close(bias_scales, (weight_scales * input_scale).float(), rtol=1e-6, atol=0)


def test_skip_conv_add_leaves_the_8_residual_conv_edges_float(q_resnet_skip):
    adds = _ops(q_resnet_skip, torch.ops.aten.add_.Tensor)
    float_edges = [a for add in adds for a in add.args[:2] if not _is_dq(a)]
    assert len(float_edges) == 8
    assert all(e.target == torch.ops.aten.conv2d.default for e in float_edges)
    assert all(sum(_is_dq(a) for a in add.args[:2]) == 1 for add in adds)  # one addend still quantized
    assert len(_ops(q_resnet_skip, qd.quantize_per_tensor.default)) == 25
    assert quant_spec(q_resnet_skip).placement == "skip_conv_add"


def test_skip_conv_add_without_conv_add_edges_is_refused():
    with pytest.raises(InvalidArgumentError, match="found no conv→add edge.*qdq_placement='per_op'"):
        Quantizer(qdq_placement="skip_conv_add").quantize(TinyTransformer().eval(), [torch.randint(0, 100, (2, 16))])


def test_transformer_every_linear_and_matmul_quantized():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    q = Quantizer().quantize(model, [torch.randint(0, 100, (4, 16)) for _ in range(2)])
    linears = _ops(q, torch.ops.aten.linear.default)
    assert len(linears) == 13
    assert all(_is_dq(n.args[0]) and n.args[1].target == qd.dequantize_per_channel.default for n in linears)
    matmuls = _ops(q, torch.ops.aten.matmul.default)
    assert len(matmuls) == 4 and all(_is_dq(n.args[0]) and _is_dq(n.args[1]) for n in matmuls)
    tokens = torch.randint(0, 100, (3, 16))
    with torch.no_grad():
        cos = F.cosine_similarity(q(tokens).flatten(), model(tokens).flatten(), dim=0)
    assert cos > 0.98


def test_mobilenet_relu6_epilogue_and_residual_adds():
    torch.manual_seed(0)
    model = MobileNetV2Small().eval()
    q = Quantizer().quantize(model, [torch.randn(4, 3, 32, 32)])
    for hardtanh in _ops(q, torch.ops.aten.hardtanh_.default):
        conv = hardtanh.args[0]
        assert conv.target == torch.ops.aten.conv2d.default  # fused: no pair between conv and ReLU6
        assert all(u.target == qd.quantize_per_tensor.default for u in hardtanh.users)
    adds = _ops(q, torch.ops.aten.add.Tensor)
    assert len(adds) == 2 and all(_is_dq(a.args[0]) and _is_dq(a.args[1]) for a in adds)
    assert len(_per_channel(q)) == 20 and len(_per_channel(q, torch.int32)) == 0  # float biases: the seed's


class _Deconv(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 2, stride=2)
        self.conv = nn.Conv1d(6, 5, 3)
        self.conv3 = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.up(x))  # (B, 6, 8, 8)
        z = self.conv(y.flatten(2))  # (B, 5, 62)
        w = self.conv3(z.unsqueeze(1).reshape(z.shape[0], 1, 5, 62, 1).contiguous())
        return torch.cat([w.mean((1, 4)).flatten(1), z.flatten(1)], 1)


def test_conv_transpose_axis_1_conv1d_conv3d_and_per_tensor():
    model = _Deconv().eval()
    q = Quantizer().quantize(model, [torch.randn(2, 4, 4, 4)])
    deconv = _ops(q, torch.ops.aten.conv_transpose2d.input)[0]
    assert deconv.args[1].target == qd.dequantize_per_channel.default and deconv.args[1].args[3] == 1
    assert _ops(q, torch.ops.aten.conv1d.default)[0].args[1].args[3] == 0
    assert _ops(q, torch.ops.aten.conv3d.default)[0].args[1].target == qd.dequantize_per_channel.default
    cat = _ops(q, torch.ops.aten.cat.default)[0]
    assert all(_is_dq(t) for t in cat.args[0])
    per_tensor = Quantizer(qscheme="per_tensor").quantize(model, [torch.randn(2, 4, 4, 4)])
    assert not _ops(per_tensor, qd.dequantize_per_channel.default)
    assert quant_spec(per_tensor).qscheme == "per_tensor"


class _StringPadding(nn.Module):
    """Convs with string padding, as EfficientNet writes them: captured as ``conv*d.padding``."""

    def __init__(self) -> None:
        super().__init__()
        self.same = nn.Conv2d(3, 8, 3, padding="same")
        self.bn = nn.BatchNorm2d(8)
        self.valid = nn.Conv1d(8, 4, 3, padding="valid")

    def forward(self, x):
        y = F.silu(self.bn(self.same(x)))
        return self.valid(y.mean(dim=2))


def test_string_padding_convs_are_quantized_and_their_batch_norm_folded():
    q = Quantizer().quantize(_StringPadding().eval(), [torch.randn(2, 3, 8, 8)])
    for conv in (torch.ops.aten.conv2d.padding, torch.ops.aten.conv1d.padding):
        (node,) = _ops(q, conv)
        assert _is_dq(node.args[0]) and node.args[1].target == qd.dequantize_per_channel.default
    assert not _ops(q, torch.ops.aten.batch_norm.default)


def test_affine_activations_warn_and_carry_nonzero_zero_points(resnet, resnet_calibration):
    with pytest.warns(UserWarning, match="TensorRT"):
        quantizer = Quantizer(symmetric=False)
    q = quantizer.quantize(resnet, resnet_calibration)
    assert any(zp != 0 for zp in _zero_points(q))
    assert quant_spec(q).symmetric is False


def test_dynamic_batch_runs_at_two_batch_sizes(q_resnet):
    with torch.no_grad():
        assert q_resnet(torch.randn(1, 3, 32, 32)).shape == (1, 10)
        assert q_resnet(torch.randn(7, 3, 32, 32)).shape == (7, 10)


def test_fixed_batch_skips_other_sizes_with_a_warning(resnet):
    calib = [torch.randn(4, 3, 32, 32), torch.randn(3, 3, 32, 32)]
    with pytest.warns(UserWarning, match="1 calibration batch"):
        q = Quantizer().quantize(resnet, calib, dynamic_batch=False)
    assert q(torch.randn(4, 3, 32, 32)).shape == (4, 10)


def test_several_inputs_with_target_pairs():
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    calib = [((torch.randn(4, 3, 8, 8), torch.randn(4, 6)), torch.randint(0, 4, (4,))) for _ in range(3)]
    q = Quantizer().quantize(model, calib)
    logits, emb = q(torch.randn(2, 3, 8, 8), torch.randn(2, 6))
    assert logits.shape == (2, 4) and emb.shape == (2, 16)


def test_caller_model_is_not_modified(resnet, resnet_calibration):
    model = copy.deepcopy(resnet).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Quantizer().quantize(model, resnet_calibration)
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_trained_classifier_top1_agreement(trained):
    model, (x, y) = trained
    calib = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)]
    q = Quantizer().quantize(model, calib)
    with torch.no_grad():
        agreement = float((q(x).argmax(1) == model(x).argmax(1)).float().mean())
    assert agreement >= 0.98, agreement


@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_other_observers(trained, observer):
    model, (x, _) = trained
    q = Quantizer(observer=observer).quantize(model, [x[:128]])
    with torch.no_grad():
        agreement = float((q(x).argmax(1) == model(x).argmax(1)).float().mean())
    assert agreement >= 0.95 and quant_spec(q).observer == observer


# -- skip_activations ---------------------------------------------------------------------------
def test_skip_activations_leaves_the_module_output_float(resnet, resnet_calibration, q_resnet):
    q = Quantizer(skip_activations=["layer1.0.relu"]).quantize(resnet, resnet_calibration)
    assert len(_ops(q, qd.quantize_per_tensor.default)) < len(_ops(q_resnet, qd.quantize_per_tensor.default))
    relus = [n for n in _ops(q, torch.ops.aten.relu_.default) if "layer1.0.relu" in str(n.meta.get("nn_module_stack"))]
    assert relus and all(u.target not in Q_OPS for r in relus for u in r.users)
    assert len(_per_channel(q)) == 21  # weights still INT8
    assert quant_spec(q).skipped_modules == ("layer1.0.relu",)


def test_skip_activations_unknown_name_suggests(resnet, resnet_calibration):
    with pytest.raises(InvalidArgumentError, match="'layer1.0.rel'.*Did you mean 'layer1.0.relu'"):
        Quantizer(skip_activations=["layer1.0.rel"]).quantize(resnet, resnet_calibration)


def test_skip_activations_unobserved_name_points_to_the_observed_one(resnet, resnet_calibration):
    with pytest.raises(InvalidArgumentError, match="'layer1.0.conv1'.*name 'layer1.0.relu' instead"):
        Quantizer(skip_activations=["layer1.0.conv1"]).quantize(resnet, resnet_calibration)


# -- QAT -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_qat_round_trip(trained):
    model, (x, y) = trained
    quantizer = Quantizer(method="qat")
    prepared = quantizer.prepare(model, x[:8])
    opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    for i in range(0, 256, 64):
        loss = F.cross_entropy(prepared(x[i : i + 64]), y[i : i + 64])
        opt.zero_grad()
        loss.backward()
        opt.step()
    q = quantizer.convert(prepared)
    assert quant_spec(q).method == "qat" and quant_spec(q).has_qdq_form
    assert len(_ops(q, qd.dequantize_per_channel.default)) == 4
    with torch.no_grad():
        agreement = float((q(x).argmax(1) == model(x).argmax(1)).float().mean())
    assert agreement >= 0.95
    with pytest.raises(InvalidArgumentError, match="prepare"):
        quantizer.quantize(model, [x[:8]])


# -- torchao -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, dynamic", [("int8_weight_only", False), ("int4_weight_only", False), ("int8_dynamic", True)])
def test_torchao_recipes(method, dynamic):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 8)).eval()
    q = Quantizer(backend="torchao", method=method).quantize(model)
    x = torch.randn(4, 256)
    with torch.no_grad():
        assert F.cosine_similarity(q(x).flatten(), model(x).flatten(), dim=0) > 0.98
    spec = quant_spec(q)
    assert spec.backend == "torchao" and spec.method == method and spec.dynamic_activations is dynamic
    assert spec.has_qdq_form is not dynamic and spec.weight_only is not dynamic
    assert spec.group_size == (128 if method == "int4_weight_only" else None)
    assert quant_spec(pickle.loads(pickle.dumps(q))) == spec
    assert type(model[0].weight) is nn.Parameter  # the original stays float


# -- the record ----------------------------------------------------------------------------------
def test_record_contents_survive_deepcopy_and_pickle(q_resnet):
    spec = quant_spec(q_resnet)
    assert spec == QuantSpec(
        backend="pt2e", method="static", weight_bits=8, activation_bits=8, qscheme="per_channel",
        symmetric=True, placement="per_op", observer="histogram",
    )
    assert quant_spec(copy.deepcopy(q_resnet)) == spec
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation inside unpickling
        restored = pickle.loads(pickle.dumps(q_resnet))
    assert quant_spec(restored) == spec
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(restored(x), q_resnet(x))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.weight_bits = 4
    assert quant_spec(nn.Linear(2, 2)) is None


def test_qdq_form_reasons():
    int4 = Quantizer(backend="torchao", method="int4_weight_only").spec()
    assert int4.has_qdq_form and int4.qdq_opset == 21 and int4.qscheme == "per_group"
    assert Quantizer(backend="torchao", method="int8_weight_only").spec().qdq_opset == 21
    assert "run time" in Quantizer(backend="torchao", method="int8_dynamic").spec().qdq_refusal()
    assert Quantizer().spec().qdq_refusal() is None and Quantizer().spec().qdq_opset == 13
    table = precision_table()
    assert table.startswith("| backend |") and table.count("\n") == 8 and "int4_weight_only" in table
    dynamic = Quantizer(activations="dynamic").spec()
    assert dynamic.has_qdq_form and dynamic.dynamic_activations and dynamic.method == "dynamic"
    assert dynamic.weight_range == "portable" and "Adyn" in dynamic.describe()


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "tensorrt"}, "backend must be one of 'pt2e', 'torchao'"),
        ({"method": "dynamic"}, "method must be one of 'static', 'qat'"),
        ({"backend": "torchao"}, "needs a method"),
        ({"backend": "torchao", "method": "int2"}, "method must be one of 'int8_weight_only'"),
        ({"qscheme": "per_group"}, "qscheme must be one of 'per_channel', 'per_tensor'"),
        ({"observer": "kl"}, "observer must be one of 'histogram', 'minmax', 'percentile'"),
        ({"qdq_placement": "trt"}, "qdq_placement must be one of 'per_op', 'skip_conv_add'"),
        ({"skip_activations": "layer1"}, "skip_activations must be a list"),
    ],
)
def test_bad_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Quantizer(**kwargs)


def test_bad_calibration(resnet):
    with pytest.raises(InvalidArgumentError, match="calibration_dl is required"):
        Quantizer().quantize(resnet)
    with pytest.raises(InvalidArgumentError, match="yielded no batches"):
        Quantizer().quantize(resnet, [])
    with pytest.raises(InvalidArgumentError, match="batch 1 .* does not match"):
        Quantizer().quantize(resnet, [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)])
    with pytest.raises(InvalidArgumentError, match="first batch"):
        Quantizer().quantize(TwoInTwoOut().eval(), [torch.randn(2, 3, 8, 8)])
    with pytest.raises(InvalidArgumentError, match="max_calibration_samples"):
        Quantizer().quantize(resnet, [torch.randn(2, 3, 32, 32)], max_calibration_samples=0)


def test_calibration_cap_never_overshoots():
    data = [torch.randn(64, 3) for _ in range(4)]
    batches, names = read_calibration(data, nn.Linear(3, 2), limit=100)
    assert [b[0].shape[0] for b in batches] == [64, 36] and names is None  # positional batches


class _CountingImages(torch.utils.data.Dataset):
    """A data set that counts how many samples a loader pulled from it."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        self.reads += 1
        return torch.randn(3, 16, 16), index % 4


@pytest.mark.parametrize("cap, batch, reads, kept", [(8, 4, 8, [4, 4]), (6, 4, 8, [4, 2]), (3, 4, 4, [3])])
def test_capped_calibration_reads_no_batch_past_the_cap(cap, batch, reads, kept):
    data = _CountingImages(40)
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    batches, _ = read_calibration(loader, model, limit=cap, argument="calibration_dl")
    assert [b[0].shape[0] for b in batches] == kept
    assert data.reads == reads  # ceil(cap / batch) batches, never one more
    data.reads = 0
    Quantizer().quantize(model, loader, max_calibration_samples=cap)
    assert data.reads == reads


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_uncapturable_model_names_torch_export():
    with pytest.raises(ExportRefusedError, match="torch.export.*control flow"):
        Quantizer().quantize(_Untraceable(), [torch.randn(2, 4)])


def test_a_model_failing_on_its_inputs_is_told_about_the_inputs_not_control_flow():
    with pytest.raises(ExportRefusedError, match=r"indices.*calibration inputs \(\(2, 16\):float32\)") as caught:
        Quantizer().quantize(TinyTransformer().eval(), [torch.randn(2, 16)])  # float where token ids belong
    assert "control flow" not in str(caught.value)


def test_non_cpu_model_is_refused():
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(InvalidArgumentError, match="runs on the CPU.*meta"):
        Quantizer().quantize(model, [torch.randn(2, 4)])
    with pytest.raises(InvalidArgumentError, match="must be a torch.nn.Module"):
        Quantizer().quantize("model", [torch.randn(2, 4)])


def test_the_keyword_form_builds_a_typed_config_that_builds_the_same_quantizer_back():
    from typing import get_args

    from onnxport.quantize import PT2EConfig, TorchaoConfig
    from onnxport.quantize.config import TargetName
    from onnxport.targets import TARGETS

    assert set(get_args(TargetName)) == set(TARGETS)  # the type names every preset, and nothing else
    ort = Quantizer(target="onnxruntime", observer="minmax", float_layers=["fc"])
    assert ort.config == PT2EConfig(observer="minmax", float_layers=("fc",), target="onnxruntime",
                                    weight_range="portable", symmetric=True)
    assert Quantizer(activations="dynamic").config.activations == "dynamic"
    int4 = Quantizer(backend="torchao", method="int4_weight_only", group_size=32)
    assert int4.config == TorchaoConfig("int4_weight_only", qscheme="per_group", group_size=32)
    for quantizer in (ort, int4, Quantizer(activations="dynamic"), Quantizer(method="qat", symmetric=False)):
        again = Quantizer.from_config(quantizer.config)
        assert again.config == quantizer.config and again.spec() == quantizer.spec()
    with pytest.raises(InvalidArgumentError, match="config must be a PT2EConfig or a TorchaoConfig"):
        Quantizer.from_config({"method": "static"})  # type: ignore[arg-type]
