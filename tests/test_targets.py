"""Deployment presets: each file passes its own target's rules and runs as the target expects."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxport import (
    Quantizer,
    check_target,
    compare_layers,
    compare_qdq,
    export_qdq,
    qdq_report,
    quant_spec,
    verify_qdq,
)
from onnxport.errors import ExportRefusedError, InvalidArgumentError
from onnxport.inspection.stats import ort_int8_counts, ort_optimised_ops
from onnxport.targets import get_target
from tests.conftest import activation_products, listing
from tests.models import MobileNetV2Small, ResNet18, TinyTransformer

TARGETS = ("tensorrt", "onnxruntime", "qnn", "openvino")


class _PresetFiles(dict):
    """Each (model, target) file, exported the first time a test asks for it."""

    def __init__(self, out) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = out
        self.cases = {
            "resnet": (ResNet18(num_classes=10).eval(), torch.randn(4, 3, 32, 32)),
            "mobilenet": (MobileNetV2Small().eval(), torch.randn(4, 3, 32, 32)),
            "transformer": (TinyTransformer().eval(), torch.randint(0, 100, (4, 16))),
        }

    def __missing__(self, key):
        name, target = key
        model, sample = self.cases[name]
        q = Quantizer(target=target).quantize(model, [sample])
        self[key] = export_qdq(q, sample, self.out / f"{name}_{target}.onnx")
        return self[key]


@pytest.fixture(scope="module")
def preset_files(tmp_path_factory):
    return _PresetFiles(tmp_path_factory.mktemp("targets"))


def _preset_cases() -> list:
    """Every target on MobileNetV2 (convolutions, depthwise ones, residual adds) and the transformer;
    ResNet's residual network adds nothing to the rules but its size: its QNN and OpenVINO files
    are in the slow set (its ONNX Runtime and TensorRT files serve the tests below)."""
    slow = {("resnet", "qnn"), ("resnet", "openvino")}
    return [pytest.param(name, target, marks=pytest.mark.slow) if (name, target) in slow else (name, target)
            for name in ("resnet", "mobilenet", "transformer") for target in TARGETS]


@pytest.mark.parametrize(("name", "target"), _preset_cases())
def test_each_preset_passes_its_own_rules(preset_files, name, target):
    path = preset_files[name, target]
    assert check_target(path, target) == []
    opset = next(e.version for e in onnx.load(str(path)).opset_import if e.domain == "")
    assert opset == get_target(target).defaults.opset


@pytest.mark.parametrize("name, convs", [("resnet", 20), ("mobilenet", 19)])
def test_onnxruntime_preset_runs_every_conv_and_add_in_int8(preset_files, name, convs):
    counts = ort_int8_counts(preset_files[name, "onnxruntime"])
    assert counts["Conv"] == {"int8": convs, "float": 0}
    assert counts["Add"]["float"] == 0 and counts["Gemm"] == {"int8": 1, "float": 0}
    report = qdq_report(preset_files[name, "onnxruntime"])
    assert report.extra["ort_int8"]["Conv"]["int8"] == convs
    assert f"Conv {convs}/{convs}" in str(report)
    # the TensorRT file, read by ORT, keeps most convs in float: the reason presets exist
    assert ort_int8_counts(preset_files[name, "tensorrt"])["Conv"]["float"] > 0


class _SiluBlock(torch.nn.Module):
    """EfficientNet's pattern: conv → SiLU, and a squeeze-excite gate (sigmoid, product)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gate = torch.nn.Conv2d(8, 8, 1)
        self.head = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = torch.nn.functional.silu(self.conv(x))
        y = y * torch.sigmoid(self.gate(y.mean((2, 3), keepdim=True)))
        return self.head(y)


def test_onnxruntime_preset_runs_silu_and_sigmoid_gates_in_int8(tmp_path):
    model = _SiluBlock().eval()
    calibration = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    ours = Quantizer(target="onnxruntime").quantize(model, calibration)
    targets = [str(n.target) for n in ours.graph.nodes if n.op == "call_function"]
    assert "aten.silu.default" not in targets and targets.count("aten.sigmoid.default") == 2
    path = export_qdq(ours, calibration[0], tmp_path / "ort.onnx", dynamic_batch=True)
    ops = ort_optimised_ops(path)
    assert ops["QLinearSigmoid"] == 2 and ops["QLinearMul"] == 2 and ops["QLinearConv"] == 3
    assert not ops["Sigmoid"] and not ops["Mul"]
    # the squeeze mean is written as the global pool ORT runs on integers, not a float ReduceMean
    assert ops["QLinearGlobalAveragePool"] == 1 and not ops["ReduceMean"]
    assert compare_qdq(ours, path, torch.randn(8, 3, 8, 8)).outputs[0].cosine_similarity >= 0.999
    # and the report says which of them cost more quantized than in float: the SiLU and the gate
    costlier = qdq_report(path).extra["ort_costlier_than_float"]
    assert sorted(costlier.values()) == [1, 1] and any(k.startswith("SiLU") for k in costlier)
    assert any("squeeze-excite gate" in k for k in costlier)
    # the other presets keep the silu one op, unquantized: no pairs their consumers did not ask for
    trt = Quantizer(target="tensorrt").quantize(model, calibration)
    assert "aten.silu.default" in [str(n.target) for n in trt.graph.nodes if n.op == "call_function"]


def test_report_names_a_float_hardswish_between_pairs_and_nothing_in_a_relu_network(tmp_path, preset_files):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Hardswish(), torch.nn.Conv2d(8, 4, 1)).eval()
    calibration = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    path = export_qdq(quantized, calibration[0], tmp_path / "hardswish.onnx")
    report = qdq_report(path)
    assert list(report.extra["ort_costlier_than_float"].values()) == [1]
    assert "costlier quantized than in float on ORT's CPU: HardSwish in float" in str(report)
    assert qdq_report(preset_files["resnet", "onnxruntime"]).extra["ort_costlier_than_float"] == {}


def _onnxruntime_file(build, tmp_path, shape):
    """``build()``'s 'onnxruntime' pt2e model (seeded weights and calibration) and its file."""
    torch.manual_seed(0)
    model = build().eval()
    calibration = [torch.randn(4, *shape) for _ in range(2)]
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    return quantized, export_qdq(quantized, calibration[0], tmp_path / "ort.onnx", dynamic_batch=True)


class _LeakyResidual(torch.nn.Module):
    """CSPDarknet's residual block: conv → LeakyReLU twice, added to the block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.first = torch.nn.Conv2d(8, 8, 1)
        self.second = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = torch.nn.functional.leaky_relu(self.stem(x), 0.1)
        y = torch.nn.functional.leaky_relu(self.first(x), 0.1)
        return x + torch.nn.functional.leaky_relu(self.second(y), 0.1)


def test_onnxruntime_preset_runs_leaky_relu_and_the_add_after_it_in_int8(tmp_path):
    ours, path = _onnxruntime_file(_LeakyResidual, tmp_path, (3, 8, 8))
    ops = ort_optimised_ops(path)  # unannotated, the LeakyReLUs read by the Add ran in float, and the Add
    assert ops["QLinearLeakyRelu"] == 3 and ops["QLinearAdd"] == 1 and not ops["LeakyRelu"] and not ops["Add"], dict(ops)
    assert compare_qdq(ours, path, torch.randn(8, 3, 8, 8)).outputs[0].cosine_similarity >= 0.999


class _NormReluBlock(torch.nn.Module):
    """BiT's pattern: a ReLU after a GroupNorm (no conv before it to fuse with), read by a conv
    directly and through a zero pad and a max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.conv = torch.nn.Conv2d(8, 8, 1)
        self.padded = torch.nn.Conv2d(8, 8, 3, stride=2)

    def forward(self, x):
        y = torch.relu(self.norm(self.stem(x)))
        pooled = torch.nn.functional.max_pool2d(torch.nn.functional.pad(y, (1, 1, 1, 1)), 2)
        return self.conv(y) + self.padded(pooled).mean()


def test_onnxruntime_preset_gives_a_float_producers_relu_an_unsigned_range(tmp_path):
    # the export checks the target's rules: a ReLU feeding a QuantizeLinear whose range does not
    # start at 0 was refused here (ORT then keeps the ReLU in float, and the conv before it)
    quantized, path = _onnxruntime_file(_NormReluBlock, tmp_path, (3, 12, 12))
    graph = onnx.load(path).graph
    made_by = {o: n for n in graph.node for o in n.output}
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    after_relu = [n for n in graph.node if n.op_type == "QuantizeLinear" and made_by.get(n.input[0]) is not None
                  and made_by[n.input[0]].op_type in ("Relu", "MaxPool", "Pad")]
    assert after_relu and all(consts[q.input[2]].dtype == np.uint8 and consts[q.input[2]] == 0 for q in after_relu)
    assert not check_target(path, "onnxruntime")
    assert compare_qdq(quantized, path, torch.randn(8, 3, 12, 12)).outputs[0].cosine_similarity >= 0.999


class _DenseBlock(torch.nn.Module):
    """DenseNet's pattern: a ReLU'd stem, pooled, concatenated with a conv output that has no
    ReLU (signed), then a norm and ReLU before the next conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.grow = torch.nn.Conv2d(8, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(12)
        self.conv = torch.nn.Conv2d(12, 6, 1)

    def forward(self, x):
        stem = torch.nn.functional.max_pool2d(torch.relu(self.stem(x)), 2)
        features = torch.cat([stem, self.grow(stem)], 1)  # the unsigned input first
        return self.conv(torch.relu(self.norm(features)))


def test_onnxruntime_preset_keeps_a_relus_range_unsigned_when_it_meets_a_signed_tensor_in_a_concat(tmp_path):
    # one observer for the Concat and its inputs gave the stem's ReLU a range below 0 (a uint8
    # zero-point of 121 on timm's DenseNet-121), which the export refused
    quantized, path = _onnxruntime_file(_DenseBlock, tmp_path, (3, 12, 12))
    assert not check_target(path, "onnxruntime")
    graph = onnx.load(path).graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    concat = next(n for n in graph.node if n.op_type == "Concat")
    readers = [made_by[i] for i in concat.input]
    assert all(r.op_type == "DequantizeLinear" for r in readers)
    # each input keeps its producer's parameters: the ReLU's unsigned ones and the conv's signed ones
    assert sorted(int(consts[r.input[2]]) for r in readers) == [0, 128]
    ops = ort_optimised_ops(path)
    assert ops["QLinearConcat"] == 1 and ops["QLinearConv"] == 3 and not ops["Relu"]
    assert compare_qdq(quantized, path, torch.randn(8, 3, 12, 12)).outputs[0].cosine_similarity >= 0.999


class _GatedRelu(torch.nn.Module):
    """ReXNet's pattern: a squeeze-excite product, then ReLU6; and a ReLU after a max-pool of a
    conv output that no ReLU follows directly (signed)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.gate = torch.nn.Conv2d(8, 8, 1)
        self.mid = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.out = torch.nn.Conv2d(16, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        gated = torch.nn.functional.relu6(y * torch.sigmoid(self.gate(y.mean((2, 3), keepdim=True))))
        pooled = torch.relu(torch.nn.functional.max_pool2d(self.mid(gated), 2))
        return self.out(torch.cat([pooled, torch.nn.functional.max_pool2d(gated, 2)], 1))


def test_onnxruntime_preset_gives_a_relu_after_a_product_or_a_pool_an_unsigned_range(tmp_path):
    # both ReLUs shared the signed pair of what they read (zero-point 128), which the export refused
    quantized, path = _onnxruntime_file(_GatedRelu, tmp_path, (3, 12, 12))
    assert not check_target(path, "onnxruntime")
    graph = onnx.load(path).graph
    made_by = {o: n for n in graph.node for o in n.output}
    clip = next(n for n in graph.node if n.op_type == "Clip")
    assert made_by[clip.input[0]].op_type == "Mul"  # the ReLU6 is the product's epilogue: no pair between
    ops = ort_optimised_ops(path)
    assert not ops["Relu"] and not ops["Clip"] and ops["QLinearMul"] == 1 and ops["QLinearConv"] == 4, dict(ops)
    assert compare_qdq(quantized, path, torch.randn(8, 3, 12, 12)).outputs[0].cosine_similarity >= 0.999


class _PiecesAndUpsampling(torch.nn.Module):
    """Res2Net's channel split, a slice, and HRNet's nearest upsampling, each added to a conv output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.part = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.mix = torch.nn.Conv2d(8, 8, 1)
        self.down = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)

    def forward(self, x):
        first, second = torch.split(self.conv(x), 4, 1)
        y = torch.cat([first, self.part(first) + second], 1)
        y = self.mix(y) + torch.cat([y[:, 4:], y[:, :4]], 1)  # the channels rolled by two slices
        return torch.nn.functional.interpolate(self.down(y), scale_factor=2, mode="nearest") + y


def test_pieces_slices_and_nearest_upsampling_keep_their_inputs_pair_and_the_adds_run_in_int8(tmp_path):
    quantized, path = _onnxruntime_file(_PiecesAndUpsampling, tmp_path, (3, 8, 8))
    ops = ort_optimised_ops(path)
    # the pieces were float, so each Add beside them ran in float between a DQ and a Q
    assert ops["QLinearAdd"] == 3 and not ops["Add"] and ops["QLinearConv"] == 4, dict(ops)
    graph = onnx.load(path).graph
    made_by = {o: n for n in graph.node for o in n.output}
    scales = {t.name: float(numpy_helper.to_array(t)) for t in graph.initializer if not t.dims}
    moved = [n for n in graph.node if n.op_type in ("Split", "Slice", "Resize")]
    assert len(moved) == 4
    for node in moved:  # each reads and writes one pair: no requantization around data movement
        pair = {scales[made_by[node.input[0]].input[1]]}
        pair |= {scales[q.input[1]] for q in graph.node if q.op_type == "QuantizeLinear" and q.input[0] in node.output}
        assert len(pair) == 1, node.op_type
    assert compare_layers(quantized, path, torch.randn(2, 3, 8, 8)).first_divergence is None
    assert compare_qdq(quantized, path, torch.randn(8, 3, 8, 8)).outputs[0].cosine_similarity >= 0.999


class _Conv1D(torch.nn.Module):
    """transformers' GPT-2 projection: ``addmm(bias, x, w)`` with ``w`` stored (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 24) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(24) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, 16), self.weight).reshape(*x.shape[:-1], 24)


def test_addmm_weights_are_quantized_per_output_channel_and_run_as_qgemm(tmp_path):
    model = _Conv1D().eval()
    calibration = [torch.randn(2, 5, 16) for _ in range(2)]
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    (addmm,) = [n for n in quantized.graph.nodes if n.target == torch.ops.aten.addmm.default]
    weight = addmm.args[2]
    assert weight.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
    assert weight.args[3] == 1  # the (in, out) layout's output channels
    path = export_qdq(quantized, calibration[0], tmp_path / "m.onnx", dynamic_batch=True)
    ops = ort_optimised_ops(path)
    assert ops["QGemm"] == 1 and not ops["DequantizeLinear"]
    # the model's output is the layer's float result (QGemm writes it): no pair requantizes it
    assert [n.op_type for n in onnx.load(path).graph.node].count("QuantizeLinear") == 1  # the input's
    assert compare_qdq(quantized, path, torch.randn(4, 5, 16)).outputs[0].cosine_similarity >= 0.999
    other = export_qdq(Quantizer(target="qnn").quantize(model, calibration), calibration[0], tmp_path / "q.onnx")
    graph = onnx.load(other).graph
    gemm_out = next(n.output[0] for n in graph.node if n.op_type == "Gemm")
    assert any(n.op_type == "QuantizeLinear" and n.input[0] == gemm_out for n in graph.node)  # QNN's: quantized


class _HandWrittenLinear(torch.nn.Module):
    """transformers' Falcon projection: ``x @ self.weight.T`` on an (out, in) parameter, the bias
    added apart (or ``x @ w`` on an (in, out) one), read by a second such layer."""

    def __init__(self, transpose) -> None:
        super().__init__()
        self.transpose = transpose
        self.first = torch.nn.Parameter(torch.randn(32, 16) * 0.25)
        self.bias = torch.nn.Parameter(torch.randn(32) * 0.1)
        self.second = torch.nn.Parameter(torch.randn(8, 32) * 0.2)

    def forward(self, x):
        hidden = torch.relu(x @ self.transpose(self.first) + self.bias)
        return hidden @ self.transpose(self.second)


@pytest.mark.parametrize("transpose", [lambda w: w.T, lambda w: w.t(), lambda w: w.transpose(0, 1),
                                       lambda w: w.permute(1, 0)], ids=["T", "t", "transpose", "permute"])
def test_a_product_with_a_parameter_matrix_is_quantized_as_a_linear_layer(tmp_path, transpose):
    torch.manual_seed(0)
    model = _HandWrittenLinear(transpose).eval()
    calibration = [torch.randn(2, 6, 16) for _ in range(2)]
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    products = [n for n in quantized.graph.nodes if n.target == torch.ops.aten.matmul.default]
    assert len(products) == 2
    for product in products:
        weight = product.args[1]
        assert weight.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
        assert weight.args[3] == 1  # the product's (in, out) matrix: output channels on axis 1
    path = export_qdq(quantized, calibration[0], tmp_path / "m.onnx")
    report = qdq_report(path)
    assert report.extra["ort_int8"]["MatMul"] == {"int8": 2, "float": 0}
    assert ort_optimised_ops(path)["MatMulIntegerToFloat"] == 2
    # the second product is the model's output: nothing requantizes it
    graph = onnx.load(path).graph
    last = next(n for n in graph.node if n.output[0] == graph.output[0].name)
    assert last.op_type == "MatMul"
    assert compare_qdq(quantized, path, torch.randn(4, 6, 16), rounding_floor=True).outputs[0].within_floor


class _HandWrittenAttention(torch.nn.Module):
    """LeViT's and Swin's attention: ``softmax(q @ kᵀ · scale + bias) @ v``, no SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.bias = torch.nn.Parameter(torch.randn(4, 6, 6) * 0.1)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * 8 ** -0.5 + self.bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, 32))


class _JoinedHalves(torch.nn.Module):
    """CodeGen's rotary embedding: two halves computed in float (products with constants), joined,
    read by a product of two activations."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        joined = torch.cat([a * 0.5 - b * 0.25, b * 0.5 + a * 0.25], dim=-1)
        return joined @ joined.transpose(-2, -1)


def test_a_concat_nothing_reads_quantized_gets_no_pair(tmp_path):
    torch.manual_seed(0)
    model = _JoinedHalves().eval()
    calibration = [torch.randn(2, 6, 16) for _ in range(2)]
    quantized = Quantizer(target="onnxruntime").quantize(model, calibration)
    path = export_qdq(quantized, calibration[0], tmp_path / "m.onnx")
    graph = onnx.load(path).graph
    # the input's pair for the projection, nothing more: the halves are float, and so is the product
    assert [n.op_type for n in graph.node].count("QuantizeLinear") == 1
    assert not any(n.op_type == "DequantizeLinear" for n in graph.node
                   if any(r.op_type == "Concat" for r in graph.node if n.output[0] in r.input))
    assert compare_qdq(quantized, path, torch.randn(4, 6, 16), rounding_floor=True).outputs[0].within_floor
    # QNN runs a graph quantized end to end: its Concat keeps its pair
    qnn = export_qdq(Quantizer(target="qnn").quantize(model, calibration), calibration[0], tmp_path / "q.onnx")
    qnn_graph = onnx.load(qnn).graph
    concat = next(n for n in qnn_graph.node if n.op_type == "Concat")
    assert any(n.op_type == "QuantizeLinear" and n.input[0] == concat.output[0] for n in qnn_graph.node)


def test_products_of_two_activations_stay_float_for_onnxruntime_and_are_quantized_for_openvino(tmp_path):
    torch.manual_seed(0)
    model = _HandWrittenAttention().eval()
    calibration = [torch.randn(2, 6, 32) for _ in range(2)]
    check = torch.randn(4, 6, 32)
    for target, quantized_products in (("onnxruntime", 0), ("openvino", 2)):
        quantized = Quantizer(target=target).quantize(model, calibration)
        path = export_qdq(quantized, calibration[0], tmp_path / f"{target}.onnx")
        graph = onnx.load(path).graph
        stored = {t.name for t in graph.initializer}
        weights = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in stored}
        linear_names = {n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights}
        ops = qdq_report(path, ort=False).compute_ops
        products = [op for op in ops if op.name not in linear_names]
        linears = [op for op in ops if op.name in linear_names]
        assert len(products) == 2 and sum(op.quantized for op in products) == quantized_products, ops
        assert linears and all(op.quantized for op in linears)
        if not quantized_products:
            assert all("two activations" in op.why_float for op in products)
        assert compare_qdq(quantized, path, check, rounding_floor=True).outputs[0].within_floor


def test_presets_disagree_where_they_must(preset_files):
    assert check_target(preset_files["resnet", "onnxruntime"], "tensorrt")  # uint8: TensorRT refuses
    assert check_target(preset_files["resnet", "tensorrt"], "onnxruntime")  # int8 activations, ReLU kept
    assert check_target(preset_files["resnet", "tensorrt"], "qnn")


@pytest.mark.parametrize("target", TARGETS)
def test_each_preset_agrees_with_pytorch_on_the_trained_classifier(trained, tmp_path, target):
    model, (x, y) = trained
    q = Quantizer(target=target).quantize(model, [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)])
    assert quant_spec(q).target == target
    path = export_qdq(q, x[:8], tmp_path / "m.onnx", dynamic_batch=True)
    assert verify_qdq(q, path, x) >= 0.99


def test_qnn_a16w8_at_opset_21(tmp_path):
    torch.manual_seed(0)
    model = ResNet18(num_classes=10).eval()
    sample = torch.randn(4, 3, 32, 32)
    q = Quantizer(target="qnn", activation_bits=16).quantize(model, [sample])
    assert quant_spec(q).activation_bits == 16
    path = export_qdq(q, sample, tmp_path / "a16.onnx")
    report = qdq_report(path, ort=False)
    assert report.opset == 21 and report.zero_point_dtypes == {"int8": 21, "int32": 21, "uint16": 66}
    assert check_target(path, "qnn") == []


def test_export_refuses_a_file_that_breaks_its_target(tmp_path):
    torch.manual_seed(0)
    sample = torch.randn(4, 3, 32, 32)
    q = Quantizer(target="tensorrt").quantize(ResNet18(num_classes=10).eval(), [sample])
    previous = tmp_path / "m.onnx"
    previous.write_bytes(b"previous")
    before = listing(tmp_path)
    with pytest.raises(ExportRefusedError, match="breaks target 'tensorrt'.*unsigned"):
        export_qdq(q, sample, previous, activation_dtype="uint8")
    with pytest.raises(ExportRefusedError, match="opset 18"):
        export_qdq(q, sample, previous, opset_version=18)
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target": "coreml"}, "target must be one of 'tensorrt', 'onnxruntime', 'qnn', 'openvino'"),
        ({"target": "tensorrt", "symmetric": False}, "needs symmetric activations"),
        ({"activation_bits": 16}, "activation_bits must be 8, or 16 with target='qnn'"),
        ({"backend": "torchao", "method": "int8_weight_only", "target": "qnn"}, "pt2e preset"),
    ],
)
def test_bad_presets(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Quantizer(**kwargs)


# -- check_target on hand-built graphs that break each rule ------------------------------------------
def _model(nodes, inits, opset=18, out_shape=None):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _conv_graph(act_zp, act_dtype=np.int8, weight_zp=0, weight_dtype=np.int8, relu=False, kernel_shape=True,
                int32_bias=False, opset=18):
    inits = [_c("s", np.float32(0.1)), _c("z", act_dtype(act_zp)),
             _c("w", np.ones((2, 2, 1, 1), weight_dtype)), _c("ws", np.full(2, 0.1, np.float32)),
             _c("wz", np.full(2, weight_zp, weight_dtype))]
    nodes = [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0, name="dq_w")]
    conv_inputs = ["xd", "wd"]
    if int32_bias:
        inits += [_c("b", np.zeros(2, np.int32)), _c("bs", np.full(2, 0.01, np.float32))]
        nodes.append(helper.make_node("DequantizeLinear", ["b", "bs"], ["bd"], axis=0, name="dq_bias"))
        conv_inputs.append("bd")
    attrs = {"kernel_shape": [1, 1]} if kernel_shape else {}
    nodes += [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_x"),
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", **attrs),
    ]
    last = "c"
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["r"], name="relu"))
        last = "r"
    nodes += [helper.make_node("QuantizeLinear", [last, "s", "z"], ["yq"], name="q_y"),
              helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["y"], name="dq_y")]
    return _model(nodes, inits, opset)


def test_a_clean_tensorrt_graph_passes():
    assert check_target(_conv_graph(0, opset=17), "tensorrt") == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"act_zp": 3}, "non-zero zero-point"),
        ({"act_zp": 128, "act_dtype": np.uint8}, "unsigned"),
        ({"act_zp": 0, "opset": 18}, "opset 18"),
        ({"act_zp": 0, "kernel_shape": False}, "no kernel_shape"),
        ({"act_zp": 0, "int32_bias": True}, "int32 bias"),
    ],
)
def test_tensorrt_rules(kwargs, message):
    opset = kwargs.pop("opset", 17)
    problems = check_target(_conv_graph(opset=opset, **kwargs), "tensorrt")
    assert any(message in p for p in problems), problems


def test_onnxruntime_rules():
    assert check_target(_conv_graph(0, np.uint8, relu=True), "onnxruntime") == []
    int8 = check_target(_conv_graph(0), "onnxruntime")
    assert any("int8" in p and "activation_dtype='uint8'" in p for p in int8)
    kept_relu = check_target(_conv_graph(128, np.uint8, relu=True), "onnxruntime")
    assert any("Relu 'relu' feeds QuantizeLinear 'q_y'" in p for p in kept_relu)


def test_qnn_rules():
    assert check_target(_conv_graph(7, np.uint8), "qnn") == []
    assert any("signed" in p for p in check_target(_conv_graph(0), "qnn"))
    assert any("opset 21" in p for p in check_target(_conv_graph(7, np.uint16), "qnn"))
    assert check_target(_conv_graph(7, np.uint16, opset=21), "qnn") == []
    assert any("weight zero-point" in p for p in check_target(_conv_graph(7, np.uint8, weight_zp=1), "qnn"))
    assert any("UINT8" in p for p in check_target(_conv_graph(7, np.uint8, weight_dtype=np.uint8), "qnn"))
    with pytest.raises(InvalidArgumentError, match="target must be one of"):
        check_target(_conv_graph(0), "coreml")


@pytest.mark.parametrize("target, act_dtype, act_zp, const_dtype, const_zp", [
    ("qnn", np.uint8, 7, np.uint8, 7),  # QNN: the constant pair is uint8 like every activation
    ("onnxruntime", np.uint8, 128, np.int8, 0),  # ORT: the uint8 move leaves a constant's pair int8
])
def test_a_quantized_constant_that_is_no_weight_follows_neither_rule(target, act_dtype, act_zp, const_dtype, const_zp):
    """Transformers fold position tables and masks into constants that pt2e quantizes with the
    activation spec: Q(constant) -> DQ -> Add. Such a pair is neither a weight nor an activation."""
    model = _conv_graph(act_zp, act_dtype)
    g = model.graph
    g.initializer.extend([_c("table", np.ones((1, 2, 4, 4), np.float32)), _c("ts", np.float32(0.05)),
                          _c("tz", const_dtype(const_zp))])
    dq_y = next(n for n in g.node if n.name == "dq_y")
    dq_y.output[0] = "y_act"
    g.node.extend([helper.make_node("QuantizeLinear", ["table", "ts", "tz"], ["tq"], name="q_table"),
                   helper.make_node("DequantizeLinear", ["tq", "ts", "tz"], ["td"], name="dq_table"),
                   helper.make_node("Add", ["y_act", "td"], ["y"], name="add_table")])
    assert check_target(model, target) == []
    # the same integers stored as a weight the conv reads would break the weight rule
    assert any("wants int8 weights" in p for p in check_target(_conv_graph(act_zp, act_dtype, weight_dtype=np.uint8), target))


def test_a_static_text_file_keeps_every_linear_int8_in_ort(tmp_path):
    """With fixed shapes ORT fuses MatMul+Add into a float Gemm before its QDQ fusions; the
    'onnxruntime' preset writes the float-output linears (into a residual Add, into GELU) so that
    every linear stays INT8, at identical outputs."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, num_labels=3)).eval()
    ids = torch.randint(3, 300, (8, 32))
    quantized = Quantizer(backend="pt2e", target="onnxruntime").quantize(model, [ids[i : i + 1] for i in range(4)])
    path = export_qdq(quantized, ids[:1], tmp_path / "bert.onnx")  # the default: every shape fixed
    ops = ort_optimised_ops(path)
    assert ops["Gemm"] == 0 and ops["MatMul"] + ops["FusedMatMul"] == activation_products(path) == 2 * 2, ops
    assert ops["MatMulIntegerToFloat"] + ops["QGemm"] >= 2 * 6 + 2, ops  # 6 linears a layer, pooler, classifier
    assert all(o.within_floor for o in compare_qdq(quantized, path, ids, rounding_floor=True).outputs)
