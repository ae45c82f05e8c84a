"""The integer and float types AIMET encodings quantize to, and the one normalised
:class:`Encoding` every format version is read into."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import ml_dtypes
import numpy as np
import onnx

VERSIONS = ("0.6.1", "1.0.0", "2.0.0", "2.1.0")
ENC_TYPES = ("PER_TENSOR", "PER_CHANNEL", "PER_BLOCK", "LPBQ")


@dataclass(frozen=True)
class DType:
    name: str
    onnx_type: int
    qmin: int | None  # None for float formats
    qmax: int | None
    opset: int  # the first opset whose QuantizeLinear/DequantizeLinear know the type


_T = onnx.TensorProto
DTYPES: dict[str, DType] = {
    d.name: d
    for d in [
        DType("int2", _T.INT2, -2, 1, 25), DType("uint2", _T.UINT2, 0, 3, 25),
        DType("int4", _T.INT4, -8, 7, 21), DType("uint4", _T.UINT4, 0, 15, 21),
        DType("int8", _T.INT8, -128, 127, 10), DType("uint8", _T.UINT8, 0, 255, 10),
        DType("int16", _T.INT16, -32768, 32767, 21), DType("uint16", _T.UINT16, 0, 65535, 21),
        DType("int32", _T.INT32, -(2**31), 2**31 - 1, 10),
        DType("float8e4m3fn", _T.FLOAT8E4M3FN, None, None, 19), DType("float8e4m3fnuz", _T.FLOAT8E4M3FNUZ, None, None, 19),
        DType("float8e5m2", _T.FLOAT8E5M2, None, None, 19), DType("float8e5m2fnuz", _T.FLOAT8E5M2FNUZ, None, None, 19),
        DType("float4e2m1", _T.FLOAT4E2M1, None, None, 23),
    ]
}
#: The NumPy element type each ONNX Q/DQ type is stored as.
#: the doc_string of a DequantizeLinear the converter wrote, followed by the tensor it encodes
#: (``onnx_qdq_to_encodings`` reads the name back; a second conversion leaves the tensor alone)
ENCODES_MARK = "onnxport: encodes "

NUMPY_TYPES = {
    "int2": ml_dtypes.int2, "uint2": ml_dtypes.uint2, "int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4,
    "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "int32": np.int32,
    "float8e4m3fn": ml_dtypes.float8_e4m3fn, "float8e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8e5m2": ml_dtypes.float8_e5m2, "float8e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "float4e2m1": ml_dtypes.float4_e2m1fn,
}
#: Plain casts, not quantization: ONNX Q/DQ has no form for them, so they are omitted with a warning.
PLAIN_FLOATS = ("float16", "bfloat16")


def is_integer(dtype: str) -> bool:
    return DTYPES[dtype].qmin is not None


def signed_twin(dtype: str) -> str:
    return dtype.removeprefix("u")


def unsigned_twin(dtype: str) -> str:
    return dtype if dtype.startswith("u") else "u" + dtype


def _compact(values: np.ndarray) -> np.ndarray:
    """Integers in the narrowest NumPy type that holds them; other values as they are."""
    values = np.asarray(values)
    if values.dtype.kind not in "iu" and not (values.dtype.kind == "f" and values.size and np.all(values == np.round(values))
                                              and np.all(np.abs(values) < 2**31)):
        return values
    for dtype in (np.int16, np.int32):
        info = np.iinfo(dtype)
        if values.size == 0 or (values.min() >= info.min and values.max() <= info.max):
            return values.astype(dtype)
    return values.astype(np.int64)


@dataclass(frozen=True)
class ScaleMeta:
    """A double-quantized scale: ``y_scale = DequantizeLinear(x, x_scale, x_zero_point, axis, block_size)``."""

    x: np.ndarray
    x_scale: np.ndarray
    x_zero_point: np.ndarray | None = None
    x_dtype: str | None = None
    axis: int | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        # Held as written (float32 scales, the narrowest integers): a 7B model's grids are 10^7 values.
        object.__setattr__(self, "x_scale", np.asarray(self.x_scale, np.float32))
        object.__setattr__(self, "x", _compact(self.x))

    def dequantized(self) -> np.ndarray:
        """The scale this defines, in float32 as the file's DequantizeLinear computes it."""
        scale = layout_param(np.asarray(self.x_scale, np.float32), self.x.shape, self.axis, self.block_size)
        zp = 0 if self.x_zero_point is None else layout_param(self.x_zero_point, self.x.shape, self.axis, self.block_size)
        return ((self.x.astype(np.float32) - np.asarray(zp, np.float32)) * scale).astype(np.float32)


def layout_param(param: np.ndarray, shape: tuple[int, ...], axis: int | None, block_size: int | None) -> np.ndarray:
    """A scale or zero-point laid out to broadcast against a tensor of ``shape`` the way ONNX
    Q/DQ applies it: per-tensor (a scalar), along ``axis``, or repeated over blocks of ``block_size``."""
    param = np.asarray(param)
    if param.ndim == 0 or (param.size == 1 and not block_size):
        return param.reshape(())
    if block_size:
        return np.repeat(param, block_size, axis=axis)[tuple(slice(0, d) for d in shape)]
    view = [1] * len(shape)
    view[axis] = param.size
    return param.reshape(view)


@dataclass(frozen=True)
class Encoding:
    """One tensor's quantizer, whatever version it came from.

    ``scale`` and ``zero_point`` follow ONNX's layout: a 0-d array (per-tensor), 1-D along
    ``axis`` (per-channel), or the tensor's rank with ``block_size`` along ``axis`` (blockwise).
    ``meta`` replaces ``scale`` for double-quantized scales (LPBQ, 2.1.0 meta encodings).
    ``pending`` marks what the graph must settle: ``'axis'`` (a legacy per-channel entry) or
    ``'blocks'`` (a legacy per-block/LPBQ entry stored flat). ``outlined``: the arrays are
    zero-stride stand-ins of the real ones' shapes and types, the values set aside by a converter
    until the entry is written.
    """

    name: str
    dtype: str
    scale: np.ndarray | None
    zero_point: np.ndarray | None = None
    axis: int | None = None
    block_size: int | None = None
    meta: ScaleMeta | None = None
    section: str = "any"  # 'param' | 'activation' | 'any' (2.x has no sections)
    pending: str | None = None
    flat: dict[str, Any] = field(default_factory=dict)  # legacy flat arrays awaiting a layout
    outlined: bool = False

    def __post_init__(self) -> None:
        if self.scale is not None:  # validated as float32, and written as float32
            object.__setattr__(self, "scale", np.asarray(self.scale, np.float32))

    @property
    def n_scales(self) -> int:
        if self.scale is not None:
            return int(np.asarray(self.scale).size)
        return int(self.meta.x.size) if self.meta is not None else 1

    def effective_scale(self) -> np.ndarray:
        return self.meta.dequantized() if self.meta is not None else np.asarray(self.scale, dtype=np.float32)

    def with_(self, **changes: Any) -> Encoding:
        return replace(self, **changes)
