"""Quantizer: calibration + convert time, and INT8 agreement with float for each observer.

Also, side by side: a pre-activation DenseNet (batch norms pt2e cannot fold into a conv) quantized
as ``Quantizer`` does it, and with those norms left for torchao's QAT conv/BN fold at convert
(what the plain pt2e flow does).

    python -m bench quantizer [--observers minmax,histogram] [--no-batch-norms]
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._framework import option, table
from tests.models import PreActDenseNet, ResNet18, TinyTransformer, train_tiny_classifier, with_statistics

OBSERVERS = ("histogram", "minmax", "percentile")


@dataclass(frozen=True)
class Config:
    """What one run measures.

    Attributes:
        observers: the observers whose INT8 agreement with float is measured.
        batch_norms: also time the unfoldable batch norms against torchao's QAT fold.
    """

    observers: tuple[str, ...] = option(OBSERVERS, "observers compared, comma-separated", choices=OBSERVERS)
    batch_norms: bool = option(True, "also time unfoldable batch norms against torchao's QAT fold")


def _sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference - approx).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-20)))


def run(config: Config = Config()) -> dict:
    from onnxport import Quantizer

    torch.manual_seed(0)
    results: dict = {"timing": {}, "observers": {}}
    cases = [
        ("ResNet-18 224x224", ResNet18().eval(), [torch.randn(8, 3, 224, 224) for _ in range(4)]),
        ("TinyTransformer", TinyTransformer().eval(), [torch.randint(0, 100, (32, 16)) for _ in range(8)]),
    ]
    for name, model, calib in cases:
        start = time.perf_counter()
        Quantizer().quantize(model, calib)
        results["timing"][name] = {"seconds": time.perf_counter() - start, "batches": len(calib)}
    if config.batch_norms:
        results["batch_norms"] = _unfoldable_batch_norms()
    model, (x, _) = train_tiny_classifier(steps=60)  # under-trained on purpose: closer decisions
    calib = [x[i : i + 64] for i in range(0, 256, 64)]
    with torch.no_grad():
        ref = model(x)
    for observer in config.observers:
        q = Quantizer(observer=observer).quantize(model, calib)
        with torch.no_grad():
            out = q(x)
        results["observers"][observer] = {
            "top1_agreement": float((out.argmax(1) == ref.argmax(1)).float().mean()),
            "logit_sqnr_db": _sqnr_db(ref, out),
        }
    return results


def _unfoldable_batch_norms() -> dict:
    import onnxport.quantize.quantizer as flow
    from onnxport import Quantizer

    torch.manual_seed(0)
    model = with_statistics(PreActDenseNet(layers=12), (8, 3, 64, 64))
    calib = [torch.randn(4, 3, 64, 64) for _ in range(2)]
    seconds = {}
    kept = flow.retarget_inference_batch_norms
    for name, retarget in (("plain pt2e", lambda m: m), ("onnxport", kept)):
        flow.retarget_inference_batch_norms = retarget
        try:
            start = time.perf_counter()
            Quantizer().quantize(model, calib)
            seconds[name] = time.perf_counter() - start
        finally:
            flow.retarget_inference_batch_norms = kept
    return {"model": "PreActDenseNet, 12 layers, 64x64", "seconds": seconds,
            "speedup": seconds["plain pt2e"] / seconds["onnxport"]}


def report(results: dict) -> str:
    parts = [table(["model", "seconds", "calibration batches"],
                   [[name, f"{t['seconds']:.2f}", t["batches"]] for name, t in results["timing"].items()],
                   title="Quantizer (pt2e static, defaults) — capture + prepare + calibrate + convert")]
    if "batch_norms" in results:
        b = results["batch_norms"]
        parts.append(table(["model", "onnxport s", "norms left for torchao's QAT fold s", "faster"],
                           [[b["model"], f"{b['seconds']['onnxport']:.1f}", f"{b['seconds']['plain pt2e']:.1f}",
                             f"{b['speedup']:.1f}x"]], title="Unfoldable batch norms"))
    parts.append(table(["observer", "top-1 agreement", "logit SQNR dB"],
                       [[obs, f"{r['top1_agreement']:.2%}", f"{r['logit_sqnr_db']:.1f}"]
                        for obs, r in results["observers"].items()],
                       title="Observer choice — TinyClassifier on 512 held-out synthetic images, INT8 vs float"))
    return "\n\n".join(parts)


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["quantizer", *sys.argv[1:]]))
