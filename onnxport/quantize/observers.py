"""Observers and quantization specs for our pt2e annotation."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch
from torchao.quantization.pt2e.fake_quantize import FusedMovingAvgObsFakeQuantize
from torchao.quantization.pt2e.observer import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)
from torchao.quantization.pt2e.quantizer import QuantizationSpec

from .._core.cpu import FULL_WEIGHT_RANGE, PORTABLE_WEIGHT_RANGE

OBSERVERS = ("histogram", "minmax", "percentile")
_EPS = 2**-12  # the smallest scale: keeps an all-zero tensor from a zero scale
_CANDIDATES_PER_BATCH = 256  # rows of (candidate, bin) errors computed at once: 2 MB at 2048 bins


class SearchHistogramObserver(HistogramObserver):
    """torchao's ``HistogramObserver`` with its range search made fast; the same range results.

    torchao walks the quantile bounds in 100,000 steps of Python-indexed tensor reads and
    computes each candidate range's L2 error one tensor call at a time: about 0.6 s per observer,
    74 s of a MobileNetV2's calibration. The walk depends only on the cumulative histogram, not on
    the errors, so here it runs on Python floats first; the errors of its candidates are then
    computed with the same float32 arithmetic, a batch of candidates per tensor call, up to the
    first candidate whose error grows (where torchao stops).
    """

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.histogram.size()[0] == self.bins, "bins mismatch"
        bin_width = (self.max_val - self.min_val) / self.bins
        walk = self._candidate_walk()
        start_bin, end_bin = 0, self.bins - 1
        norm_min = float("inf")
        batch = 8  # the search usually stops within a few candidates: start small, then grow
        while chunk := list(itertools.islice(walk, batch)):
            for (next_start, next_end), norm in zip(chunk, self._quantization_errors(chunk)):
                if norm > norm_min:
                    return self.min_val + bin_width * start_bin, self.min_val + bin_width * (end_bin + 1)
                norm_min, start_bin, end_bin = norm, next_start, next_end
            batch = min(2 * batch, _CANDIDATES_PER_BATCH)
        return self.min_val + bin_width * start_bin, self.min_val + bin_width * (end_bin + 1)

    def _candidate_walk(self) -> Iterator[tuple[int, int]]:
        """The (start bin, end bin) ranges torchao's search visits, in its order."""
        total = torch.sum(self.histogram).item()
        c_sum = torch.cumsum(self.histogram, dim=0).tolist()
        # torch compares the float32 cumulative sum with a Python scalar in float32
        as_stored = np.float32 if self.histogram.dtype == torch.float32 else float
        stepsize, alpha, beta = 1e-5, 0.0, 1.0
        start_bin, end_bin = 0, self.bins - 1
        while alpha < beta:
            next_alpha, next_beta = alpha + stepsize, beta - stepsize
            low, high = as_stored(next_alpha * total), as_stored(next_beta * total)
            left, right = start_bin, end_bin
            while left < end_bin and c_sum[left] < low:
                left += 1
            while right > start_bin and c_sum[right] > high:
                right -= 1
            next_start, next_end = start_bin, end_bin
            if (left - start_bin) > (end_bin - right):
                next_start, alpha = left, next_alpha
            else:
                next_end, beta = right, next_beta
            if (next_start, next_end) != (start_bin, end_bin):
                start_bin, end_bin = next_start, next_end
                yield start_bin, end_bin

    def _quantization_errors(self, ranges: list[tuple[int, int]]) -> list[float]:
        """torchao's ``_compute_quantization_error`` for each range, one row per range."""
        bin_width = (self.max_val.item() - self.min_val.item()) / self.bins
        widths = [bin_width * (end - start + 1) / self.dst_nbins for start, end in ranges]
        device, dtype = self.histogram.device, self.histogram.dtype
        dst_width = torch.tensor(widths, dtype=dtype, device=device)[:, None]
        starts = torch.tensor([start for start, _ in ranges], device=device)[:, None]
        src_begin = (torch.arange(self.bins, device=device)[None, :] - starts) * bin_width
        src_end = src_begin + bin_width
        begin_bin = torch.clamp(torch.div(src_begin, dst_width, rounding_mode="floor"), 0, self.dst_nbins - 1)
        end_bin = torch.clamp(torch.div(src_end, dst_width, rounding_mode="floor"), 0, self.dst_nbins - 1)
        density = self.histogram / bin_width
        half = dst_width / 2
        norm = self._get_norm(src_begin - (begin_bin + 0.5) * dst_width, half.expand_as(src_begin), density)
        norm = norm + (end_bin - begin_bin - 1) * self._get_norm(-half, half, density)
        norm = norm + self._get_norm(-half, src_end - (end_bin * dst_width + half), density)
        sums = norm.sum(dim=1).tolist()
        return [0.0 if width == 0.0 else total for width, total in zip(widths, sums)]


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
            "histogram": SearchHistogramObserver.with_args(eps=_EPS),
            "minmax": MinMaxObserver.with_args(eps=_EPS),
            "percentile": PercentileObserver.with_args(eps=_EPS),
        }[observer]
    return QuantizationSpec(
        dtype=dtype, quant_min=qmin, quant_max=qmax, qscheme=qscheme, is_dynamic=False,
        observer_or_fake_quant_ctr=ctr,
    )


def dynamic_activation_qspec() -> QuantizationSpec:
    """The spec of an activation quantized at run time, as ONNX ``DynamicQuantizeLinear`` does it:
    uint8 on [0, 255], per tensor, the range always including 0, scale ``(max - min) / 255``.

    The smallest scale is float32's smallest normal number rather than :data:`_EPS`: with a larger
    floor, a tensor whose range is under ``255 · eps`` would get another scale than the file's
    ``DynamicQuantizeLinear``, which has no floor. Only an all-zero tensor still differs (torch
    takes the floor as its scale, ONNX a zero scale); both give zeros.
    """
    return QuantizationSpec(
        dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine, is_dynamic=True,
        observer_or_fake_quant_ctr=PlaceholderObserver.with_args(eps=float(torch.finfo(torch.float32).tiny)),
    )


def weight_qspec(per_channel: bool, is_qat: bool, axis: int = 0, portable: bool = False) -> QuantizationSpec:
    """The spec of a weight: int8 on [-127, 127] (or, ``portable``, on [-64, 64]), zero-point 0,
    per output channel or per tensor."""
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
    low, high = PORTABLE_WEIGHT_RANGE if portable else FULL_WEIGHT_RANGE
    return QuantizationSpec(
        dtype=torch.int8, quant_min=low, quant_max=high, qscheme=qscheme,
        ch_axis=axis if per_channel else None, is_dynamic=False, observer_or_fake_quant_ctr=ctr,
    )
