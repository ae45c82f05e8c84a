"""Our histogram observer: the same ranges as torchao's HistogramObserver, found faster."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization.pt2e.observer import HistogramObserver

from onnxport.quantize.observers import SearchHistogramObserver

_BATCHES = {
    "normal": lambda g: torch.randn(4, 1000, generator=g),
    "relu": lambda g: torch.randn(4, 1000, generator=g).relu(),
    "heavy tails": lambda g: torch.randn(2, 500, generator=g) ** 3,
    "one outlier": lambda g: torch.cat([torch.randn(5000, generator=g), torch.tensor([40.0])]),
    "lognormal": lambda g: torch.randn(10000, generator=g).exp(),
    "constant": lambda g: torch.full((100,), 2.5),
}
_SCHEMES = {
    "int8 symmetric": {"dtype": torch.qint8, "qscheme": torch.per_tensor_symmetric},
    "uint8 affine": {"dtype": torch.quint8, "qscheme": torch.per_tensor_affine},
}


@pytest.mark.parametrize("scheme", list(_SCHEMES))
@pytest.mark.parametrize("batches", list(_BATCHES))
def test_histogram_search_finds_torchaos_range(batches, scheme):
    generator = torch.Generator().manual_seed(0)
    theirs, ours = HistogramObserver(**_SCHEMES[scheme]), SearchHistogramObserver(**_SCHEMES[scheme])
    for _ in range(3):  # several batches: the histogram is re-binned as the range grows
        x = _BATCHES[batches](generator)
        theirs(x)
        ours(x)
    assert torch.equal(theirs.histogram, ours.histogram)
    (their_scale, their_zero), (our_scale, our_zero) = theirs.calculate_qparams(), ours.calculate_qparams()
    assert torch.equal(our_scale, their_scale) and torch.equal(our_zero, their_zero)
    assert all(torch.equal(a, b) for a, b in zip(theirs._non_linear_param_search(), ours._non_linear_param_search()))


def test_batched_errors_are_torchaos_errors():
    observer = SearchHistogramObserver()
    observer(torch.randn(20000, generator=torch.Generator().manual_seed(1)) ** 3)
    ranges = [(0, 2047), (10, 2047), (0, 1900), (300, 1700), (1000, 1000), (1023, 1030)]
    theirs = [HistogramObserver._compute_quantization_error(observer, start, end) for start, end in ranges]
    assert observer._quantization_errors(ranges) == theirs
    assert len(set(theirs)) == len(theirs)  # distinct ranges, distinct errors: the comparison means something
