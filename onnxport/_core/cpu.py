"""What an x86 CPU's integer kernels need of a file, and what this CPU has.

ONNX Runtime's MLAS and OpenVINO's oneDNN run uint8 x int8 (U8S8) products on x86 with
VPMADDUBSW where the CPU has no VNNI: it adds two neighbouring products into a *saturating*
int16. With uint8 codes up to 255, a pair of int8 weights whose positive parts (or negative parts)
add up to more than 128 can be clipped, and the kernel computes something other than the file.
On [-64, 64] no pair can: 255 x (64 + 64) = 32640 fits int16. CPUs with VNNI (``vpdpbusd``), AMX,
and ARM's dot products accumulate in int32 and are exact with the full [-127, 127].

This module holds that rule's constants and reads the CPU's flags; it imports nothing of
onnxport, so every layer may use it.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

#: The choices for a file's int8 weight range.
WEIGHT_RANGES = ("portable", "full")
#: int8 weights on this range cannot saturate VPMADDUBSW (and ORT's ``reduce_range`` uses it).
PORTABLE_WEIGHT_RANGE = (-64, 64)
FULL_WEIGHT_RANGE = (-127, 127)
#: metadata key under which a quantized file records its ``weight_range``.
WEIGHT_RANGE_KEY = "onnxport.weight_range"

_EXACT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@dataclass(frozen=True)
class CPUInt8:
    """How this machine's CPU runs U8S8 integer products.

    Attributes:
        arch: ``platform.machine()``.
        isa: the widest x86 SIMD level the kernels use here (``'AVX-512 VNNI'``, ``'AVX-VNNI'``,
            ``'AVX-512'``, ``'AVX2'``, ``'SSE'``), or the architecture elsewhere.
        vnni: whether U8S8 products accumulate in int32 (VNNI or AMX on x86; any ARM CPU, whose
            kernels do not pair products in int16).
        saturating: U8S8 kernels add product pairs in a saturating int16 here (x86 without VNNI).
    """

    arch: str
    isa: str
    vnni: bool

    @property
    def saturating(self) -> bool:
        return self.arch in ("x86_64", "AMD64", "i386", "i686") and not self.vnni

    def describe(self) -> str:
        how = ("U8S8 products saturate in int16 (VPMADDUBSW): files need weights on [-64, 64]"
               if self.saturating else "U8S8 products accumulate in int32: any int8 weight is exact")
        return f"{self.arch} {self.isa}: {how}"


@functools.lru_cache(maxsize=1)
def cpu_int8() -> CPUInt8:
    """This CPU's integer-kernel facts, from the kernel's flags (``/proc/cpuinfo``) where it has
    them and numpy's CPU-feature table otherwise."""
    arch = platform.machine()
    flags = _flags()
    if arch not in ("x86_64", "AMD64", "i386", "i686"):
        return CPUInt8(arch, arch, True)
    if "avx512_vnni" in flags:
        isa = "AVX-512 VNNI"
    elif "avx_vnni" in flags:
        isa = "AVX-VNNI"
    elif "avx512bw" in flags:
        isa = "AVX-512 (no VNNI)"
    elif "avx2" in flags:
        isa = "AVX2 (no VNNI)"
    else:
        isa = "SSE (no VNNI)"
    return CPUInt8(arch, isa, any(f in flags for f in _EXACT_FLAGS))


def _flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    try:  # other systems: numpy's table (it has no AVX-VNNI or AMX key)
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features  # type: ignore[no-redef]
    names = {"AVX512VNNI": "avx512_vnni", "AVX512BW": "avx512bw", "AVX2": "avx2"}
    return {flag for key, flag in names.items() if features.get(key)}
