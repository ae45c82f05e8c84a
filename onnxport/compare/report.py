"""One report type for every comparison of two runs: per output, its figures and its verdict."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError

#: Cosine at or above which a file agrees with its model whatever the model's own floor.
FAITHFUL_COSINE = 0.9999
#: The smallest float floor a comparison uses: one float32 rounding (half an ulp, relative). A model
#: whose float32 run equals its float64 run (a single exact op) still allows its file that much.
FLOAT32_ROUNDING = 2.0**-24


@dataclass(frozen=True)
class OutputResult:
    """How one output of a run compares with the same output of the reference run.

    Every figure is computed for every strategy (they cost little next to the runs), so a report
    read later answers any question; ``passed`` is the strategy's verdict, ``None`` when it sets
    no criterion (a measurement), and ``criterion`` says in words what was required.
    """

    name: str
    shape: tuple[int, ...]
    max_abs_error: float
    max_rel_error: float
    cosine_similarity: float
    top1_agreement: float
    passed: bool | None = None
    criterion: str = ""
    #: scale of the last DequantizeLinear before the output, and the error in those steps
    output_scale: float | None = None
    max_error_in_steps: float | None = None
    #: cosines of the model with itself run with its float ops rounding differently, one per seed
    #: (``compare_qdq(..., rounding_floor=True)``; see :func:`onnxport.rounding_floor`). Flips at
    #: rounding boundaries are rare events, so judge a file by the range, not by its minimum.
    rounding_floor: tuple[float, ...] | None = None
    #: float proofs (``compare_onnx(..., rounding_floor=True)``): against the model run in float64,
    #: the file's relative distance ``‖file − ref‖ / ‖ref‖`` and the model's own float32 run's (its
    #: float floor); the verdict is their ratio against a documented multiple
    float_distance: float | None = None
    float_floor: float | None = None
    note: str = ""

    @property
    def floor_ratio(self) -> float | None:
        """The file's distance from the float64 reference over the model's own float32 floor
        (the floor taken as at least one float32 rounding, 2⁻²⁴)."""
        if self.float_distance is None or self.float_floor is None:
            return None
        return self.float_distance / max(self.float_floor, FLOAT32_ROUNDING)

    @property
    def within_floor(self) -> bool | None:
        """The fidelity criterion for a random-weight model: at most twice as far from its model as
        the model's own one-ulp floor (1 - cosine <= 2 (1 - lowest floor seed)), or at cosine >=
        0.9999. ``None`` when no floor was measured."""
        if self.rounding_floor is None:
            return None
        return self.cosine_similarity >= FAITHFUL_COSINE or 1 - self.cosine_similarity <= 2 * (1 - min(self.rounding_floor))


@dataclass(frozen=True)
class Report:
    """Every output of one comparison: ``bool(report)`` is the verdict, ``str`` a table,
    ``as_dict``/``save`` what to keep.

    Attributes:
        outputs: one :class:`OutputResult` per output, in the file's order.
        strategy: the strategy that judged them, in words.
        n_samples: inputs in the sample.
        runners: (what was checked, what it was checked against).
    """

    outputs: tuple[OutputResult, ...]
    strategy: str = ""
    n_samples: int = 0
    runners: tuple[str, str] = ("", "")
    tolerances: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool | None:
        """True when every output passed; ``None`` when the strategy set no criterion."""
        verdicts = [o.passed for o in self.outputs]
        if any(v is None for v in verdicts):
            return None
        return all(verdicts)

    def __bool__(self) -> bool:
        verdict = self.passed
        if verdict is None:
            raise InvalidArgumentError(
                f"This report measures ({self.strategy}) but sets no criterion, so it has no verdict; give the "
                "comparison a criterion (compare_qdq(..., rounding_floor=True), a tolerance) or read its figures."
            )
        return verdict

    @property
    def rtol(self) -> float | None:
        return self.tolerances.get("rtol")

    @property
    def atol(self) -> float | None:
        return self.tolerances.get("atol")

    def failed(self) -> list[OutputResult]:
        return [o for o in self.outputs if o.passed is False]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`as_dict` as JSON (atomically)."""
        from .._core.io import write_text_atomic

        return write_text_atomic(path, json.dumps(self.as_dict(), indent=2))

    def __str__(self) -> str:
        steps = any(o.max_error_in_steps is not None for o in self.outputs)
        floors = any(o.rounding_floor is not None for o in self.outputs)
        float_floors = any(o.float_floor is not None for o in self.outputs)
        verdicts = any(o.passed is not None for o in self.outputs)
        width = max([16, *(len(o.name) + 1 for o in self.outputs)])
        head = (f"{'output':<{width}} {'shape':<16} {'max abs':>10} {'max rel':>10}" + (f" {'steps':>7}" if steps else "")
                + f" {'cosine':>9} {'top-1':>7}" + ("  rounding floor (min-max)" if floors else "")
                + (f" {'distance':>10} {'floor':>10} {'ratio':>7}" if float_floors else "") + ("  ok" if verdicts else ""))
        lines = [f"{self.strategy} on {self.n_samples} inputs" if self.strategy else "", head]
        for o in self.outputs:
            line = f"{o.name:<{width}} {list(o.shape)!s:<16} {o.max_abs_error:>10.4g} {o.max_rel_error:>10.3g}"
            if steps:
                line += f" {o.max_error_in_steps:7.2f}" if o.max_error_in_steps is not None else "       -"
            line += f" {o.cosine_similarity:>9.6f} {o.top1_agreement:>7.2%}"
            if floors and o.rounding_floor is not None:
                verdict = "within 2x the floor" if o.within_floor else "BELOW 2x the floor: the file computes something else"
                line += f"  {min(o.rounding_floor):.6f}-{max(o.rounding_floor):.6f}  {verdict}"
            if float_floors:
                ratio = o.floor_ratio
                line += (f" {o.float_distance:>10.3g} {o.float_floor:>10.3g} {ratio:>7.2f}" if ratio is not None
                         else f" {'-':>10} {'-':>10} {'-':>7}")
            if verdicts:
                line += "  " + {True: "yes", False: "NO", None: "-"}[o.passed]
            if o.note:
                line += f"  ({o.note})"
            lines.append(line)
        return "\n".join(line for line in lines if line)
