"""Reading an encodings file (whole, or streamed entry by entry past 64 MB) and the field checks
every format version shares: JSON numbers, scales, zero-point ranges, each error naming the tensor and
the field."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .dtypes import DTYPES, ScaleMeta

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


def section_of(data: dict | StreamedEncodings, key: str, kind: type, missing: Any) -> tuple[type, Any]:
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


def as_read(array: np.ndarray, mask: np.ndarray) -> str:
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
            return f"value {as_read(values, mask)} {why}; {_SCALE_RULE}"
    return None


class Field:
    """Validation helpers that name the tensor and the field in every message."""

    def __init__(self, name: str, version: str, allow_subnormal: bool = False, prefix: str = "") -> None:
        self.name = name
        self.version = version
        self.allow_subnormal = allow_subnormal
        self.prefix = prefix

    def nested(self, key: str) -> Field:
        """The same checks for the fields of an object held in ``key`` (named ``key.field``)."""
        return Field(self.name, self.version, self.allow_subnormal, f"{self.prefix}{key}.")

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
                raise self.fail(key, f"value {as_read(array, mask)} {why}.")
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


def check_range(f: Field, key: str, zp: np.ndarray, dtype: str) -> None:
    d = DTYPES[dtype]
    if d.qmin is None:
        if np.any(zp != 0):
            raise f.fail(key, f"{dtype} takes no zero-point other than 0.")
        return
    if np.any(zp < d.qmin) or np.any(zp > d.qmax):
        bad = int(zp[(zp < d.qmin) | (zp > d.qmax)].reshape(-1)[0])
        raise f.fail(key, f"zero-point {bad} does not fit {dtype} [{d.qmin}, {d.qmax}].")



def legacy_zero_points(f: Field, offsets: np.ndarray, bits: int, symmetric: bool) -> tuple[str, np.ndarray]:
    """Legacy offsets live in the unsigned domain: zp = -offset, shifted by 2^(N-1) when signed."""
    dtype = f"int{bits}" if symmetric else f"uint{bits}"
    if dtype not in DTYPES:
        raise f.fail("bitwidth", f"{bits}-bit integers have no ONNX Q/DQ type (2, 4, 8, 16 or 32 bits).")
    zp = -offsets - (2 ** (bits - 1) if symmetric else 0)
    check_range(f, "offset", zp, dtype)
    return dtype, zp


def smallest_integer_type(values: np.ndarray) -> str | None:
    """The narrowest ONNX integer type (unsigned first) holding ``values``, or None."""
    low, high = float(np.min(values)), float(np.max(values))
    for dtype in ("uint2", "uint4", "uint8", "uint16", "int2", "int4", "int8", "int16", "int32"):
        d = DTYPES[dtype]
        if d.qmin <= low and high <= d.qmax:
            return dtype
    return None


def fits_an_integer_type(f: Field, key: str, ints: np.ndarray) -> None:
    if smallest_integer_type(ints) is None:
        raise f.fail(key, f"holds integers from {int(ints.min())} to {int(ints.max())}, which no ONNX integer type holds.")
