"""How two runs are compared: a strategy judges each output, one :func:`compare_runs` applies it.

A strategy is a small frozen object with a verdict for one output (``judge``) and a sentence
saying what it requires; per-output strategies override the default one by output name, the
way a tolerance can be looser for one output than for the rest.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, VacuousCheckWarning
from ..rounding import cosine
from .report import FAITHFUL_COSINE, OutputResult, Report
from .results import RunResults


class Strategy:
    """A criterion for one output; subclasses set :meth:`judge` and :meth:`describe`."""

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool | None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def tolerances(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class Measure(Strategy):
    """No criterion: the figures only (``bool`` of the report then refuses to answer)."""

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool | None:
        return None

    def describe(self) -> str:
        return "measured, no criterion"


@dataclass(frozen=True)
class Exact(Strategy):
    """The same dtype, shape and bytes: a rewrite that must change no value."""

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool:
        return got.dtype == ref.dtype and got.shape == ref.shape and got.tobytes() == ref.tobytes()

    def describe(self) -> str:
        return "identical outputs"


@dataclass(frozen=True)
class ScaledAllclose(Strategy):
    """Each element within ``atol · max(1, M) + rtol · |expected|``, ``M`` the output's largest
    magnitude: float kernels that add in another order round in proportion to the values they
    add, so an element near zero in an output that reaches 45 may be 1e-4 off in a correct file
    (as ``numpy.allclose`` for outputs within ±1). NaN fails; equal infinities pass."""

    rtol: float = 1e-3
    atol: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidArgumentError(f"{name} must be a number >= 0, not {value!r}.")

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool:
        if got.shape != ref.shape:
            return False
        got64, ref64 = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        finite = np.abs(ref64[np.isfinite(ref64)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        diff = np.abs(got64 - ref64)
        return bool(np.all((got64 == ref64) | (diff <= self.atol * scale + self.rtol * np.abs(ref64))))

    def describe(self) -> str:
        return f"within atol {self.atol:g} (x max(1, largest magnitude)) + rtol {self.rtol:g}"

    def tolerances(self) -> dict[str, Any]:
        return {"rtol": self.rtol, "atol": self.atol}


@dataclass(frozen=True)
class CosineAtLeast(Strategy):
    """Cosine similarity at least ``threshold`` (integer outputs must be equal)."""

    threshold: float

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool:
        if got.shape != ref.shape:
            return False
        if not np.issubdtype(ref.dtype, np.floating):
            return bool(np.array_equal(got, ref))
        return result.cosine_similarity >= self.threshold

    def describe(self) -> str:
        return f"cosine >= {self.threshold:g}"

    def tolerances(self) -> dict[str, Any]:
        return {"min_cosine": self.threshold}


@dataclass(frozen=True)
class WithinFloor(Strategy):
    """At most twice as far from the reference as the model's own one-ulp rounding floor (or at
    cosine >= 0.9999): the fidelity bound of a random-weight model. Needs ``floors``."""

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool | None:
        return result.within_floor

    def describe(self) -> str:
        return f"within 2x the model's rounding floor (or cosine >= {FAITHFUL_COSINE})"


@dataclass(frozen=True)
class WithinFloatFloor(Strategy):
    """The float proof: against the model run in float64, the file's relative distance at most
    ``multiple`` times the model's own float32 run's (its float floor, at least one float32
    rounding). Integer outputs must be equal. Needs ``float_floors``."""

    multiple: float

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool | None:
        if got.shape != ref.shape:
            return False
        if not np.issubdtype(ref.dtype, np.floating):
            return bool(np.array_equal(got, ref))
        ratio = result.floor_ratio
        return None if ratio is None else bool(ratio <= self.multiple)

    def describe(self) -> str:
        return f"within {self.multiple:g}x the model's own float32 floor (its float64 run as the reference)"

    def tolerances(self) -> dict[str, Any]:
        return {"float_floor_multiple": self.multiple}


def relative_distance(got: np.ndarray, ref: np.ndarray) -> float:
    """``‖got − ref‖₂ / ‖ref‖₂`` in float64 (0 for two zero outputs, inf for NaN or a shape mismatch)."""
    if got.shape != ref.shape:
        return float("inf")
    a, b = np.asarray(got, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    diff = float(np.linalg.norm(a - b))
    if not np.isfinite(diff):
        return 0.0 if np.array_equal(a, b, equal_nan=False) else float("inf")
    norm = float(np.linalg.norm(b))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


@dataclass(frozen=True)
class TopOneAtLeast(Strategy):
    """The argmax over the last axis agrees on at least ``threshold`` of the inputs."""

    threshold: float

    def judge(self, got: np.ndarray, ref: np.ndarray, result: OutputResult) -> bool:
        return result.top1_agreement >= self.threshold

    def describe(self) -> str:
        return f"top-1 agreement >= {self.threshold:.2%}"

    def tolerances(self) -> dict[str, Any]:
        return {"min_top1": self.threshold}


def _figures(name: str, got: np.ndarray, ref: np.ndarray, scale: float | None) -> OutputResult:
    if got.shape != ref.shape:
        return OutputResult(name, tuple(ref.shape), float("inf"), float("inf"), float("nan"), 0.0,
                            note=f"shape {list(got.shape)} against {list(ref.shape)}")
    got64, ref64 = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    diff = np.abs(got64 - ref64)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(ref64), np.finfo(np.float32).tiny)).max()) if diff.size else 0.0
    top1 = (float(np.mean(ref.argmax(-1) == got.argmax(-1)))
            if ref.ndim >= 1 and ref.shape[-1] > 0 and ref.size else 1.0)
    return OutputResult(name, tuple(ref.shape), max_abs, max_rel, cosine(got64, ref64), top1,
                        output_scale=scale, max_error_in_steps=max_abs / scale if scale else None)


def compare_runs(
    got: RunResults,
    reference: RunResults,
    strategy: Strategy | None = None,
    *,
    per_output: Mapping[str, Strategy] | None = None,
    scales: Mapping[str, float | None] | None = None,
    floors: Mapping[str, tuple[float, ...]] | None = None,
    float_floors: Mapping[str, float] | None = None,
) -> Report:
    """Compare two runs output by output (paired by position, named by ``got``).

    Args:
        got, reference: the runs; a run can be one saved earlier (:meth:`RunResults.load`).
        strategy: the default criterion (:class:`Measure` when ``None``).
        per_output: a strategy for some outputs by name, overriding the default for them.
        scales: per output, the quantization step its error is also given in.
        floors: per output, the model's rounding-floor cosines (for :class:`WithinFloor`).
        float_floors: per output, the model's float32 run's relative distance from its float64
            run, which is then ``reference`` (for :class:`WithinFloatFloor`).
    """
    strategy = strategy if strategy is not None else Measure()
    per_output = dict(per_output or {})
    if len(got.outputs) != len(reference.outputs):
        raise InvalidArgumentError(
            f"{got.runner} gave {len(got.outputs)} outputs but {reference.runner} gave {len(reference.outputs)}; "
            "compare runs of the same model (was the file exported from this model?)."
        )
    unknown = sorted(set(per_output) - set(got.outputs))
    if unknown:
        raise InvalidArgumentError(f"per_output names {unknown}, which are not outputs of {got.runner}: {got.names}.")
    results = []
    for (name, a), b in zip(got.outputs.items(), reference.arrays):
        a, b = np.asarray(a), np.asarray(b)
        judge = per_output.get(name, strategy)
        figures = _figures(name, a, b, (scales or {}).get(name))
        if floors is not None and name in floors:
            figures = _with(figures, rounding_floor=tuple(floors[name]))
        if float_floors is not None and name in float_floors:
            figures = _with(figures, float_floor=float(float_floors[name]), float_distance=relative_distance(a, b))
            if isinstance(judge, WithinFloatFloor) and _admits_zeros(judge, figures, b):
                figures = _with(figures, note="an all-zero output would pass: the model's float32 run is this far off")
                warnings.warn(
                    f"The float proof of output {name!r} cannot fail for a file that outputs zeros: the model's own "
                    f"float32 run is {figures.float_floor:.3g} (relative) from its float64 run and the proof allows "
                    f"{judge.multiple:g} times that. The model's float32 outputs underflow or cancel on this input "
                    "(random weights whose activations vanish do this); prove the file with trained weights, or "
                    "inputs that keep the outputs within float32's range.",
                    VacuousCheckWarning,
                    stacklevel=2,
                )
        verdict = judge.judge(a, b, figures)
        results.append(_with(figures, passed=verdict, criterion=judge.describe()))
    described = strategy.describe() + (f"; {', '.join(f'{n}: {s.describe()}' for n, s in per_output.items())}" if per_output else "")
    return Report(tuple(results), described, reference.n_samples, (got.runner, reference.runner), strategy.tolerances())


def _admits_zeros(strategy: WithinFloatFloor, figures: OutputResult, ref: np.ndarray) -> bool:
    # An all-zero file is at relative distance exactly 1 from any non-zero reference.
    floor = figures.float_floor
    return (floor is not None and np.issubdtype(ref.dtype, np.floating) and bool(np.any(ref))
            and strategy.multiple * floor >= 1.0)


def _with(result: OutputResult, **changes: Any) -> OutputResult:
    from dataclasses import replace

    return replace(result, **changes)
