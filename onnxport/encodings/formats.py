"""Read AIMET encodings (0.6.1, 1.0.0, 2.0.0, 2.1.0) into one normalised :class:`Encoding`.

Everything here works on the file alone: the whole file is validated before any graph is
touched, and every error names the tensor and the field. What only the graph can settle (a
legacy per-channel axis, a legacy block layout) is left marked on the entry for ``axes.py``.
"""


from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from .dtypes import (  # noqa: F401 -- the names readers of this module import
    DTYPES,
    ENC_TYPES,
    ENCODES_MARK,
    NUMPY_TYPES,
    PLAIN_FLOATS,
    VERSIONS,
    DType,
    Encoding,
    ScaleMeta,
    is_integer,
    layout_param,
    signed_twin,
    unsigned_twin,
)
from .reading import (  # noqa: F401
    STREAM_ABOVE_BYTES,
    StreamedEncodings,
    effective_scale_problem,
    load_encodings,
    scale_problem,
    section_of,
    shown_name,
    smallest_integer_type,
)
from .v0_6_1 import parse_061
from .v1_0_0 import parse_100
from .v2 import parse_2x


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
            found, section = section_of(data, key, dict, {})
            if found is not dict:
                raise InvalidArgumentError(f"Section '{key}' of a 0.6.1 encodings file must be an object, not {found.__name__}.")
            for name, value in section:
                if names.get(name, key) != key:
                    raise InvalidArgumentError(f"Tensor(s) ['{name}'] appear in both 'param_encodings' and 'activation_encodings'; each tensor is one or the other.")
                names[name] = key
                keep(name, parse_061, name, value, kind)
    elif version == "1.0.0":
        seen: dict[str, str] = {}
        for key, kind in (("param_encodings", "param"), ("activation_encodings", "activation")):
            found, section = section_of(data, key, list, [])
            if found is not list:
                raise InvalidArgumentError(f"Section '{key}' of a 1.0.0 encodings file must be a list, not {found.__name__}.")
            for index, entry in enumerate(section):
                name = _entry_name(entry, index, key)
                if name in seen:
                    where = "twice in" if seen[name] == key else "in both 'param_encodings' and 'activation_encodings' of"
                    raise InvalidArgumentError(f"Tensor '{name}' appears {where} the file; each tensor takes one encoding.")
                seen[name] = key
                keep(name, parse_100, entry, kind)
    else:
        found, section = section_of(data, "encodings", list, None)
        if found is not list:
            raise InvalidArgumentError(f"A version {version} encodings file needs an 'encodings' list, not {found.__name__}.")
        seen_names: set[str] = set()
        for index, entry in enumerate(section):
            name = _entry_name(entry, index, "encodings")
            if name in seen_names:
                raise InvalidArgumentError(f"Tensor '{name}' appears twice in 'encodings'; each tensor takes one encoding.")
            seen_names.add(name)
            keep(name, parse_2x, entry, version)
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
