"""AIMET encodings 0.6.1: a list of per-channel dicts per tensor, offsets in the unsigned domain."""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import Encoding
from .reading import Field, legacy_zero_points


def parse_061(name: str, value: Any, section: str, allow_subnormal: bool) -> Encoding | str:
    f = Field(name, "0.6.1", allow_subnormal)
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
    dtype, zp = legacy_zero_points(f, offsets, bits, symmetric.pop())
    if len(value) == 1:
        return Encoding(name, dtype, scale.reshape(()), zp.reshape(()), section=section)
    return Encoding(name, dtype, scale, zp, section=section, pending="axis")
