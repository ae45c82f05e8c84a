"""The float floor on this CPU: for real-size CNNs and transformers (random weights, batch-norm
statistics measured on inputs), the ``export_onnx`` file's distance from the model's float64 run
over the model's own float32 run's distance (``compare_onnx(..., rounding_floor=True)``), and the
same for planted defects. The figures behind ``FLOAT_FLOOR_MULTIPLE``: run it on each kind of CPU.

    python -m bench float_floor
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path


def _models() -> list[tuple[str, object, object]]:
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, ViTConfig, ViTForImageClassification

    from bench.layers import ResNet50
    from tests.models import MobileNetV2Small, ResNet18, TinyTransformer, with_statistics

    torch.manual_seed(0)
    bert = BertModel(BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                vocab_size=2000)).eval()
    vit = ViTForImageClassification(ViTConfig(hidden_size=192, num_hidden_layers=6, num_attention_heads=3,
                                              intermediate_size=768, image_size=224, patch_size=16)).eval()
    gpt = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=2000, use_cache=False)).eval()
    return [
        ("ResNet-50, 224x224", with_statistics(ResNet50(), (2, 3, 224, 224)), torch.randn(2, 3, 224, 224)),
        ("ResNet-18 (64-wide), 64x64", with_statistics(ResNet18(), (4, 3, 64, 64)), torch.randn(4, 3, 64, 64)),
        ("MobileNetV2 (small), 64x64", with_statistics(MobileNetV2Small(), (4, 3, 64, 64)), torch.randn(4, 3, 64, 64)),
        ("TinyTransformer", TinyTransformer().eval(), torch.randint(0, 100, (8, 16))),
        ("BERT 4x256, seq 64", bert, {"input_ids": torch.randint(0, 2000, (2, 64)),
                                      "attention_mask": torch.ones(2, 64, dtype=torch.long)}),
        ("ViT 6x192, 224x224", vit, torch.randn(2, 3, 224, 224)),
        ("GPT-2 4x256, seq 32", gpt, {"input_ids": torch.randint(0, 2000, (2, 32))}),
    ]


def _defects():
    import torch
    from torch import nn

    def bf16(model):
        weight = max((p for p in model.parameters() if p.dim() >= 2), key=lambda p: float(p.detach().abs().max()))
        with torch.no_grad():
            weight.copy_(weight.to(torch.bfloat16).float())

    def eps(model):
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.eps = 1e-3

    def tanh(model):
        for module in model.modules():
            if isinstance(module, nn.GELU):
                module.approximate = "tanh"

    return [("its largest weight through bfloat16", bf16), ("LayerNorm epsilon 1e-5 -> 1e-3", eps),
            ("GELU as its tanh form", tanh)]


def run() -> dict:
    import torch

    from onnxport import compare_onnx, export_onnx
    from tests.models import TinyTransformer

    results: dict = {"right": {}, "defects": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for i, (name, model, sample) in enumerate(_models()):
            start = time.perf_counter()
            path = export_onnx(model, sample, Path(scratch) / f"m{i}.onnx")
            report = compare_onnx(model, path, sample, rounding_floor=True)
            results["right"][name] = [{"output": o.name, "floor": o.float_floor, "distance": o.float_distance,
                                       "ratio": o.floor_ratio} for o in report.outputs]
            print(f"    {name}: {[round(o.floor_ratio, 2) for o in report.outputs]} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        torch.manual_seed(0)
        tiny, tokens = TinyTransformer().eval(), torch.randint(0, 100, (8, 16))
        for i, (name, plant) in enumerate(_defects()):
            broken = copy.deepcopy(tiny)
            plant(broken)
            report = compare_onnx(tiny, export_onnx(broken, tokens, Path(scratch) / f"d{i}.onnx"), tokens,
                                  rounding_floor=True)
            results["defects"][f"TinyTransformer, {name}"] = report.outputs[0].floor_ratio
    return results


def report(results: dict) -> str:
    from onnxport import cpu_int8
    from onnxport.compare.exported import FLOAT_FLOOR_MULTIPLE

    lines = [(f"The float floor (CPU: {cpu_int8().isa}): the file's distance from the float64 run over the model's "
             f"own float32 run's; a file passes at <= {FLOAT_FLOOR_MULTIPLE:g}")]
    for name, outputs in results["right"].items():
        for o in outputs:
            lines.append(f"  {name:<30} {o['output']:<16} floor {o['floor']:.3g}  file {o['distance']:.3g}  "
                         f"ratio {o['ratio']:.2f}")
    for name, ratio in results["defects"].items():
        lines.append(f"  defect: {name:<50} ratio {ratio:.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
