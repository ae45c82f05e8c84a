"""A first run of onnxport on a model it builds itself: export, quantize, verify.

    python examples/quickstart.py [OUT_DIR]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from onnxport import ONNXModel, compare_onnx, export_onnx


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes of 3×16×16 images, horizontal or vertical stripes under noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    grid = torch.arange(16.0)
    rows = torch.sin(grid * 1.3).view(1, 16, 1).expand(n, 16, 16)
    cols = torch.sin(grid * 1.3).view(1, 1, 16).expand(n, 16, 16)
    img = torch.where(y.view(-1, 1, 1) == 0, rows, cols)
    return img.unsqueeze(1).repeat(1, 3, 1, 1) + 0.5 * torch.randn(n, 3, 16, 16, generator=g), y


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 2),
    )
    x, y = synthetic(1024, 0)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for _ in range(60):
        idx = torch.randint(0, len(x), (64,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(), loss.backward(), opt.step()
    model.eval()
    test_x, _ = synthetic(256, 1)

    print(f"{'file':<22} {'KiB':>7} {'top-1 vs torch':>15} {'ms/batch':>9}")
    for name, kwargs in [
        ("float.onnx", {}),
        ("int8_dynamic.onnx", {"quantize": True}),
        ("int8_static.onnx", {"quantize": True, "quantize_mode": "static", "calibration_data": [x[:256]]}),
    ]:
        path = export_onnx(model, x[:1], out / name, **kwargs)
        runner = ONNXModel(path).warmup()
        start = time.perf_counter()
        pred = runner(test_x).argmax(1)
        ms = (time.perf_counter() - start) * 1e3
        with torch.no_grad():
            agree = float((model(test_x).argmax(1) == pred).float().mean())
        print(f"{name:<22} {path.stat().st_size / 1024:>7.1f} {agree:>15.1%} {ms:>9.2f}")
    print()
    print(compare_onnx(model, out / "float.onnx", test_x[:8], atol=1e-4))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "onnxport-demo"))
