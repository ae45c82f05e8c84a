"""The float floor on this CPU: for real-size CNNs and transformers (random weights, batch-norm
statistics measured on inputs), the ``export_onnx`` file's distance from the model's float64 run
over the model's own float32 run's distance (``compare_onnx(..., rounding_floor=True)``), and the
same for planted defects. The figures behind ``FLOAT_FLOOR_MULTIPLE``: run it on each kind of CPU.

    python -m bench float_floor
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench._framework import option, table

NAMES = ("ResNet-50, 224x224", "ResNet-18 (64-wide), 64x64", "MobileNetV2 (small), 64x64", "TinyTransformer",
         "BERT 4x256, seq 64", "ViT 6x192, 224x224", "GPT-2 4x256, seq 32")


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: the models whose files are measured against their floor.
        defects: also plant the defects the floor must catch, in TinyTransformer.
    """

    models: tuple[str, ...] = option(NAMES, "models, comma-separated", choices=NAMES)
    defects: bool = option(True, "also measure planted defects (which the floor must catch)")


def _models() -> list[tuple[str, Callable[[], tuple[object, object]]]]:
    """Each model's name and a function building it and its input (built only when chosen)."""
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, ViTConfig, ViTForImageClassification

    from bench.layers import ResNet50
    from tests.models import MobileNetV2Small, ResNet18, TinyTransformer, with_statistics

    def seeded(build: Callable[[], tuple[object, object]]) -> Callable[[], tuple[object, object]]:
        def built() -> tuple[object, object]:
            torch.manual_seed(0)
            return build()
        return built

    builders = [
        lambda: (with_statistics(ResNet50(), (2, 3, 224, 224)), torch.randn(2, 3, 224, 224)),
        lambda: (with_statistics(ResNet18(), (4, 3, 64, 64)), torch.randn(4, 3, 64, 64)),
        lambda: (with_statistics(MobileNetV2Small(), (4, 3, 64, 64)), torch.randn(4, 3, 64, 64)),
        lambda: (TinyTransformer().eval(), torch.randint(0, 100, (8, 16))),
        lambda: (BertModel(BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=1024, vocab_size=2000)).eval(),
                 {"input_ids": torch.randint(0, 2000, (2, 64)), "attention_mask": torch.ones(2, 64, dtype=torch.long)}),
        lambda: (ViTForImageClassification(ViTConfig(hidden_size=192, num_hidden_layers=6, num_attention_heads=3,
                                                     intermediate_size=768, image_size=224, patch_size=16)).eval(),
                 torch.randn(2, 3, 224, 224)),
        lambda: (GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=2000, use_cache=False)).eval(),
                 {"input_ids": torch.randint(0, 2000, (2, 32))}),
    ]
    return [(name, seeded(build)) for name, build in zip(NAMES, builders)]


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


def run(config: Config = Config()) -> dict:
    import torch

    from onnxport import compare_onnx, cpu_int8, export_onnx
    from tests.models import TinyTransformer

    results: dict = {"_isa": cpu_int8().isa, "right": {}, "defects": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for i, (name, build) in enumerate(_models()):
            if name not in config.models:
                continue
            model, sample = build()
            start = time.perf_counter()
            path = export_onnx(model, sample, Path(scratch) / f"m{i}.onnx")
            report = compare_onnx(model, path, sample, rounding_floor=True)
            results["right"][name] = [{"output": o.name, "floor": o.float_floor, "distance": o.float_distance,
                                       "ratio": o.floor_ratio} for o in report.outputs]
            print(f"    {name}: {[round(o.floor_ratio, 2) for o in report.outputs]} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        torch.manual_seed(0)
        tiny, tokens = TinyTransformer().eval(), torch.randint(0, 100, (8, 16))
        for i, (name, plant) in enumerate(_defects() if config.defects else []):
            broken = copy.deepcopy(tiny)
            plant(broken)
            report = compare_onnx(tiny, export_onnx(broken, tokens, Path(scratch) / f"d{i}.onnx"), tokens,
                                  rounding_floor=True)
            results["defects"][f"TinyTransformer, {name}"] = report.outputs[0].floor_ratio
    return results


def report(results: dict) -> str:
    from onnxport.compare.exported import FLOAT_FLOOR_MULTIPLE

    rows = [[name, o["output"], f"{o['floor']:.3g}", f"{o['distance']:.3g}", f"{o['ratio']:.2f}"]
            for name, outputs in results["right"].items() for o in outputs]
    rows += [[f"defect: {name}", "", "", "", f"{ratio:.0f}"] for name, ratio in results["defects"].items()]
    return table(["model", "output", "floor", "file", "ratio"], rows, title=(
        f"The float floor (CPU: {results.get('_isa', 'see the run results file')}): the file's distance from the "
        f"float64 run over the model's own float32 run's; a file passes at <= {FLOAT_FLOOR_MULTIPLE:g}"))


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["float_floor", *sys.argv[1:]]))
