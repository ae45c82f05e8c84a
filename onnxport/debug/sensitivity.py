"""Which layers quantization hurts, and the fewest to keep in float for an accuracy budget.

``sensitivity`` re-quantizes the float model once per layer with that layer alone left in float
(``Quantizer(float_layers=[layer])``) and measures how much closer to the float model it gets.
The model is captured once; each trial annotates, calibrates and converts a copy, so the cost is
linear in the number of layers. ``quantize_within_budget`` then keeps the most sensitive layers
in float, one more at a time, until the quantized model meets the budget.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..quantize.calibration import read_calibration

METRICS = ("cosine", "top1")


def _describe_inputs(keys: tuple[str, ...] | None) -> str:
    return "positional tuples" if keys is None else f"the keyword inputs {sorted(keys)}"


def _same_inputs(calibration: tuple[str, ...] | None, batches: list[tuple[torch.Tensor, ...]],
                 names: tuple[str, ...] | None) -> list[tuple[torch.Tensor, ...]]:
    """``eval_data``'s batches in the calibration batches' input order; both must give the same
    keyword inputs, or both positional ones."""
    if calibration == names:
        return batches
    if calibration is None or names is None or set(calibration) != set(names):
        raise InvalidArgumentError(
            f"eval_data gives {_describe_inputs(names)} but calibration_data gives {_describe_inputs(calibration)}; "
            "give both the same inputs, the same way."
        )
    order = [names.index(n) for n in calibration]
    return [tuple(batch[i] for i in order) for batch in batches]


def model_outputs(model: Any, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    from .._core.inputs import flatten_outputs
    from .._core.torch_helpers import without_kv_cache

    with torch.no_grad(), without_kv_cache(model):
        return torch.cat([flatten_outputs(model(*b))[0].detach().float().reshape(b[0].shape[0], -1) for b in batches])


def score(reference: torch.Tensor, got: torch.Tensor, metric: str) -> float:
    """``cosine``: mean per-sample cosine of the first output; ``top1``: argmax agreement."""
    if metric == "top1":
        return float((reference.argmax(-1) == got.argmax(-1)).float().mean())
    return float(torch.nn.functional.cosine_similarity(reference, got, dim=-1).mean())


class _Trials:
    """The float model captured once; each trial quantizes a fresh copy of the capture."""

    def __init__(self, model: torch.nn.Module, quantizer: Any, calibration_data: Any, eval_data: Any,
                 metric: str, dynamic_batch: bool) -> None:
        from .._core.inputs import positional_forward
        from .._core.torch_helpers import require_module
        from ..quantize.quantizer import Quantizer, capture_program

        require_module(model)
        if not isinstance(quantizer, Quantizer) or quantizer.backend != "pt2e" or quantizer.method != "static":
            raise InvalidArgumentError(
                f"quantizer must be a Quantizer(backend='pt2e') for static quantization, not {quantizer!r}."
            )
        if metric not in METRICS:
            raise InvalidArgumentError(f"metric must be one of {', '.join(map(repr, METRICS))}, not {metric!r}.")
        self.quantizer, self.metric, self.dynamic_batch = quantizer, metric, dynamic_batch
        # Batches of keyword inputs (a transformers model's input_ids and attention_mask) are read
        # in the first calibration batch's key order; the capture takes them positionally in it.
        self.batches, self.names = read_calibration(calibration_data, model, None)
        self.eval = _same_inputs(self.names, *read_calibration(eval_data, model, None, argument="eval_data"))
        work = copy.deepcopy(model).eval()
        with positional_forward(work, self.names):
            self.reference = model_outputs(work, self.eval)
            self.captured = capture_program(work, self.batches[0], dynamic_batch)
        self.model = model
        self.count = 0
        self.seconds = 0.0

    def quantize(self, float_layers: Sequence[str]) -> Any:
        from ..quantize.placement import check_skip_names
        from ..quantize.quantizer import record_names

        check_skip_names(self.model, list(float_layers), "float_layers")
        trial = copy.copy(self.quantizer)
        trial.float_layers = [*self.quantizer.float_layers, *float_layers]
        start = time.perf_counter()
        quantized = record_names(trial._quantize_captured(copy.deepcopy(self.captured), self.batches,
                                                           self.dynamic_batch), self.names)
        gc.collect()  # the graphs of the last trial hold each other in cycles: free them now, not later
        self.seconds += time.perf_counter() - start
        self.count += 1
        return quantized

    def measure(self, float_layers: Sequence[str]) -> tuple[float, Any]:
        quantized = self.quantize(float_layers)
        return score(self.reference, model_outputs(quantized, self.eval), self.metric), quantized

    def rank(self, names: Sequence[str], baseline: float) -> list[tuple[str, float]]:
        """``(layer, gain)`` for each layer alone in float, most sensitive first (a trial each)."""
        from tqdm.auto import tqdm

        gains = [(name, self.measure([name])[0] - baseline)
                 for name in tqdm(names, desc="sensitivity", unit="layer", leave=False, disable=None)]
        return sorted(gains, key=lambda item: -item[1])

    def layers(self) -> list[str]:
        from ..quantize.placement import quantized_layers
        from ..quantize.quantizer import OnnxportPT2EQuantizer  # noqa: F401 - the annotation lives there

        annotated = copy.deepcopy(self.captured)
        self.quantizer._pt2e_quantizer(is_qat=False).annotate(annotated)
        return quantized_layers(annotated)


def sensitivity(
    model: torch.nn.Module,
    calibration_data: Iterable[Any],
    eval_data: Iterable[Any],
    *,
    metric: str = "cosine",
    quantizer: Any = None,
    layers: Sequence[str] | None = None,
    dynamic_batch: bool = True,
) -> list[tuple[str, float]]:
    """For each quantized layer, how much the model improves when that layer alone stays float.

    Args:
        model: the float ``nn.Module``.
        calibration_data: batches to calibrate every trial on (as for ``Quantizer.quantize``:
            tuples of tensors, or dicts of keyword inputs such as ``input_ids`` and
            ``attention_mask``).
        eval_data: batches to measure on, given the same way as ``calibration_data`` (dicts
            with the same keys); the reference is the float model's first output.
        metric: ``'cosine'`` (mean cosine similarity of the first output) or ``'top1'``
            (argmax agreement with the float model).
        quantizer: the settings every trial reuses (default ``Quantizer()``).
        layers: the module names to try; default every module whose weights are quantized.
        dynamic_batch: capture with a symbolic batch, as ``Quantizer.quantize`` does.

    Returns:
        ``[(layer, gain)]``, most sensitive first: ``gain`` is the metric with the layer in float
        minus the metric of the fully quantized model.
    """
    from ..quantize.quantizer import Quantizer

    trials = _Trials(model, quantizer or Quantizer(), calibration_data, eval_data, metric, dynamic_batch)
    names = list(layers) if layers is not None else trials.layers()
    if not names:
        raise InvalidArgumentError("the quantizer quantizes no layer with weights in this model: nothing to rank.")
    baseline, _ = trials.measure([])
    return trials.rank(names, baseline)


@dataclass(frozen=True)
class BudgetResult:
    """What ``quantize_within_budget`` chose, and what it measured on the way."""

    model: Any
    float_layers: tuple[str, ...]
    metric: str
    value: float
    budget: float
    fully_quantized_value: float
    ranking: tuple[tuple[str, float], ...]
    trials: int
    seconds: float
    latency: dict[str, float] | None = field(default=None)  # ms and speed-up vs FP32, when a target is set

    def __str__(self) -> str:
        lines = [
            (f"{self.metric} {self.value:.6f} (budget {self.budget}, fully quantized {self.fully_quantized_value:.6f}) "
             f"with {len(self.float_layers)} layer(s) in float: {list(self.float_layers)}"),
            f"{self.trials} trials in {self.seconds:.1f} s",
        ]
        if self.latency:
            lines.append(f"ONNX Runtime: {self.latency['ms']:.2f} ms at batch 1, {self.latency['speedup_vs_fp32']:.2f}x FP32")
        return "\n".join(lines)


def quantize_within_budget(
    model: torch.nn.Module,
    calibration_data: Iterable[Any],
    eval_data: Iterable[Any],
    *,
    budget: float,
    metric: str = "cosine",
    quantizer: Any = None,
    max_float_layers: int | None = None,
    ranking: Sequence[tuple[str, float]] | None = None,
    dynamic_batch: bool = True,
) -> BudgetResult:
    """Quantize ``model``, keeping the fewest, most sensitive layers in float to meet ``budget``.

    Layers are ranked by :func:`sensitivity` (one trial per layer); then the fewest top-ranked
    layers that meet ``budget`` are found by doubling their number and then halving the gap
    (about 2·log2(k) trials for k float layers). The returned model records them in its
    ``QuantSpec.float_layers``.

    Args:
        model: the float ``nn.Module``.
        calibration_data: calibration batches.
        eval_data: the batches the budget is measured on (given as ``calibration_data`` is).
        budget: the least acceptable metric: a cosine (e.g. ``0.999``) or a top-1 agreement
            with the float model (e.g. ``0.99``).
        metric: ``'cosine'`` or ``'top1'``.
        quantizer: the settings to quantize with (default ``Quantizer()``); with a ``target``
            the result's ONNX Runtime latency against FP32 is measured too.
        max_float_layers: the most layers it may keep in float (default: all of them).
        ranking: a :func:`sensitivity` result for the same model, data and quantizer, to skip
            ranking again (one trial per layer) when several budgets are tried.

    Raises:
        InvalidArgumentError: when even the largest allowed set of float layers misses the budget.
    """
    from ..quantize.quantizer import Quantizer

    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise InvalidArgumentError(f"budget must be a number in (0, 1] (a cosine or a top-1 agreement), not {budget!r}.")
    trials = _Trials(model, quantizer or Quantizer(), calibration_data, eval_data, metric, dynamic_batch)
    full, quantized = trials.measure([])
    ranked: list[tuple[str, float]] = list(ranking) if ranking is not None else []
    chosen: list[str] = []
    value = full
    if full < budget:
        ranked = trials.rank(trials.layers(), full) if ranking is None else sorted(ranked, key=lambda item: -item[1])
        limit = len(ranked) if max_float_layers is None else min(max_float_layers, len(ranked))
        found = _fewest(lambda k: trials.measure([name for name, _ in ranked[:k]]), limit, budget)
        if found is not None:
            k, value, quantized = found
            chosen = [name for name, _ in ranked[:k]]
        else:
            value = trials.measure([name for name, _ in ranked[:limit]])[0] if limit else full
            raise InvalidArgumentError(
                f"No set of float layers meets the budget: with the {limit} most sensitive layer(s) in float, "
                f"{metric} is {value:.6f} against the budget {budget} (fully quantized: {full:.6f}). Lower the "
                f"budget, allow more float layers (max_float_layers), or calibrate with more representative data."
            )
    latency = _latency(model, quantized, trials) if trials.quantizer.target is not None else None
    return BudgetResult(quantized, tuple(chosen), metric, value, float(budget), full, tuple(ranked),
                        trials.count, trials.seconds, latency)


def _fewest(measure: Any, limit: int, budget: float) -> tuple[int, float, Any] | None:
    """The smallest k in 1..limit whose top-k float layers meet ``budget``: doubling k until one
    does, then halving the gap (about 2·log2(k) trials instead of k; the metric is taken to grow
    with k, and the k returned is always one that was measured to meet the budget)."""
    seen: dict[int, tuple[float, Any]] = {}

    def meets(k: int) -> bool:
        if k not in seen:
            value, model = measure(k)
            # only the smallest k that meets the budget keeps its model: each is a whole network
            if value < budget or any(j < k and seen[j][0] >= budget for j in seen):
                model = None
            else:
                for j in [j for j in seen if j > k]:
                    seen[j] = (seen[j][0], None)
            seen[k] = (value, model)
        return seen[k][0] >= budget

    low, high = 0, 1  # low: known to miss (0 = fully quantized), high: the next to try
    while high < limit and not meets(high):
        low, high = high, min(limit, high * 2)
    if not meets(high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high, *seen[high]


def _latency(model: torch.nn.Module, quantized: Any, trials: _Trials) -> dict[str, float]:
    """ONNX Runtime latency at batch 1 of the result's Q/DQ file against the FP32 export."""
    import tempfile
    from pathlib import Path

    from ..exporters.float import export_onnx
    from ..exporters.qdq import export_qdq
    from ..runtime import ONNXModel

    sample = tuple(t[:1] for t in trials.eval[0])
    with tempfile.TemporaryDirectory() as scratch:
        fp32 = export_onnx(model, dict(zip(trials.names, sample)) if trials.names else sample,
                           Path(scratch) / "fp32.onnx")
        qdq = export_qdq(quantized, sample, Path(scratch) / "qdq.onnx", dynamic_batch=trials.dynamic_batch)
        base = ONNXModel(fp32).latency_ms(*sample)
        ms = ONNXModel(qdq).latency_ms(*sample)
    return {"ms": ms, "fp32_ms": base, "speedup_vs_fp32": base / ms}
