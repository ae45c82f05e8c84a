"""compare_layers against one plain compare_qdq, and the cost of sensitivity / the budget search,
on ResNet-50 (224×224) and a 4-layer BERT (hidden 256, Hugging Face ``transformers`` built from a
config with random weights: optional, the table says when it is absent).

    python -m bench layers [--models ResNet-50,BERT] [--budget-margin 0.5]
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bench._framework import option, table


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        models: ResNet-50 and/or the 4-layer BERT.
        budget_margin: the budget search's target, as a fraction of the way from the fully
            quantized model's cosine to the best any set of float layers reaches.
    """

    models: tuple[str, ...] = option(("ResNet-50", "BERT"), "models, comma-separated", choices=("ResNet-50", "BERT"))
    budget_margin: float = option(0.5, "the budget: this fraction of the way from fully quantized to the best float set")

    def check(self) -> None:
        if not 0.0 <= self.budget_margin <= 1.0:
            raise ValueError("--budget-margin must lie in [0, 1]")


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, planes * 4, 1, bias=False), nn.BatchNorm2d(planes * 4)
        self.down = None
        if stride != 1 or inplanes != planes * 4:
            self.down = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, inplanes = [], 64
        for planes, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


class _Logits(nn.Module):
    """A Hugging Face classifier called with token ids, returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _bert() -> nn.Module | None:
    try:
        from transformers import BertConfig, BertForSequenceClassification
    except ImportError:
        return None
    torch.manual_seed(0)
    config = BertConfig(vocab_size=2000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128, num_labels=4)
    return _Logits(BertForSequenceClassification(config).eval()).eval()


def _case(name: str, model: nn.Module, calibration: list, sample: torch.Tensor, budget_margin: float) -> dict:
    from onnxport import Quantizer, compare_layers, compare_qdq, export_qdq, quantize_within_budget, sensitivity

    quantized = Quantizer().quantize(model, calibration)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / f"{name}.onnx"
        export_qdq(quantized, sample, path, dynamic_batch=True)
        compare_qdq(quantized, path, sample)  # warm both paths' imports and caches
        report = compare_layers(quantized, path, sample)
        plain_s = layers_s = float("inf")
        for _ in range(3):  # best of three, alternating, so both see the same machine
            start = time.perf_counter()
            compare_qdq(quantized, path, sample)
            plain_s = min(plain_s, time.perf_counter() - start)
            start = time.perf_counter()
            report = compare_layers(quantized, path, sample)
            layers_s = min(layers_s, time.perf_counter() - start)
    start = time.perf_counter()
    ranking = sensitivity(model, calibration, [sample])
    sensitivity_s = time.perf_counter() - start
    print(f"    {name}: compare_qdq {plain_s:.2f} s, compare_layers {layers_s:.2f} s, sensitivity {sensitivity_s:.0f} s "
          f"over {len(ranking)} layers", file=sys.stderr, flush=True)
    full = next(r for r in report.rows if r.kind == "output")
    start = time.perf_counter()
    # a budget just above what full INT8 reaches, so the search has to keep layers float
    from onnxport.debug.sensitivity import model_outputs, score

    reference = model_outputs(model, [(sample,)])
    reached = score(reference, model_outputs(quantized, [(sample,)]), "cosine")
    # the best any set of float layers can do: every ranked layer float (inputs, adds, pools stay INT8)
    ceiling = score(reference, model_outputs(Quantizer(float_layers=[n for n, _ in ranking]).quantize(model, calibration),
                                        [(sample,)]), "cosine")
    budget = reached + budget_margin * (ceiling - reached)
    try:
        result = quantize_within_budget(model, calibration, [sample], budget=budget, ranking=ranking)
        budget_row = {"budget": budget, "float_layers": list(result.float_layers), "trials": result.trials,
                      "value": result.value, "fully_quantized": result.fully_quantized_value, "ceiling": ceiling}
    except Exception as error:  # noqa: BLE001 - a refusal is a result here
        budget_row = {"budget": budget, "refused": str(error)[:200]}
    budget_row["seconds"] = time.perf_counter() - start
    over = report.first_over_one_step
    return {
        "compare_qdq_s": plain_s, "compare_layers_s": layers_s, "ratio": layers_s / plain_s, "tensors": len(report.rows),
        "first_divergence": None if report.first_divergence is None else
        {"node": report.first_divergence.onnx_node, "cause": report.first_divergence.cause},
        "first_over_one_step": None if over is None else {"node": over.onnx_node, "op": over.op, "steps": over.error_in_steps},
        "output_steps": full.error_in_steps, "layers": len(ranking), "sensitivity_s": sensitivity_s,
        "sensitivity_s_per_layer": sensitivity_s / max(1, len(ranking)), "most_sensitive": ranking[:3], "budget": budget_row,
    }


def run(config: Config = Config()) -> dict:
    warnings.filterwarnings("ignore")
    results = {}
    if "ResNet-50" in config.models:
        torch.manual_seed(0)
        resnet = ResNet50().eval()
        images = torch.randn(9, 3, 224, 224)
        results["ResNet-50"] = _case("resnet50", resnet, [images[i:i + 4] for i in range(0, 8, 4)], images[8:9],
                                     config.budget_margin)
    if "BERT" in config.models:
        torch.manual_seed(0)
        bert = _bert()
        if bert is None:
            results["BERT"] = {"skipped": "transformers is not installed (pip install transformers)"}
        else:
            tokens = torch.randint(0, 2000, (17, 32))
            results["BERT"] = _case("bert", bert, [tokens[i:i + 8] for i in range(0, 16, 8)], tokens[16:17],
                                    config.budget_margin)
    return results


def report(results: dict) -> str:
    rows, notes = [], []
    for name, r in results.items():
        if "skipped" in r:
            rows.append([name, f"skipped: {r['skipped']}", *[""] * 8])
            continue
        b = r["budget"]
        rows.append([name, r["tensors"], f"{r['compare_qdq_s']:.2f}", f"{r['compare_layers_s']:.2f}", f"{r['ratio']:.2f}x",
                     r["layers"], f"{r['sensitivity_s_per_layer']:.2f}", b.get("trials", "-"), f"{b['seconds']:.1f}",
                     "refused" if "refused" in b else len(b["float_layers"])])
        notes.append(f"{name}: output {r['output_steps'] or 0:.1f} steps from the model; first defect: "
                     f"{r['first_divergence']}; first tensor over one step: {r['first_over_one_step']}")
    return table(["model", "tensors", "qdq s", "layers s", "ratio", "layers", "s/layer", "budget trials", "budget s",
                  "float layers"], rows, notes=notes,
                 title="compare_layers vs compare_qdq, sensitivity and the budget search (batch 1)")


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["layers", *sys.argv[1:]]))
