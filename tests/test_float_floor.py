"""Float proofs bounded by the model's own float floor: its float64 run is the reference, its
float32 run's distance from that the floor, and a file passes within FLOAT_FLOOR_MULTIPLE of it.

Real models, the real exporter, ONNX Runtime's own runs. The right files are judged by a bound that
the model and the CPU at hand set; the planted defects are ones an exporter or a hand edit makes.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from onnxport import compare_onnx, export_onnx, verify_onnx
from onnxport.compare.exported import FLOAT_FLOOR_MULTIPLE
from onnxport.errors import InvalidArgumentError, VacuousCheckWarning, WeakerCheckWarning
from tests.models import ResNet18, TinyTransformer, with_statistics


def _file_of(model: nn.Module, sample, path) -> str:
    return str(export_onnx(model, sample, path))


def test_a_deep_cnn_at_real_size_is_within_its_floor(tmp_path):
    torch.manual_seed(0)
    model = with_statistics(ResNet18(num_classes=1000), (2, 3, 224, 224))
    x = torch.randn(2, 3, 224, 224)
    report = compare_onnx(model, _file_of(model, x, tmp_path / "r18.onnx"), x, rounding_floor=True)
    out = report.outputs[0]
    assert report.passed, str(report)
    # the floor is the model's float32 run against its float64 run: not zero, and ORT's distance is of its order
    assert 0 < out.float_floor < 1e-4 and out.float_distance > 0
    assert out.floor_ratio <= FLOAT_FLOOR_MULTIPLE
    assert report.tolerances == {"float_floor_multiple": FLOAT_FLOOR_MULTIPLE}
    text = str(report)
    assert "float64 run as the reference" in text and "distance" in text and "ratio" in text


def _broken(model: nn.Module, change) -> nn.Module:
    broken = copy.deepcopy(model).eval()
    change(broken)
    return broken


def _largest_weight_through_bfloat16(model: nn.Module) -> None:
    weight = max((p for p in model.parameters() if p.dim() >= 2), key=lambda p: float(p.detach().abs().max()))
    with torch.no_grad():
        weight.copy_(weight.to(torch.bfloat16).float())


def _layer_norm_epsilon(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = 1e-3


def _tanh_gelu(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.GELU):
            module.approximate = "tanh"



@pytest.mark.parametrize("opset", [17, 21])
def test_a_group_norm_over_a_large_group_stays_on_its_floor(tmp_path, opset):
    """GroupNorm(1, C) (PoolFormer, ConvNeXt-style GN nets) normalises C×H×W values at once. torch.onnx
    writes it as an InstanceNormalization (from opset 21 a GroupNormalization), whose ONNX Runtime
    kernels sum in float32: 28x (9.5x) the floor on this block (AVX2 EPYC). The exporter writes it as a
    LayerNormalization, which sums in double."""
    import onnx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(1, 64), nn.GELU(),
                          nn.Conv2d(64, 64, 1), nn.GroupNorm(1, 64)).eval()
    x = torch.randn(1, 3, 56, 56) * 2 + 1
    path = str(export_onnx(model, x, tmp_path / "gn.onnx", opset_version=opset))
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count("LayerNormalization") == 2 and not {"InstanceNormalization", "GroupNormalization"} & set(ops)
    report = compare_onnx(model, path, x, rounding_floor=True)
    assert report.passed and report.outputs[0].floor_ratio <= 2, str(report)

@pytest.mark.parametrize("defect", [_largest_weight_through_bfloat16, _layer_norm_epsilon, _tanh_gelu],
                         ids=["bfloat16 weight", "layernorm epsilon", "tanh gelu"])
def test_planted_defects_fail_the_floor(tmp_path, defect):
    torch.manual_seed(0)
    model, tokens = TinyTransformer().eval(), torch.randint(0, 100, (8, 16))
    right = compare_onnx(model, _file_of(model, tokens, tmp_path / "right.onnx"), tokens, rounding_floor=True)
    wrong = compare_onnx(model, _file_of(_broken(model, defect), tokens, tmp_path / "wrong.onnx"), tokens,
                         rounding_floor=True)
    assert right.passed, str(right)
    assert not wrong.passed and wrong.outputs[0].floor_ratio > 10 * FLOAT_FLOOR_MULTIPLE, str(wrong)


def test_the_floor_sees_a_defect_a_fixed_tolerance_lets_through(tmp_path):
    # outputs of magnitude 1e-3: the seed's atol (1e-5) is a hundredth of them, the tanh GELU's error far less
    torch.manual_seed(0)
    model, tokens = TinyTransformer().eval(), torch.randint(0, 100, (8, 16))
    with torch.no_grad():
        model.head.weight.mul_(1e-3)
        model.head.bias.mul_(1e-3)
    path = _file_of(_broken(model, _tanh_gelu), tokens, tmp_path / "tanh.onnx")
    assert verify_onnx(model, path, tokens)  # the fixed tolerance calls the wrong file right
    assert not verify_onnx(model, path, tokens, rounding_floor=True)


class _Vanishing(nn.Module):
    """Outputs of order 1e-50: in float64, but below float32's smallest subnormal, so its float32 run gives 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e-30 * 1e-20


def test_a_floor_an_all_zero_file_would_pass_is_said_to_prove_nothing(tmp_path):
    torch.manual_seed(0)
    model, x = _Vanishing().eval(), torch.randn(3, 4)
    with pytest.warns(VacuousCheckWarning, match="'output'.*outputs zeros"):
        report = compare_onnx(model, _file_of(model, x, tmp_path / "vanishing.onnx"), x, rounding_floor=True)
    assert report.outputs[0].float_floor == pytest.approx(1.0) and "all-zero output would pass" in str(report)
    # a model whose float32 run keeps its outputs is proven without the warning
    model, tokens = TinyTransformer().eval(), torch.randint(0, 100, (4, 16))
    path = _file_of(model, tokens, tmp_path / "kept.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error", VacuousCheckWarning)
        assert compare_onnx(model, path, tokens, rounding_floor=True).passed


class _Float32Only(nn.Module):
    """Builds a float32 tensor in forward and multiplies by it: no float64 run possible."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.fc(x), torch.eye(4, dtype=torch.float32))


def test_a_model_without_a_float64_run_falls_back_to_the_tolerance_and_says_why(tmp_path):
    torch.manual_seed(0)
    model, x = _Float32Only().eval(), torch.randn(3, 4)
    path = _file_of(model, x, tmp_path / "m.onnx")
    with pytest.warns(WeakerCheckWarning, match="does not run in float64.*fixed tolerance"):
        report = compare_onnx(model, path, x, rounding_floor=True)
    assert report.passed and report.tolerances == {"rtol": 1e-3, "atol": 1e-5}
    assert report.outputs[0].float_floor is None


def test_a_float64_copy_over_the_memory_budget_falls_back(tmp_path, monkeypatch):
    from onnxport.compare import exported

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4)).eval(), torch.randn(3, 4)
    path = _file_of(model, x, tmp_path / "m.onnx")
    monkeypatch.setattr(exported, "FLOAT64_MEMORY_SHARE", 0.0)  # no memory for any float64 copy
    with pytest.warns(WeakerCheckWarning, match="float64 copy of its weights .* memory available"):
        assert compare_onnx(model, path, x, rounding_floor=True).passed


def test_the_model_given_is_not_changed_and_the_defaults_stay_the_seeds(tmp_path):
    torch.manual_seed(0)
    model, tokens = TinyTransformer().eval(), torch.randint(0, 100, (4, 16))
    path = _file_of(model, tokens, tmp_path / "m.onnx")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compare_onnx(model, path, tokens, rounding_floor=True)
    assert all(v.dtype == before[k].dtype and torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert compare_onnx(model, path, tokens).tolerances == {"rtol": 1e-3, "atol": 1e-5}
    with pytest.raises(InvalidArgumentError, match="give one of them"):
        compare_onnx(model, path, tokens, rtol=1e-3, rounding_floor=True)


def test_a_model_widened_in_place_for_its_floor_comes_back_exactly_as_it_was():
    # export_decoder and export_seq2seq widen a model they loaded themselves in place (no float64
    # copy beside it): every tensor must come back bit for bit, with its dtype, identity and ties
    from onnxport.compare.exported import float64_model

    torch.manual_seed(1)
    model = TinyTransformer()
    model.head = nn.Linear(model.embed.embedding_dim, model.embed.num_embeddings, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("half_table", torch.randn(3, 5).half())
    model.register_buffer("wide_table", torch.randn(4, dtype=torch.float64))
    model.register_buffer("steps", torch.arange(6))
    before = {name: t.clone() for name, t in model.state_dict(keep_vars=False).items()}
    parameters = {name: p for name, p in model.named_parameters()}
    with float64_model(model, in_place=True) as wide:
        assert wide is model and model.embed.weight.dtype == torch.float64 and model.head.weight is model.embed.weight
        assert model.half_table.dtype == torch.float64 and model.steps.dtype == torch.int64
    after = model.state_dict()
    assert {name: (t.dtype, t.shape) for name, t in after.items()} == {name: (t.dtype, t.shape) for name, t in before.items()}
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert all(p is parameters[name] for name, p in model.named_parameters()) and model.head.weight is model.embed.weight
    # a model the caller does not own is copied: the block sees float64, the model never changes
    with float64_model(model) as wide:
        assert wide is not model and next(wide.parameters()).dtype == torch.float64
        assert next(model.parameters()).dtype == torch.float32


class _ReadsItsChildsWeight(nn.Module):
    """Reads ``fc``'s weight outside ``fc``'s own call: a one-dtype kernel then meets a float32
    weight and float64 activations when weights are widened only while their module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.linear(x, self.fc.weight))


def test_a_float64_run_widens_each_module_only_while_it_runs():
    # the floor of a model the exporter loaded: float64 results, yet at most the running modules'
    # weights wide at once, and every tensor back bit for bit, with its dtype, identity and ties
    from onnxport.compare.exported import float64_copy, float64_result

    torch.manual_seed(1)
    model = TinyTransformer().eval()
    model.head = nn.Linear(model.embed.embedding_dim, model.embed.num_embeddings, bias=False)
    model.head.weight = model.embed.weight  # tied: wide in both calls, narrow between them
    model.head.register_buffer("scale", torch.full((model.embed.num_embeddings,), 0.5))
    model.head.register_forward_hook(lambda m, args, out: out * m.scale)
    tokens = torch.randint(0, 100, (2, 16))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    total = sum(p.numel() for p in model.parameters())
    seen: list[tuple[bool, float]] = []  # per Linear call: its weight wide, the model's share wide

    def watch(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if id(module) in ids:  # not the float64 copy's modules, which carry the hook too
            wide = sum(p.numel() for p in model.parameters() if p.dtype == torch.float64)
            seen.append((module.weight.dtype == torch.float64, wide / total))

    ids = {id(m) for m in model.modules()}
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and layer is not model.head:
            layer.register_forward_hook(watch)

    def run(wide: nn.Module) -> torch.Tensor:
        assert all(p.dtype == torch.float32 for p in wide.parameters())  # nothing wide before it runs
        with torch.no_grad():
            return wide(tokens)

    got = float64_result(model, run, in_place=True)
    with torch.no_grad():
        expected = float64_copy(model)(tokens)
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    assert seen and all(wide for wide, _ in seen) and max(share for _, share in seen) < 0.2
    after = model.state_dict()
    assert all(after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]) for name in before)
    assert all(p is parameters[name] for name, p in model.named_parameters()) and model.head.weight is model.embed.weight
    # a model that reads a child's weight outside the child's call is run widened whole instead
    reader = _ReadsItsChildsWeight().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        got = float64_result(reader, lambda wide: wide(x), in_place=True)
        assert torch.equal(got, float64_copy(reader)(x))
    assert all(p.dtype == torch.float32 for p in reader.parameters())


class _UpcastsToFloat32(nn.Module):
    """Attention and a norm as transformers writes them: the softmax and the norm "upcast" to
    float32 (``upcast=False``: the same model computing in its own dtype throughout)."""

    def __init__(self, upcast: bool = True) -> None:
        super().__init__()
        self.proj, self.upcast = nn.Linear(8, 8), upcast

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        work = torch.float32 if self.upcast else x.dtype
        scores = self.proj(x) @ x.transpose(-1, -2)
        scores = scores + torch.zeros_like(scores).masked_fill(~keep, torch.finfo(scores.dtype).min)
        out = torch.softmax(scores, dim=-1, dtype=work).to(x.dtype) @ x
        h = out.to(work) if self.upcast else out
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(x.dtype) + (out.float() if self.upcast else out).mean()


@pytest.mark.parametrize("in_place", [False, True])
def test_a_float64_run_computes_the_models_float32_upcasts_in_float64(in_place):
    # in float64 a float32 "upcast" is a downcast: the reference would round where the float32 run
    # does, and a fully masked row's float64 minimum overflows float32 to -inf (NaN: Gemma 2's
    # padded rows); the float64 run keeps such tensors in float64
    from onnxport.compare.exported import float64_result

    torch.manual_seed(0)
    model = _UpcastsToFloat32().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    keep = torch.ones(2, 5, 5, dtype=torch.bool)
    keep[1, :2] = False  # the second row's first two queries see nothing (left padding)
    with torch.no_grad():
        got = float64_result(model, lambda wide: wide(x, keep), in_place=in_place)
        own = copy.deepcopy(model).double()
        own.upcast = False
        expected = own(x, keep)
        assert torch.isnan(copy.deepcopy(model).double()(x, keep)).any()  # as transformers' code runs it
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    assert all(p.dtype == torch.float32 for p in model.parameters())
