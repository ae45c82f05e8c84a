"""The ONNX translation of pt2e's ``quantized_decomposed`` operators, for exporters that lack one.

torch.onnx (with onnxscript's torchlib) translates these operators itself on current versions;
this table is handed to the exporter only when that native translation is missing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_FULL_RANGE = {2: (0, 255), 3: (-128, 127), 4: (0, 65535), 5: (-32768, 32767)}  # ONNX dtype ids


def pt2e_ops() -> list[Any]:
    qd = torch.ops.quantized_decomposed
    return [
        qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default,
        qd.quantize_per_channel.default, qd.dequantize_per_channel.default,
    ]


@functools.cache
def exporter_translates_pt2e() -> bool:
    """True when torch.onnx's own registry translates every pt2e quantize/dequantize operator."""
    try:
        # onnxscript's torchlib is what torch.onnx builds its registry from; reading its names
        # costs nothing the export does not pay anyway (building the exporter's registry a second
        # time cost 0.5-0.8 s per process, measured).
        import onnxscript.function_libs.torch_lib.ops  # noqa: F401 - registers the translations
        from onnxscript.function_libs.torch_lib.registration import default_registry

        return all(op.name() in default_registry for op in pt2e_ops())
    except Exception:  # noqa: BLE001 - a private API that moved: hand over our table, which is always correct
        return False


def fallback_table() -> dict[Any, Any]:
    """onnxscript functions for the four pt2e operators, honouring quant_min/quant_max and dtype."""
    from onnxscript import opset18 as op

    def _clip(q, quant_min: int, quant_max: int, dtype: int):
        if _FULL_RANGE.get(dtype) == (quant_min, quant_max):
            return q  # QuantizeLinear already saturates to the full range
        return op.Clip(q, op.Cast(quant_min, to=dtype), op.Cast(quant_max, to=dtype))

    def quantize_per_tensor(x, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: int):
        q = op.QuantizeLinear(x, op.CastLike(scale, x), op.Cast(zero_point, to=dtype))
        return _clip(q, quant_min, quant_max, dtype)

    def dequantize_per_tensor(x, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: int):
        return op.DequantizeLinear(x, op.Cast(scale, to=1), op.Cast(zero_point, to=dtype))

    def quantize_per_channel(x, scales, zero_points, axis: int, quant_min: int, quant_max: int, dtype: int):
        q = op.QuantizeLinear(x, op.CastLike(scales, x), op.Cast(zero_points, to=dtype), axis=axis)
        return _clip(q, quant_min, quant_max, dtype)

    def dequantize_per_channel(x, scales, zero_points, axis: int, quant_min: int, quant_max: int, dtype: int):
        return op.DequantizeLinear(x, op.Cast(scales, to=1), op.Cast(zero_points, to=dtype), axis=axis)

    qd = torch.ops.quantized_decomposed
    return {
        qd.quantize_per_tensor.default: quantize_per_tensor,
        qd.dequantize_per_tensor.default: dequantize_per_tensor,
        qd.quantize_per_channel.default: quantize_per_channel,
        qd.dequantize_per_channel.default: dequantize_per_channel,
    }


def dynamic_table() -> dict[Any, Any]:
    """onnxscript functions for pt2e's run-time quantization (``activations='dynamic'``), which
    torch.onnx does not translate: ``choose_qparams.tensor`` is ONNX ``DynamicQuantizeLinear``'s
    scale and zero-point (the same arithmetic for uint8 on [0, 255]: the range widened to hold 0,
    ``(max - min) / 255``, the zero-point ``round(-min / scale)``), and the ``.tensor`` quantizers
    read them. :class:`~onnxport.passes.dynamic_matmul.DynamicQuantizePass` then lets the
    ``QuantizeLinear`` go: ``DynamicQuantizeLinear``'s first output is that very quantization."""
    from onnxscript import opset18 as op

    def choose_qparams(x, quant_min: int, quant_max: int, eps: float, dtype: int):
        _, scale, zero_point = op.DynamicQuantizeLinear(x)
        return scale, zero_point

    def quantize_per_tensor(x, scale, zero_point, quant_min: int, quant_max: int, dtype: int):
        return op.QuantizeLinear(x, scale, zero_point)

    def dequantize_per_tensor(x, scale, zero_point, quant_min: int, quant_max: int, dtype: int):
        return op.DequantizeLinear(x, scale, zero_point)

    qd = torch.ops.quantized_decomposed
    return {
        qd.choose_qparams.tensor: choose_qparams,
        qd.quantize_per_tensor.tensor: quantize_per_tensor,
        qd.dequantize_per_tensor.tensor: dequantize_per_tensor,
    }


def translation_table(dynamic: bool = False) -> dict[Any, Any] | None:
    """The table to pass to torch.onnx.export: ``None`` where the native translation exists and
    nothing more is needed; ``dynamic`` adds the run-time quantization of :func:`dynamic_table`."""
    table = None if exporter_translates_pt2e() else fallback_table()
    if dynamic:
        table = {**(table or {}), **dynamic_table()}
    return table
