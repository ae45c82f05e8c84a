"""Right on every CPU: files for ONNX Runtime's CPU provider compute, as ORT deploys them, what
their model computes on x86 with or without VNNI.

Without VNNI, ORT's (and OpenVINO's) U8S8 kernels add two uint8 x int8 products in a saturating
int16 (VPMADDUBSW). The portable rule keeps int8 weights on [-64, 64], where no pair can
saturate; these tests check the rule on the files, check the arithmetic that makes it the right
bound (an exact emulation, so they mean the same on every CPU), and check trained models as
deployed on whichever CPU runs them, with bounds both kinds of CPU meet.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

from onnxport import (
    Quantizer,
    check_target,
    compare_qdq,
    export_onnx,
    export_qdq,
    qdq_report,
    quant_spec,
)
from onnxport._core.cpu import WEIGHT_RANGE_KEY, cpu_int8
from onnxport.demo import DemoNet, draw_images
from onnxport.errors import InvalidArgumentError
from tests.models import TinyTransformer


def _weights(path) -> dict[str, np.ndarray]:
    """The int8 integers every Conv/Gemm/MatMul reads as its weight, by DequantizeLinear name."""
    model = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    read = {n.input[1] for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")}
    return {n.name: inits[n.input[0]] for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.output[0] in read and n.input[0] in inits
            and inits[n.input[0]].dtype == np.int8}


def _recorded(path) -> str | None:
    return next((p.value for p in onnx.load(str(path), load_external_data=False).metadata_props
                 if p.key == WEIGHT_RANGE_KEY), None)


# -- the arithmetic: why [-64, 64] ---------------------------------------------------------------
def _vpmaddubsw_dot(codes: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """uint8 codes x int8 weights as x86 U8S8 kernels without VNNI add them: neighbouring
    products (k = 2j, 2j + 1) summed into a saturating int16, then exact int32 sums."""
    k = codes.shape[-1]
    if k % 2:
        codes, weights = np.pad(codes, [(0, 0), (0, 1)]), np.pad(weights, [(0, 1), (0, 0)])
    products = codes.astype(np.int32)[:, :, None] * weights.astype(np.int32)[None, :, :]  # (M, K, N)
    pairs = np.clip(products[:, 0::2] + products[:, 1::2], -32768, 32767)
    return pairs.sum(1)


def test_portable_weights_cannot_saturate_and_full_range_ones_do():
    rng = np.random.default_rng(0)
    codes = np.concatenate([np.full((1, 64), 255, np.uint8), rng.integers(0, 256, (31, 64), dtype=np.uint8)])
    portable = rng.integers(-64, 65, (64, 16)).astype(np.int8)
    portable[:2, 0] = 64  # the worst pair the rule allows: 255 x 128 = 32640
    full = rng.integers(-127, 128, (64, 16)).astype(np.int8)
    full[:2, 0] = 127
    def exact(w: np.ndarray) -> np.ndarray:
        return codes.astype(np.int64) @ w.astype(np.int64)

    assert np.array_equal(_vpmaddubsw_dot(codes, portable), exact(portable))
    assert not np.array_equal(_vpmaddubsw_dot(codes, full), exact(full))


# -- the rule on the files ----------------------------------------------------------------------
class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv(x))))
        return self.head(x.mean((2, 3)))


@pytest.fixture(scope="module")
def conv_files(tmp_path_factory):
    torch.manual_seed(0)
    model = _ConvNet().eval()
    calib = [torch.randn(8, 3, 16, 16) for _ in range(2)]
    out = tmp_path_factory.mktemp("portable")
    portable = Quantizer(target="onnxruntime").quantize(model, calib)
    full = Quantizer(target="onnxruntime", weight_range="full").quantize(model, calib)
    return {
        "portable": (portable, export_qdq(portable, calib[0], out / "portable.onnx", dynamic_batch=True)),
        "full": (full, export_qdq(full, calib[0], out / "full.onnx", dynamic_batch=True)),
    }


def test_the_onnxruntime_preset_is_portable_by_default_and_says_so(conv_files):
    model, path = conv_files["portable"]
    spec = quant_spec(model)
    assert spec.weight_range == "portable" and "[-64, 64]" in spec.describe()
    weights = _weights(path)
    assert len(weights) == 3 and all(w.min() >= -64 and w.max() <= 64 for w in weights.values())
    assert max(int(np.abs(w).max()) for w in weights.values()) == 64  # the range is used, not shrunk further
    assert _recorded(path) == "portable" and check_target(path, "onnxruntime") == []
    cpu = qdq_report(path, ort=False).extra["cpu"]
    assert cpu["weight_range"] == "portable" and cpu["weight_range_recorded"] and cpu["saturate_without_vnni"] == []
    assert cpu["vnni"] == cpu_int8().vnni and cpu_int8().isa in cpu["machine"]


def test_the_full_range_is_an_explicit_opt_out_recorded_on_the_model_and_the_file(conv_files, tmp_path):
    model, path = conv_files["full"]
    assert quant_spec(model).weight_range == "full" and _recorded(path) == "full"
    assert max(int(np.abs(w).max()) for w in _weights(path).values()) == 127
    assert check_target(path, "onnxruntime") == []  # the record opts out
    report = qdq_report(path, ort=False)
    assert len(report.extra["cpu"]["saturate_without_vnni"]) == 3 and "beyond [-64, 64]" in str(report)
    unrecorded = onnx.load(str(path))
    del unrecorded.metadata_props[:]  # a file from elsewhere: the rule holds unless a record opts out
    onnx.save(unrecorded, str(tmp_path / "unrecorded.onnx"))
    problems = check_target(tmp_path / "unrecorded.onnx", "onnxruntime")
    assert len(problems) == 3 and all("beyond [-64, 64]" in p and "VNNI" in p for p in problems)
    assert all(p.startswith("DequantizeLinear '") for p in problems)  # each names its node


def test_weight_range_is_checked_by_name():
    with pytest.raises(InvalidArgumentError, match="weight_range must be one of 'portable', 'full'"):
        Quantizer(target="onnxruntime", weight_range="7bit")
    with pytest.raises(InvalidArgumentError, match="weight_range"):
        Quantizer(backend="torchao", method="int8_weight_only", weight_range="full")
    with pytest.raises(InvalidArgumentError, match="weight_range must be one of"):
        export_onnx(_ConvNet().eval(), torch.randn(1, 3, 8, 8), "unused.onnx", quantize=True, weight_range="wide")


def test_other_targets_keep_the_full_range():
    for target in (None, "tensorrt", "qnn"):
        assert Quantizer(target=target).weight_range == "full"
    assert Quantizer(target="qnn", weight_range="portable").weight_range == "portable"


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_onnx_runtimes_own_quantizer_writes_portable_weights_by_default(mode, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(16, 32)
    for weight_range, bound in (("portable", 64), ("full", 127)):
        path = export_onnx(model, x, tmp_path / f"{mode}_{weight_range}.onnx", quantize=True, quantize_mode=mode,
                           calibration_data=[x] if mode == "static" else None, weight_range=weight_range)
        model_proto = onnx.load(str(path))
        ints = [numpy_helper.to_array(t) for t in model_proto.graph.initializer if t.data_type == onnx.TensorProto.INT8]
        assert ints and max(int(np.abs(w).max()) for w in ints) == bound, weight_range
        assert _recorded(path) == weight_range


# -- trained models, as ONNX Runtime deploys them on this CPU --------------------------------------
def _train(model: nn.Module, batches, steps: int, lr: float = 3e-3) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    model.train()
    for step in range(steps):
        x, y = batches(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return model.eval()


def _deployed_agreement(model: nn.Module, calib: list, sample: torch.Tensor, out) -> tuple[float, float]:
    quantized = Quantizer(target="onnxruntime").quantize(model, calib)
    path = export_qdq(quantized, sample[:4], out, dynamic_batch=True)
    result = compare_qdq(quantized, path, sample, optimized=True).outputs[0]  # as ORT deploys it, here
    return result.cosine_similarity, result.top1_agreement


def test_the_demos_trained_cnn_as_deployed_agrees_with_its_model(tmp_path):
    torch.manual_seed(0)
    x, y = draw_images(1024, seed=0, size=24)
    model = _train(DemoNet(width=16), lambda step: (x[(step * 64) % 1024:][:64], y[(step * 64) % 1024:][:64]), 100)
    test_x, test_y = draw_images(256, seed=1, size=24)
    # it learned (0.89 here): its margins are a trained model's. Its full-range file, as ORT deploys it on
    # an AVX2 CPU without VNNI, measured cosine 0.9934 and top-1 0.957 against the same model.
    assert (model(test_x).argmax(1) == test_y).float().mean() > 0.6
    cosine, top1 = _deployed_agreement(model, [x[i:i + 64] for i in range(0, 512, 64)], test_x, tmp_path / "cnn.onnx")
    print(f"\ntrained CNN as deployed on {cpu_int8().isa}: cosine {cosine:.6f}, top-1 agreement {top1}")
    assert cosine >= 0.9999 and top1 == 1.0


def _token_task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of 16 tokens; the class is which of five marker tokens appears most often."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, 100, (n, 16), generator=g)
    label = torch.randint(0, 5, (n,), generator=g)
    for i in range(n):
        spots = torch.randperm(16, generator=g)[:6]
        tokens[i, spots[:4]] = label[i]
        tokens[i, spots[4:]] = torch.randint(0, 5, (2,), generator=g)
    return tokens, label


def test_a_trained_transformer_as_deployed_agrees_with_its_model(tmp_path):
    torch.manual_seed(0)
    tokens, labels = _token_task(2048, seed=0)
    model = _train(TinyTransformer(), lambda step: (tokens[(step * 64) % 2048:][:64], labels[(step * 64) % 2048:][:64]), 300)
    test_tokens, test_labels = _token_task(256, seed=1)
    assert (model(test_tokens).argmax(1) == test_labels).float().mean() > 0.8
    cosine, top1 = _deployed_agreement(model, [tokens[i:i + 64] for i in range(0, 512, 64)], test_tokens,
                                       tmp_path / "transformer.onnx")
    print(f"\ntrained transformer as deployed on {cpu_int8().isa}: cosine {cosine:.6f}, top-1 agreement {top1}")
    assert cosine >= 0.9999 and top1 == 1.0
