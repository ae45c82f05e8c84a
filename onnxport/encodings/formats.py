"""Read AIMET encodings (0.6.1, 1.0.0, 2.0.0, 2.1.0) into one normalised :class:`Encoding`.

Everything here works on the file alone: the whole file is validated before any graph is
touched, and every error names the tensor and the field. What only the graph can settle (a
legacy per-channel axis, a legacy block layout) is left marked on the entry for ``axes.py``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx

from ..errors import InvalidArgumentError

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


# -- loading -------------------------------------------------------------------------------------
#: Files larger than this are read one entry at a time (a 7B model's blockwise grids run to GBs of JSON).
STREAM_ABOVE_BYTES = 64 * 2**20
_MISSING = object()


class StreamedEncodings:
    """An encodings file too large to hold as Python objects, read one entry at a time (ijson).

    ``get`` mirrors ``dict.get`` for the top-level keys: the version comes back as a value, a
    section as a lazy iterable of its entries (``(name, value)`` pairs for an object section).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _items(self, prefix: str, pairs: bool = False) -> Iterator[Any]:
        import ijson

        try:
            with open(self.path, "rb") as handle:
                reader = ijson.kvitems if pairs else ijson.items
                yield from reader(handle, prefix, use_float=True)
        except ijson.JSONError as error:
            raise InvalidArgumentError(f"encodings file '{self.path}' is not valid JSON: {error}.") from None

    def get(self, key: str, default: Any = None) -> Any:
        if key == "version":
            return next(iter(self._items("version")), default)
        return _StreamedSection(self, key, default)


class _StreamedSection:
    """A top-level section of a streamed file; its type is checked only when it yields nothing."""

    def __init__(self, source: StreamedEncodings, key: str, default: Any) -> None:
        self.source, self.key, self.default = source, key, default

    def kind(self, wanted: type) -> type:
        """The section's type, found by reading only up to its first entry when it has one."""
        probes = [(dict, True), (list, False)] if wanted is dict else [(list, False), (dict, True)]
        for kind, pairs in probes:
            if next(iter(self.entries(pairs)), _MISSING) is not _MISSING:
                return kind
        value = next(iter(self.source._items(self.key)), _MISSING)  # empty, a scalar, or absent
        return type(self.default if value is _MISSING else value)

    def entries(self, pairs: bool) -> Iterator[Any]:
        return self.source._items(self.key if pairs else f"{self.key}.item", pairs=pairs)


def load_encodings(encodings: dict | str | os.PathLike) -> dict | StreamedEncodings:
    """The encodings as a dict, or — for a file over ``STREAM_ABOVE_BYTES`` — a streamed reader."""
    if isinstance(encodings, dict):
        return encodings
    if isinstance(encodings, (str, os.PathLike)):
        path = Path(encodings)
        if not path.is_file():
            what = "is a directory, not an encodings file" if path.is_dir() else "does not exist"
            raise InvalidArgumentError(f"encodings file '{encodings}' {what}.")
        if path.stat().st_size > STREAM_ABOVE_BYTES:
            return StreamedEncodings(path)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise InvalidArgumentError(f"encodings file '{encodings}' is not valid JSON: {error}.") from None
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"encodings file '{encodings}' must hold a JSON object at the top level, not {type(data).__name__}.")
        return data
    raise InvalidArgumentError(f"encodings must be a dict or a path to an encodings file, not {type(encodings).__name__}.")


def _section(data: dict | StreamedEncodings, key: str, kind: type, missing: Any) -> tuple[type, Any]:
    """(the section's type, its entries — pairs for an object section) of a dict or a streamed file."""
    if isinstance(data, StreamedEncodings):
        section = data.get(key, missing)
        found = section.kind(kind)
        return found, section.entries(pairs=kind is dict) if found is kind else ()
    value = data.get(key, missing)
    if not isinstance(value, kind):
        return type(value), ()
    return kind, value.items() if kind is dict else value  # type: ignore[attr-defined]  # isinstance(value, kind) holds


_FLOAT32 = np.finfo(np.float32)
#: Integers past this are not exact in float64, and no ONNX integer type holds them anyway.
_INTEGER_LIMIT = 2**53


def shown_name(name: str, limit: int = 80) -> str:
    """A tensor name as an error message shows it: whole, or its start when it is very long."""
    return name if len(name) <= limit else f"{name[:limit]}… ({len(name)} characters)"


#: Deeper nesting than this is no tensor's layout (ONNX tensors have a handful of axes); refusing
#: it early keeps a malicious file from exhausting the interpreter's recursion.
_MAX_NESTING = 32
_FLOAT64_MAX = float(np.finfo(np.float64).max)


def _json_scalar(value: Any) -> str | None:
    """Why one JSON value is not a number, or None when it is one."""
    if isinstance(value, bool):
        return f"holds a non-numeric value, a boolean ({json.dumps(value)}), where a number is expected"
    if isinstance(value, str):
        return (f"holds a non-numeric value, a string ({json.dumps(value[:40])}), where a number is expected; "
                f"write the number itself, unquoted")
    if isinstance(value, int):
        return None if abs(value) <= _FLOAT64_MAX else f"holds an integer of {value.bit_length()} bits, beyond any float"
    if isinstance(value, float):
        return None
    kind = "null" if value is None else "an object" if isinstance(value, dict) else type(value).__name__
    return f"holds a non-numeric value, {kind}, where a number is expected"


def _json_numbers(value: Any) -> str | None:
    """Why ``value`` is not a number or a (nested) list of numbers, or None when it is one."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (list, tuple)):
            why = _json_scalar(item)
            if why:
                return why
            continue
        if depth >= _MAX_NESTING:
            return f"nests lists more than {_MAX_NESTING} deep, which no tensor's layout does"
        kinds = set(map(type, item))
        if kinds <= {float}:
            continue  # the common case, a flat list of floats: no per-element work
        if kinds <= {int, float}:
            big = next((v for v in item if type(v) is int and abs(v) > _FLOAT64_MAX), None)
            if big is not None:
                return _json_scalar(big)
            continue
        nested = []
        for inner in item:
            if isinstance(inner, (list, tuple)):
                nested.append((inner, depth + 1))
            elif type(inner) is not float:
                why = _json_scalar(inner)
                if why:
                    return why
        stack.extend(reversed(nested))
    return None


def _as_read(array: np.ndarray, mask: np.ndarray) -> str:
    """The first offending value, and where it sits when the field holds several."""
    index = tuple(int(i) for i in np.argwhere(mask)[0]) if array.ndim else ()
    value = array[index] if array.ndim else array[()]
    where = f" at index {index if len(index) > 1 else index[0]}" if array.size > 1 else ""
    return f"{float(value)!r}{where}"


_SCALE_RULE = "a scale must be a normal positive float32 (zero, negative, non-finite and, by default, subnormal ones are refused)"


def scale_problem(values: np.ndarray, allow_subnormal: bool = False) -> str | None:
    """Why ``values`` (a scale as read, in float64) cannot be written as a float32 Q/DQ scale."""
    values = np.asarray(values, np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        stored = values.astype(np.float32)
    checks = [
        (~np.isfinite(values), "is not finite"),
        (values <= 0, "is zero or negative"),
        (~np.isfinite(stored), f"overflows float32 (largest {float(_FLOAT32.max):.4g}), where the file stores scales"),
        (stored == 0, "becomes 0 in float32, where the file stores scales"),
    ]
    if not allow_subnormal:
        subnormal = (f"is subnormal in float32 (below {float(_FLOAT32.tiny):.4g}); runtimes may flush it to 0 "
                     f"(pass allow_subnormal_scales=True to keep it)")
        checks.append((np.abs(stored) < _FLOAT32.tiny, subnormal))
    for mask, why in checks:
        if np.any(mask):
            return f"value {_as_read(values, mask)} {why}; {_SCALE_RULE}"
    return None


class _Field:
    """Validation helpers that name the tensor and the field in every message."""

    def __init__(self, name: str, version: str, allow_subnormal: bool = False, prefix: str = "") -> None:
        self.name = name
        self.version = version
        self.allow_subnormal = allow_subnormal
        self.prefix = prefix

    def nested(self, key: str) -> _Field:
        """The same checks for the fields of an object held in ``key`` (named ``key.field``)."""
        return _Field(self.name, self.version, self.allow_subnormal, f"{self.prefix}{key}.")

    def fail(self, field_name: str, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"Encoding of '{shown_name(self.name)}' (version {self.version}), field '{self.prefix}{field_name}': {why}"
        )

    def numbers(self, entry: dict, key: str, *, positive: bool = False, scalar: bool = False) -> np.ndarray:
        """A numeric field as float64, checked for JSON type and shape; ``positive`` marks a
        scale, which is checked as the float32 it will be written as."""
        value = entry[key]
        why = _json_numbers(value)
        if why:
            raise self.fail(key, f"{why}.")
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise self.fail(key, "is a ragged list; nested lists must form a rectangular array.") from None
        if array.size == 0:
            raise self.fail(key, "is empty.")
        if scalar and array.size != 1:
            raise self.fail(key, f"must be one number, not {array.size} values.")
        if positive:
            problem = scale_problem(array, self.allow_subnormal)
            if problem:
                raise self.fail(key, f"{problem}.")
        return array

    def integers(self, entry: dict, key: str, *, scalar: bool = False) -> np.ndarray:
        array = self.numbers(entry, key, scalar=scalar)
        for mask, why in ((~np.isfinite(array), "is not finite"), (array != np.round(array), "is not an integer"),
                          (np.abs(array) > _INTEGER_LIMIT, "is outside every ONNX integer type")):
            if np.any(mask):
                raise self.fail(key, f"value {_as_read(array, mask)} {why}.")
        return array.astype(np.int64)

    def int_field(self, entry: dict, key: str, low: int = 1, high: int = 64) -> int:
        value = entry[key]
        good = (
            not isinstance(value, bool) and isinstance(value, (int, float)) and low <= value <= high
            and math.isfinite(value) and value == int(value)
        )
        if not good:
            raise self.fail(key, f"must be an integer from {low} to {high}, not {value!r}.")
        return int(value)

    def text(self, entry: dict, key: str) -> str:
        value = entry[key]
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, not {json.dumps(value, default=repr)[:40]}.")
        return value

    def boolean(self, entry: dict, key: str) -> bool:
        value = entry[key]
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value in ("True", "False", "true", "false"):
            return value.lower() == "true"
        raise self.fail(key, f"must be true/false (a JSON boolean or the string \"True\"/\"False\"), not {value!r}.")

    def require(self, entry: dict, keys: tuple[str, ...]) -> None:
        missing = [k for k in keys if k not in entry]
        if missing:
            raise self.fail(missing[0], f"is missing (required by version {self.version}: {', '.join(keys)}).")


def effective_scale_problem(meta: ScaleMeta, allow_subnormal: bool = False) -> str | None:
    """Why a double-quantized scale, computed in float32 as DequantizeLinear computes it, is not a
    usable scale (each factor may be valid while their product is 0, negative or overflows)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        product = meta.dequantized()
    checks = [(~np.isfinite(product), "overflows float32"), (product <= 0, "is zero or negative")]
    if not allow_subnormal:
        checks.append((product < _FLOAT32.tiny, "is subnormal in float32 (pass allow_subnormal_scales=True to keep it)"))
    for mask, why in checks:
        if np.any(mask):
            index = tuple(int(i) for i in np.argwhere(np.broadcast_to(mask, product.shape))[0])
            at = index if product.ndim else ()
            return (f"the scale it defines, (x - x_zero_point) * x_scale = {float(product[at])!r} at index {at}, "
                    f"{why}; {_SCALE_RULE}")
    return None


def _check_range(f: _Field, key: str, zp: np.ndarray, dtype: str) -> None:
    d = DTYPES[dtype]
    if d.qmin is None:
        if np.any(zp != 0):
            raise f.fail(key, f"{dtype} takes no zero-point other than 0.")
        return
    if np.any(zp < d.qmin) or np.any(zp > d.qmax):
        bad = int(zp[(zp < d.qmin) | (zp > d.qmax)].reshape(-1)[0])
        raise f.fail(key, f"zero-point {bad} does not fit {dtype} [{d.qmin}, {d.qmax}].")


# -- legacy (0.6.1, 1.0.0) ---------------------------------------------------------------------------
def _legacy_zero_points(f: _Field, offsets: np.ndarray, bits: int, symmetric: bool) -> tuple[str, np.ndarray]:
    """Legacy offsets live in the unsigned domain: zp = -offset, shifted by 2^(N-1) when signed."""
    dtype = f"int{bits}" if symmetric else f"uint{bits}"
    if dtype not in DTYPES:
        raise f.fail("bitwidth", f"{bits}-bit integers have no ONNX Q/DQ type (2, 4, 8, 16 or 32 bits).")
    zp = -offsets - (2 ** (bits - 1) if symmetric else 0)
    _check_range(f, "offset", zp, dtype)
    return dtype, zp


def _parse_061(name: str, value: Any, section: str, allow_subnormal: bool) -> Encoding | str:
    f = _Field(name, "0.6.1", allow_subnormal)
    if not isinstance(value, list) or not value or not all(isinstance(e, dict) for e in value):
        raise f.fail("(entry)", "must be a non-empty list of encoding objects.")
    first = value[0]
    f.require(first, ("bitwidth", "dtype"))
    kind = f.text(first, "dtype").lower()
    bits = f.int_field(first, "bitwidth", 1, 32)
    if kind == "float":
        if bits == 16:
            return "float16"
        raise f.fail("dtype", f"a {bits}-bit float encoding has no meaning here (only 16-bit plain casts exist in 0.6.1).")
    if kind != "int":
        raise f.fail("dtype", f"must be 'int' or 'float', not {first['dtype']!r}.")
    for element in value:
        f.require(element, ("bitwidth", "dtype", "is_symmetric", "offset", "scale"))
    symmetric = {f.boolean(e, "is_symmetric") for e in value}
    if len(symmetric) != 1:
        raise f.fail("is_symmetric", "differs between the channels of one tensor.")
    scale = np.array([f.numbers(e, "scale", positive=True, scalar=True).item() for e in value])
    offsets = np.array([f.integers(e, "offset", scalar=True).item() for e in value])
    dtype, zp = _legacy_zero_points(f, offsets, bits, symmetric.pop())
    if len(value) == 1:
        return Encoding(name, dtype, scale.reshape(()), zp.reshape(()), section=section)
    return Encoding(name, dtype, scale, zp, section=section, pending="axis")


def _parse_100(entry: dict, section: str, allow_subnormal: bool) -> Encoding | str:
    name = entry["name"]
    f = _Field(name, "1.0.0", allow_subnormal)
    f.require(entry, ("bw", "dtype", "enc_type"))
    enc_type = entry["enc_type"]
    if enc_type not in ENC_TYPES:
        raise f.fail("enc_type", f"must be one of {', '.join(ENC_TYPES)}, not {enc_type!r}.")
    bits = f.int_field(entry, "bw", 1, 32)
    kind = f.text(entry, "dtype").upper()
    if kind == "FLOAT":
        if bits == 16:
            return "float16"
        raise f.fail("dtype", f"a {bits}-bit FLOAT encoding has no ONNX Q/DQ form in version 1.0.0.")
    if kind != "INT":
        raise f.fail("dtype", f"must be 'INT' or 'FLOAT', not {entry['dtype']!r}.")
    f.require(entry, ("is_sym", "scale", "offset"))
    symmetric = f.boolean(entry, "is_sym")
    scale = f.numbers(entry, "scale", positive=True).reshape(-1)
    offsets = f.integers(entry, "offset").reshape(-1)
    if offsets.size != scale.size:
        raise f.fail("offset", f"has {offsets.size} values for {scale.size} scales.")
    if enc_type == "LPBQ":
        f.require(entry, ("block_size", "compressed_bw", "per_block_int_scale"))
        compressed = f.int_field(entry, "compressed_bw", 1, 32)
        block = f.int_field(entry, "block_size", 1, 1 << 30)
        ints = f.integers(entry, "per_block_int_scale").reshape(-1)
        _fits_an_integer_type(f, "per_block_int_scale", ints)
        if ints.size % scale.size:
            raise f.fail("per_block_int_scale", f"holds {ints.size} values, not a multiple of the {scale.size} channel scales.")
        # The per-channel offsets describe the decompressed grid; the stored weight is the
        # compressed one, symmetric, so its zero-point is 0.
        dtype = f"int{compressed}" if symmetric else f"uint{compressed}"
        if dtype not in DTYPES:
            raise f.fail("compressed_bw", f"{compressed}-bit integers have no ONNX Q/DQ type.")
        zp = None if symmetric else np.full(ints.size, 2 ** (compressed - 1), np.int64)
        return Encoding(name, dtype, None, zp, block_size=block, section=section, pending="blocks",
                        flat={"int_scale": ints, "channel_scale": scale})
    dtype, zp = _legacy_zero_points(f, offsets, bits, symmetric)
    if enc_type == "PER_BLOCK":
        f.require(entry, ("block_size",))
        block = f.int_field(entry, "block_size", 1, 1 << 30)
        return Encoding(name, dtype, None, None, block_size=block, section=section, pending="blocks",
                        flat={"scale": scale, "zero_point": zp})
    if enc_type == "PER_TENSOR" or scale.size == 1:
        if scale.size != 1:
            raise f.fail("scale", f"a PER_TENSOR encoding holds {scale.size} scales.")
        return Encoding(name, dtype, scale.reshape(()), zp.reshape(()), section=section)
    return Encoding(name, dtype, scale, zp, section=section, pending="axis")


# -- 2.x ---------------------------------------------------------------------------------------------
def _dtype_2x(f: _Field, entry: dict) -> str:
    dtype = f.text(entry, "output_dtype")
    if dtype in PLAIN_FLOATS:
        return dtype
    if dtype not in DTYPES:
        raise f.fail("output_dtype", f"must be one of {', '.join(DTYPES)}, not {dtype!r}.")
    return dtype


def _optional_int(f: _Field, entry: dict, key: str, low: int, high: int) -> int | None:
    if key not in entry or entry[key] is None:
        return None
    return f.int_field(entry, key, low, high)


def _fits_an_integer_type(f: _Field, key: str, ints: np.ndarray) -> None:
    if smallest_integer_type(ints) is None:
        raise f.fail(key, f"holds integers from {int(ints.min())} to {int(ints.max())}, which no ONNX integer type holds.")


def smallest_integer_type(values: np.ndarray) -> str | None:
    """The narrowest ONNX integer type (unsigned first) holding ``values``, or None."""
    low, high = float(np.min(values)), float(np.max(values))
    for dtype in ("uint2", "uint4", "uint8", "uint16", "int2", "int4", "int8", "int16", "int32"):
        d = DTYPES[dtype]
        if d.qmin <= low and high <= d.qmax:
            return dtype
    return None


def _meta_values(f: _Field, meta: dict) -> tuple[np.ndarray, str | None]:
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
            raise f.fail("x", f"value {_as_read(x, outside)} does not fit its input_dtype {stored} [{d.qmin}, {d.qmax}].")
        return x, x_dtype
    x = f.numbers(meta, "x")
    with np.errstate(over="ignore", invalid="ignore"):
        inexact = x.astype(NUMPY_TYPES[x_dtype]).astype(np.float64) != x
    if np.any(inexact):
        raise f.fail("x", f"value {_as_read(x, inexact)} is not exactly representable in its input_dtype {x_dtype}.")
    return x, x_dtype


def _parse_meta(f: _Field, meta: dict) -> ScaleMeta:
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
        _check_range(inner, "x_zero_point", x_zp, stored)
    result = ScaleMeta(x, x_scale, x_zp, x_dtype, axis, block)
    problem = effective_scale_problem(result, f.allow_subnormal)
    if problem:
        raise f.fail("y_scale", f"{problem}.")
    return result


def _parse_2x(entry: dict, version: str, allow_subnormal: bool) -> Encoding | str:
    name = entry["name"]
    f = _Field(name, version, allow_subnormal)
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
        _fits_an_integer_type(f, "per_block_int_scale", ints)
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
        _check_range(f, "y_zero_point", zp, dtype)
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


# -- the file ------------------------------------------------------------------------------------------
@dataclass
class ParsedEncodings:
    version: str
    entries: list[Encoding]
    omitted: list[str]  # float16/bfloat16 plain casts


def parse_encodings(
    data: dict | StreamedEncodings, *, allow_subnormal_scales: bool = False, known: Container[str] | None = None,
    prepare: Callable[[Encoding], Encoding] | None = None,
) -> ParsedEncodings:
    """Validate a whole encodings file and normalise every entry (no graph needed).

    Every number is checked in the type it will be written in: scales as float32 (finite,
    positive, and normal unless ``allow_subnormal_scales``), zero-points in their integer type.

    ``known``: the tensor names the model has. An entry naming any other is refused, listing
    every such name, and once one is found no further entry's values are parsed: refusing a
    file of 100,000 strangers costs a name look-up each, not a parse each.

    ``prepare``: applied to each entry as it is parsed, before the next is read; what it returns
    is kept (a converter resolves entries against its graph there, and sets large values aside).
    """
    version = data.get("version")
    if version not in VERSIONS:
        raise InvalidArgumentError(
            f"Unsupported encodings version {version!r}; onnxport reads {', '.join(VERSIONS)} "
            f"(the file's 'version' field)."
        )
    if not isinstance(allow_subnormal_scales, bool):
        raise InvalidArgumentError(f"allow_subnormal_scales must be True or False, not {allow_subnormal_scales!r}.")
    entries: list[Encoding] = []
    omitted: list[str] = []
    unknown: list[str] = []

    def keep(name: str, parse: Callable[..., Encoding | str], *args: Any) -> None:
        if known is not None and name not in known:
            unknown.append(name)
        if unknown:
            return  # the file is refused anyway: spend nothing more on values
        result = parse(*args, allow_subnormal_scales)
        if isinstance(result, str):
            omitted.append(name)
        else:
            entries.append(result if prepare is None else prepare(result))

    if version == "0.6.1":
        names: dict[str, str] = {}
        for key, kind in (("param_encodings", "param"), ("activation_encodings", "activation")):
            found, section = _section(data, key, dict, {})
            if found is not dict:
                raise InvalidArgumentError(f"Section '{key}' of a 0.6.1 encodings file must be an object, not {found.__name__}.")
            for name, value in section:
                if names.get(name, key) != key:
                    raise InvalidArgumentError(f"Tensor(s) ['{name}'] appear in both 'param_encodings' and 'activation_encodings'; each tensor is one or the other.")
                names[name] = key
                keep(name, _parse_061, name, value, kind)
    elif version == "1.0.0":
        seen: dict[str, str] = {}
        for key, kind in (("param_encodings", "param"), ("activation_encodings", "activation")):
            found, section = _section(data, key, list, [])
            if found is not list:
                raise InvalidArgumentError(f"Section '{key}' of a 1.0.0 encodings file must be a list, not {found.__name__}.")
            for index, entry in enumerate(section):
                name = _entry_name(entry, index, key)
                if name in seen:
                    where = "twice in" if seen[name] == key else "in both 'param_encodings' and 'activation_encodings' of"
                    raise InvalidArgumentError(f"Tensor '{name}' appears {where} the file; each tensor takes one encoding.")
                seen[name] = key
                keep(name, _parse_100, entry, kind)
    else:
        found, section = _section(data, "encodings", list, None)
        if found is not list:
            raise InvalidArgumentError(f"A version {version} encodings file needs an 'encodings' list, not {found.__name__}.")
        seen_names: set[str] = set()
        for index, entry in enumerate(section):
            name = _entry_name(entry, index, "encodings")
            if name in seen_names:
                raise InvalidArgumentError(f"Tensor '{name}' appears twice in 'encodings'; each tensor takes one encoding.")
            seen_names.add(name)
            keep(name, _parse_2x, entry, version)
    if unknown:
        shown = [shown_name(n) for n in sorted(unknown)[:20]]
        raise InvalidArgumentError(
            f"The encodings name {len(unknown)} tensor(s) the model does not have: {shown}"
            f"{' …' if len(unknown) > 20 else ''}. Were they written for another model (or another export of it)?"
        )
    return ParsedEncodings(version, entries, omitted)


def _entry_name(entry: Any, index: int, section: str) -> str:
    if not isinstance(entry, dict):
        raise InvalidArgumentError(f"Entry {index} of '{section}' must be an object, not {type(entry).__name__}.")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"Entry {index} of '{section}' has no 'name', so it cannot be matched to a tensor.")
    return name
