"""Quantizer: calibration + convert time, and INT8 agreement with float for each observer.

Also, side by side: a pre-activation DenseNet (batch norms pt2e cannot fold into a conv) quantized
as ``Quantizer`` does it, and with those norms left for torchao's QAT conv/BN fold at convert
(what the plain pt2e flow does).

    python -m bench.quantizer
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.models import PreActDenseNet, ResNet18, TinyTransformer, train_tiny_classifier, with_statistics


def _sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference - approx).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-20)))


def run() -> dict:
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
    results["batch_norms"] = _unfoldable_batch_norms()
    model, (x, _) = train_tiny_classifier(steps=60)  # under-trained on purpose: closer decisions
    calib = [x[i : i + 64] for i in range(0, 256, 64)]
    with torch.no_grad():
        ref = model(x)
    for observer in ("histogram", "minmax", "percentile"):
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
    lines = ["Quantizer (pt2e static, defaults) — capture + prepare + calibrate + convert"]
    for name, t in results["timing"].items():
        lines.append(f"  {name:<20} {t['seconds']:6.2f} s  ({t['batches']} calibration batches)")
    if "batch_norms" in results:
        b = results["batch_norms"]
        lines.append(f"Unfoldable batch norms — {b['model']}: quantize {b['seconds']['onnxport']:.1f} s, with the norms left "
                     f"for torchao's QAT fold {b['seconds']['plain pt2e']:.1f} s ({b['speedup']:.1f}x faster)")
    lines.append("Observer choice — TinyClassifier on 512 held-out synthetic images, INT8 vs float")
    for obs, r in results["observers"].items():
        lines.append(f"  {obs:<11} top-1 agreement {r['top1_agreement']:.2%}   logit SQNR {r['logit_sqnr_db']:5.1f} dB")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
