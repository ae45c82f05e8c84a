"""What every benchmark shares: a typed configuration read from command-line flags, and one table renderer.

A benchmark module defines ``Config`` (a frozen dataclass whose fields, made with :func:`option`, are its
flags), ``run(config) -> dict`` (figures that go to the run's results file) and ``report(results) -> str``
(its tables, rendered by :func:`table` from those figures alone, so a stored results file prints again).
Each field ``some_name`` is the flag ``--some-name``; the environment variable
``ONNXPORT_BENCH_<BENCHMARK>_<FIELD>`` is read only when the flag is not given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def option(default: Any, help: str, *, choices: Sequence[str] | None = None) -> Any:
    """A configuration field: its default, the ``--help`` line, and for text fields (or lists of
    them) the values allowed."""
    if isinstance(default, list):
        raise TypeError("a list default would be shared between configs; give a tuple")
    return dataclasses.field(default=default, metadata={"help": help, "choices": tuple(choices) if choices else None})


def env_name(benchmark: str, field: str) -> str:
    """The environment variable that stands in for a flag the command line did not give."""
    return f"ONNXPORT_BENCH_{benchmark}_{field}".upper()


def _kind(hint: Any) -> tuple[type, bool, bool]:
    """(the scalar type, whether it is a tuple of them, whether None is allowed) of a field's type."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True, optional
    if hint not in (int, float, str, bool):
        raise TypeError(f"a benchmark option must be int, float, str, bool or a tuple of one of them, not {hint!r}")
    return hint, False, optional


def parser_for(config_type: type, benchmark: str) -> argparse.ArgumentParser:
    """The command-line parser of ``config_type``'s flags, its description the benchmark's first line."""
    module_doc = sys.modules[config_type.__module__].__doc__ or ""
    parser = argparse.ArgumentParser(prog=f"python -m bench {benchmark}", description=module_doc.strip().split("\n")[0])
    hints = typing.get_type_hints(config_type)
    for field in dataclasses.fields(config_type):
        scalar, many, _ = _kind(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        variable = env_name(benchmark, field.name)
        shown = (",".join(map(str, field.default)) or "none") if many else field.default
        helped = f"{field.metadata.get('help', '')} (default: {shown}; environment: {variable})"
        if scalar is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=helped)
        else:
            parser.add_argument(flag, dest=field.name, default=None, metavar="A,B" if many else scalar.__name__.upper(),
                                help=helped)
    return parser


def _value(text: str, scalar: type, many: bool, optional: bool, choices: Sequence[str] | None, name: str) -> Any:
    if optional and text.lower() in ("", "none"):
        return None
    items = [t.strip() for t in text.split(",") if t.strip()] if many else [text.strip()]
    try:
        values = [(t.lower() in ("1", "true", "yes", "on")) if scalar is bool else scalar(t) for t in items]
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} takes {scalar.__name__} values, not {text!r}") from None
    unknown = [v for v in values if choices and v not in choices]
    if unknown or (many and not values):
        raise ValueError(f"--{name.replace('_', '-')}: {', '.join(map(str, unknown)) or 'nothing given'} is not one of "
                         f"{', '.join(choices or ())}")
    return tuple(values) if many else values[0]


def parse_config(config_type: type[C], argv: Sequence[str], benchmark: str, *, known_only: bool = False
                 ) -> tuple[C, list[str]]:
    """The ``config_type`` that ``argv`` (flags, then the environment, then the defaults) describes,
    and the flags it did not know (with ``known_only``; otherwise an unknown flag exits as argparse
    does, status 2, naming it)."""
    parser = parser_for(config_type, benchmark)
    args, rest = parser.parse_known_args(list(argv)) if known_only else (parser.parse_args(list(argv)), [])
    hints = typing.get_type_hints(config_type)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config_type):
        given = getattr(args, field.name)
        scalar, many, optional = _kind(hints[field.name])
        if given is None:
            given = os.environ.get(env_name(benchmark, field.name))
        if given is None or isinstance(given, bool):
            values[field.name] = field.default if given is None else given
            continue
        try:
            values[field.name] = _value(given, scalar, many, optional, field.metadata.get("choices"), field.name)
        except ValueError as error:
            parser.error(str(error))
    config = config_type(**values)
    check = getattr(config, "check", None)
    if check is not None:
        try:
            check()
        except ValueError as error:
            parser.error(str(error))
    return config, rest


def cell(value: Any, spec: str = "") -> str:
    """One table cell: ``value`` formatted by ``spec``, ``-`` when it is missing (None or not a number
    where a number's format is asked)."""
    if value is None:
        return "-"
    if spec and not isinstance(value, (int, float)):
        return str(value) if isinstance(value, str) else "-"
    return format(value, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | Sequence[str] = (),
          notes: Sequence[str] = ()) -> str:
    """A Markdown table under its title lines and above its notes, columns padded to line up in a
    terminal; the form docs/benchmarks.md keeps, so a run's tables paste in as they are.

    Raises:
        ValueError: a row has a different number of cells than the header.
    """
    cells = [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(header):
            raise ValueError(f"a table row has {len(row)} cells for {len(header)} columns: {row}")
    widths = [max([len(h), 3, *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    titles = [title] if isinstance(title, str) else list(title)
    body = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)]
    return "\n".join([*titles, *([""] if titles else []), *body, *([""] if notes else []), *notes])


@contextlib.contextmanager
def scratch(out_dir: str | None, prefix: str) -> Iterator[Path]:
    """The folder a benchmark writes its files in: ``out_dir`` (created, kept) or a temporary one,
    removed afterwards."""
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        yield Path(out_dir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder)
