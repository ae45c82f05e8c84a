"""``compare_onnx`` and ``verify_onnx``: an exported float file against the PyTorch model it came from."""

from __future__ import annotations

import os
from typing import Any

from .report import OutputResult, Report
from .runners import onnx_batches, torch_batches
from .strategies import ScaledAllclose, compare_runs

#: The names compare_onnx's results had before the one comparison model; the same types now.
ComparisonReport = Report
OutputComparison = OutputResult


def compare_onnx(
    model: Any, onnx_path: str | os.PathLike, sample: Any, rtol: float = 1e-3, atol: float = 1e-5
) -> Report:
    """Run ``model`` and the ONNX file on ``sample`` and compare every output.

    Args:
        model: the PyTorch ``nn.Module`` the file was exported from (run in eval mode, then its
            mode is restored).
        onnx_path: the ONNX file.
        sample: a tensor, a tuple of tensors (one per input) or a dict of them by name (as for
            :func:`export_onnx`).
        rtol, atol: each element must be within ``atol · max(1, M) + rtol · |expected|`` of
            PyTorch's, ``M`` the output's largest magnitude (:class:`ScaledAllclose`).

    Returns the :class:`Report`: ``bool(report)`` is the verdict, ``str(report)`` the table.
    """
    from .._inputs import bind_sample, file_batch, split_batches
    from .._torch import eval_mode, require_module
    from ..runtime import ONNXModel

    require_module(model)
    strategy = ScaledAllclose(rtol, atol)
    call, inputs, names = bind_sample(model, sample)
    runner = ONNXModel(onnx_path)
    # a file exported with a fixed batch runs the sample in batches of its own size
    batches = split_batches(inputs, 1, file_batch(onnx_path))
    with eval_mode(model):
        reference = torch_batches(call, batches)
    got = onnx_batches(runner, batches, names, "default level")
    return compare_runs(got, reference, strategy)


def verify_onnx(
    model: Any, onnx_path: str | os.PathLike, sample: Any, rtol: float = 1e-3, atol: float = 1e-5
) -> bool:
    """True when every output of the ONNX file matches the PyTorch model within tolerance.

    See :func:`compare_onnx` for the per-output figures behind the answer.
    """
    return bool(compare_onnx(model, onnx_path, sample, rtol=rtol, atol=atol))
