"""Observers and quantization specs for our pt2e annotation."""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.fake_quantize import FusedMovingAvgObsFakeQuantize
from torchao.quantization.pt2e.observer import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from torchao.quantization.pt2e.quantizer import QuantizationSpec

OBSERVERS = ("histogram", "minmax", "percentile")
_EPS = 2**-12  # the smallest scale: keeps an all-zero tensor from a zero scale


class PercentileObserver(MinMaxObserver):
    """Range from the running mean of each batch's low and high percentiles.

    Clips rare outliers that a min/max observer would let stretch the whole scale. ``percentile``
    is the upper quantile in percent; the lower is its mirror.
    """

    def __init__(self, *args, percentile: float = 99.99, max_samples: int = 1 << 20, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.percentile = percentile
        self.max_samples = max_samples
        self.register_buffer("batches", torch.tensor(0))

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().float().reshape(-1)
        if x.numel() > self.max_samples:  # torch.quantile's input limit; a strided sample suffices
            x = x[:: x.numel() // self.max_samples + 1]
        q = torch.tensor([1 - self.percentile / 100, self.percentile / 100], dtype=x.dtype)
        lo, hi = torch.quantile(x, q)
        n = self.batches.item()
        if n == 0:
            self.min_val.resize_(lo.shape).copy_(lo)
            self.max_val.resize_(hi.shape).copy_(hi)
        else:
            self.min_val.copy_((self.min_val * n + lo) / (n + 1))
            self.max_val.copy_((self.max_val * n + hi) / (n + 1))
        self.batches += 1
        return x_orig


def activation_qspec(
    observer: str, symmetric: bool, is_qat: bool, unsigned: bool = False, bits: int = 8
) -> QuantizationSpec:
    """The spec of an activation: per-tensor, int8 with zero-point 0 when symmetric.

    The type's full range is used so that ONNX QuantizeLinear, which always saturates to the full
    range, computes exactly what PyTorch computes. ``unsigned`` gives an affine uint8 (or uint16
    with ``bits=16``) spec: a non-negative tensor (a ReLU output) then gets zero-point 0, the
    type's minimum, which is what lets ONNX Runtime drop the ReLU.
    """
    qscheme = torch.per_tensor_symmetric if symmetric and not unsigned else torch.per_tensor_affine
    if unsigned:
        dtype, qmin, qmax = (torch.uint16, 0, 65535) if bits == 16 else (torch.uint8, 0, 255)
    else:
        dtype, qmin, qmax = (torch.int16, -32768, 32767) if bits == 16 else (torch.int8, -128, 127)
    if is_qat:
        ctr = FusedMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, eps=_EPS)
    else:
        ctr = {
            "histogram": HistogramObserver.with_args(eps=_EPS),
            "minmax": MinMaxObserver.with_args(eps=_EPS),
            "percentile": PercentileObserver.with_args(eps=_EPS),
        }[observer]
    return QuantizationSpec(
        dtype=dtype, quant_min=qmin, quant_max=qmax, qscheme=qscheme, is_dynamic=False,
        observer_or_fake_quant_ctr=ctr,
    )


def weight_qspec(per_channel: bool, is_qat: bool, axis: int = 0) -> QuantizationSpec:
    """The spec of a weight: int8 on [-127, 127], zero-point 0, per output channel or per tensor."""
    if per_channel:
        observer = MovingAveragePerChannelMinMaxObserver if is_qat else PerChannelMinMaxObserver
        qscheme = torch.per_channel_symmetric
    else:
        observer = MovingAverageMinMaxObserver if is_qat else MinMaxObserver
        qscheme = torch.per_tensor_symmetric
    ctr = (
        FusedMovingAvgObsFakeQuantize.with_args(observer=observer, eps=_EPS)
        if is_qat
        else observer.with_args(eps=_EPS)
    )
    return QuantizationSpec(
        dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=qscheme,
        ch_axis=axis if per_channel else None, is_dynamic=False, observer_or_fake_quant_ctr=ctr,
    )
