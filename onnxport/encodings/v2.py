"""AIMET encodings 2.0.0 and 2.1.0: ONNX-style scale/zero-point fields, dtypes, blocks and LPBQ."""

from __future__ import annotations

import numpy as np

from .dtypes import DTYPES, NUMPY_TYPES, PLAIN_FLOATS, Encoding, ScaleMeta, is_integer
from .reading import (
    Field,
    as_read,
    check_range,
    effective_scale_problem,
    fits_an_integer_type,
    smallest_integer_type,
)


def _dtype_2x(f: Field, entry: dict) -> str:
    dtype = f.text(entry, "output_dtype")
    if dtype in PLAIN_FLOATS:
        return dtype
    if dtype not in DTYPES:
        raise f.fail("output_dtype", f"must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    return dtype


def _optional_int(f: Field, entry: dict, key: str, low: int, high: int) -> int | None:
    if key not in entry or entry[key] is None:
        return None
    return f.int_field(entry, key, low, high)


def _meta_values(f: Field, meta: dict) -> tuple[np.ndarray, str | None]:
    """``x`` checked against the type it is stored in (its ``input_dtype``, or the narrowest fit)."""
    x_dtype = f.text(meta, "input_dtype") if meta.get("input_dtype") is not None else None
    if x_dtype is not None and x_dtype not in DTYPES:
        raise f.fail("input_dtype", f"must be one of {', '.join(DTYPES)}, not {x_dtype!r}.")
    if x_dtype is None or is_integer(x_dtype):
        x = f.integers(meta, "x").astype(np.float64)
        stored = x_dtype or smallest_integer_type(x)
        if stored is None:
            raise f.fail("x", f"holds integers from {int(x.min())} to {int(x.max())}, which no ONNX integer type holds.")
        d = DTYPES[stored]
        outside = (x < d.qmin) | (x > d.qmax)
        if np.any(outside):
            raise f.fail("x", f"value {as_read(x, outside)} does not fit its input_dtype {stored} [{d.qmin}, {d.qmax}].")
        return x, x_dtype
    x = f.numbers(meta, "x")
    with np.errstate(over="ignore", invalid="ignore"):
        inexact = x.astype(NUMPY_TYPES[x_dtype]).astype(np.float64) != x
    if np.any(inexact):
        raise f.fail("x", f"value {as_read(x, inexact)} is not exactly representable in its input_dtype {x_dtype}.")
    return x, x_dtype


def _parse_meta(f: Field, meta: dict) -> ScaleMeta:
    inner = f.nested("y_scale")
    inner.require(meta, ("x", "x_scale"))
    x, x_dtype = _meta_values(inner, meta)
    x_scale = inner.numbers(meta, "x_scale", positive=True)
    axis = _optional_int(inner, meta, "axis", -8, 8)
    block = _optional_int(inner, meta, "block_size", 1, 1 << 30)
    if axis is not None:
        if not -max(x.ndim, 1) <= axis < max(x.ndim, 1):
            raise inner.fail("axis", f"{axis} is outside the {x.ndim} dimension(s) of 'x'.")
        axis %= max(x.ndim, 1)
    if x_scale.size > 1:
        if axis is None:
            raise inner.fail("axis", "is required when 'x_scale' holds several values.")
        if block is None and (x.ndim == 0 or x.shape[axis] != x_scale.size):
            raise inner.fail("x_scale", f"holds {x_scale.size} values, but 'x' has {x.shape[axis] if x.ndim else 1} along axis {axis}.")
        if block is not None:
            want = tuple(-(-d // block) if i == axis else d for i, d in enumerate(x.shape))
            if x_scale.shape != want:
                raise inner.fail("x_scale", f"has shape {x_scale.shape}; blocks of {block} along axis {axis} of 'x' need {want}.")
    elif block is not None:
        block = None  # one scale for every block is one per-tensor scale
    x_zp = None
    if meta.get("x_zero_point") is not None:
        x_zp = inner.integers(meta, "x_zero_point")
        if x_zp.size != x_scale.size:
            raise inner.fail("x_zero_point", f"has {x_zp.size} values for {x_scale.size} scales in 'x_scale'.")
        x_zp = x_zp.reshape(x_scale.shape if x_scale.size > 1 else ())
        stored = x_dtype or smallest_integer_type(x)
        check_range(inner, "x_zero_point", x_zp, stored)
    result = ScaleMeta(x, x_scale, x_zp, x_dtype, axis, block)
    problem = effective_scale_problem(result, f.allow_subnormal)
    if problem:
        raise f.fail("y_scale", f"{problem}.")
    return result


def parse_2x(entry: dict, version: str, allow_subnormal: bool) -> Encoding | str:
    name = entry["name"]
    f = Field(name, version, allow_subnormal)
    f.require(entry, ("output_dtype",))
    for foreign in ("bw", "bitwidth", "enc_type", "offset"):
        if foreign in entry:
            raise f.fail(foreign, f"belongs to the legacy formats, not version {version}; does the file's version match its contents?")
    dtype = _dtype_2x(f, entry)
    if dtype in PLAIN_FLOATS:
        return dtype
    axis = _optional_int(f, entry, "axis", -8, 8)
    block = _optional_int(f, entry, "block_size", 1, 1 << 30)
    if block is not None and axis is None:
        raise f.fail("block_size", "needs an 'axis' (the block axis).")
    meta = None
    if "per_block_int_scale" in entry or "per_channel_float_scale" in entry:
        f.require(entry, ("per_block_int_scale", "per_channel_float_scale"))
        if block is None:
            raise f.fail("block_size", "is required by an LPBQ encoding.")
        ints = f.integers(entry, "per_block_int_scale")
        channel = f.numbers(entry, "per_channel_float_scale", positive=True)
        if ints.ndim != channel.ndim:
            raise f.fail("per_channel_float_scale", f"has rank {channel.ndim}, but per_block_int_scale has rank {ints.ndim}.")
        fits_an_integer_type(f, "per_block_int_scale", ints)
        channel_axes = [i for i, d in enumerate(channel.shape) if d != 1]
        if len(channel_axes) > 1 or any(ints.shape[i] != channel.shape[i] for i in channel_axes):
            raise f.fail("per_channel_float_scale", f"has shape {channel.shape}; it must match per_block_int_scale "
                                                    f"{ints.shape} along one channel axis and be 1 elsewhere.")
        meta = ScaleMeta(ints, channel.reshape(-1), None, None, channel_axes[0] if channel_axes else None, None)
        problem = effective_scale_problem(meta, allow_subnormal)
        if problem:
            raise f.fail("per_block_int_scale", f"{problem}.")
        scale = None
    elif isinstance(entry.get("y_scale"), dict):
        if version != "2.1.0":
            raise f.fail("y_scale", "is a meta encoding (a dict), which needs version 2.1.0.")
        meta = _parse_meta(f, entry["y_scale"])
        scale = None
        if block is None:
            # The scale it defines is laid out like a plain y_scale: one value, or one per channel.
            if meta.x.size == 1:
                meta = ScaleMeta(meta.x.reshape(()), meta.x_scale.reshape(()),
                                 None if meta.x_zero_point is None else meta.x_zero_point.reshape(()), meta.x_dtype)
                axis = None
            elif meta.x.ndim != 1:
                raise f.fail("y_scale.x", f"has shape {meta.x.shape}; without a block_size the scale is one value or "
                                          f"one per channel (a 1-D list along 'axis').")
            elif axis is None:
                raise f.fail("axis", f"is required: the meta scale holds {meta.x.size} values (one per channel).")
    else:
        f.require(entry, ("y_scale",))
        scale = f.numbers(entry, "y_scale", positive=True)
    zp = None
    if entry.get("y_zero_point") is not None:
        zp = f.integers(entry, "y_zero_point")
        check_range(f, "y_zero_point", zp, dtype)
        shape = scale.shape if scale is not None else meta.x.shape
        if zp.size != int(np.prod(shape)):
            raise f.fail("y_zero_point", f"has {zp.size} values for {int(np.prod(shape))} scales.")
        zp = zp.reshape(shape)
        if not np.any(zp):
            zp = None
    if scale is not None:
        if scale.size == 1 and block is None and (axis is None or scale.ndim == 0):
            scale = scale.reshape(())
            zp = None if zp is None else zp.reshape(())
            axis = None
        elif block is None:
            if axis is None:
                raise f.fail("axis", f"is required: y_scale holds {scale.size} values (one per channel along an axis).")
            scale = scale.reshape(-1)
            zp = None if zp is None else zp.reshape(-1)
    if dtype == "int32" and zp is not None:
        raise f.fail("y_zero_point", "int32 encodings (biases) take no zero-point other than 0.")
    return Encoding(name, dtype, scale, zp, axis=axis, block_size=block, meta=meta)
