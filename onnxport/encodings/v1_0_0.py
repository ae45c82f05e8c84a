"""AIMET encodings 1.0.0: one object per tensor with a name, legacy offsets and per-channel lists."""

from __future__ import annotations

import numpy as np

from .dtypes import DTYPES, ENC_TYPES, Encoding
from .reading import Field, fits_an_integer_type, legacy_zero_points


def parse_100(entry: dict, section: str, allow_subnormal: bool) -> Encoding | str:
    name = entry["name"]
    f = Field(name, "1.0.0", allow_subnormal)
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
        fits_an_integer_type(f, "per_block_int_scale", ints)
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
    dtype, zp = legacy_zero_points(f, offsets, bits, symmetric)
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
