"""``compare_onnx`` and ``verify_onnx``: an exported float file against the PyTorch model it came from.

Two criteria. The seed's fixed tolerance (``rtol``/``atol``), kept for code written against it, and
the model's own float floor (``rounding_floor=True``): the model run in float64 is the reference,
its float32 run's distance from that reference is the floor, and the file passes when its own
distance stays within :data:`FLOAT_FLOOR_MULTIPLE` times the floor. A fixed tolerance cannot know a
model's depth or a CPU's float kernels — too tight for a deep CNN at real size, too loose for a
shallow model with a real defect; the floor is measured on the model and the CPU at hand.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from ..errors import InvalidArgumentError, WeakerCheckWarning
from .report import OutputResult, Report
from .runners import onnx_batches, torch_batches
from .strategies import ScaledAllclose, WithinFloatFloor, compare_runs, relative_distance

T = TypeVar("T")

#: The names compare_onnx's results had before the one comparison model; the same types now.
ComparisonReport = Report
OutputComparison = OutputResult

#: The seed's fixed tolerance, the default without ``rounding_floor``.
DEFAULT_RTOL, DEFAULT_ATOL = 1e-3, 1e-5
#: How far a file may be from the float64 reference, in multiples of the model's own float32
#: run's distance. ONNX Runtime's float kernels are not torch's (other summation orders, other
#: approximations of exp, tanh and erf): measured on CNNs and transformers on AVX2, AVX-512 VNNI and
#: AMX CPUs, a right file sits at 0.5-3x the floor (docs/comparing.md); a wrong one (a weight
#: rounded through bfloat16, a LayerNorm epsilon changed, a GELU as its tanh form) at hundreds.
FLOAT_FLOOR_MULTIPLE = 8.0
#: The float64 copy of the model's weights may take at most this share of the memory available.
FLOAT64_MEMORY_SHARE = 0.5


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _float64_copy_bytes(model: Any) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * 8 for t in tensors.values() if t.is_floating_point())


def float64_copy(model: Any) -> Any:
    """A float64 deep copy of ``model`` (the model itself untouched), or, as a string, why there is
    none: a copy of its weights over :data:`FLOAT64_MEMORY_SHARE` of the memory available."""
    needed, available = _float64_copy_bytes(model), _available_memory()
    if available is not None and needed > FLOAT64_MEMORY_SHARE * available:
        return (f"a float64 copy of its weights ({needed / 2**30:.1f} GB) would take more than "
                f"{FLOAT64_MEMORY_SHARE:.0%} of the memory available ({available / 2**30:.1f} GB)")
    return copy.deepcopy(model).double()


@contextlib.contextmanager
def float64_model(model: Any, *, in_place: bool = False) -> Iterator[Any]:
    """``model`` in float64 for the block, or, as a string, why there is none.

    A copy (:func:`float64_copy`: the model beside it, three times its float32 weights); with
    ``in_place``, for a model nobody else holds (one the caller loaded), the model itself, widened
    for the block and narrowed back afterwards to each tensor's own dtype — exactly its values, since
    float64 holds every float32 and float16 value — with no second copy of its weights.
    """
    if not in_place:
        wide = float64_copy(model)
        try:
            yield wide
        finally:
            del wide
        return
    needed = _float64_copy_bytes(model) - sum(t.numel() * t.element_size() for t in _floating(model))
    available = _available_memory()
    if available is not None and needed > FLOAT64_MEMORY_SHARE * available:
        yield (f"widening its weights to float64 (another {needed / 2**30:.1f} GB) would take more than "
               f"{FLOAT64_MEMORY_SHARE:.0%} of the memory available ({available / 2**30:.1f} GB)")
        return
    dtypes = {id(t): t.dtype for t in _floating(model)}
    import torch

    narrowed = _retype(model, lambda t: torch.float64)
    try:
        yield model
    finally:
        _retype(model, lambda t: dtypes[narrowed[id(t)]])


@contextlib.contextmanager
def _stays_wide() -> Iterator[None]:
    """While a float64 run runs: a float64 tensor asked for float32 stays float64.

    Models "upcast" to float32 where float16 or bfloat16 would lose too much — attention's
    ``softmax(..., dtype=torch.float32)``, a norm's ``x.to(torch.float32)``, rotary angles'
    ``.float()`` — which in a float64 run is a downcast: the reference would round there as the
    float32 run does, and a mask's float64 minimum overflows to -inf (Gemma 2's padded rows became
    NaN). Only casts and ``dtype=`` requests of float32 on float64 tensors change; the values are
    what the model asks for, more exactly.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    casts = (torch.Tensor.to, torch.Tensor.type)

    class StaysWide(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
                if func is torch.Tensor.float:
                    return args[0]
                if kwargs.get("dtype") is torch.float32:
                    kwargs = {**kwargs, "dtype": torch.float64}
                if func in casts:
                    args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            return func(*args, **kwargs)

    with StaysWide():
        yield


#: Widened one at a time, the largest modules holding at most this share of a model's floating#: Widened one at a time, the largest modules holding at most this share of a model's floating
#: weights (a transformer's layers, its embeddings): the float64 run's extra memory.
WIDEN_UNIT_SHARE = 1 / 8


class _NotWide(RuntimeError):
    """A float32 tensor reached a module the float64 run widened (the model cast to a weight's
    dtype before that weight's module ran): the run is made again with the model widened whole."""


def float64_result(model: Any, run: Callable[[Any], T], *, in_place: bool = False) -> T | str:
    """``run`` given ``model`` in float64, or, as a string, why the model does not run so.

    Without ``in_place``, ``run`` gets a float64 copy (:func:`float64_copy`). With it, for a model
    nobody else holds, ``run`` gets the model itself with its weights widened a unit at a time —
    the largest modules holding at most :data:`WIDEN_UNIT_SHARE` of them (a transformer's layers)
    — each only while it runs and narrowed back exactly after, so the run holds a unit's weights
    twice, not the model's. Should a float32 tensor reach a unit or come out of ``run`` (the model
    read a weight outside its module's call, or cast to its dtype), or a one-dtype kernel meet both
    dtypes, the run is made again with the model widened whole in place (:func:`float64_model`).
    """
    from .._core.io import release_freed_memory

    try:
        if in_place:
            try:
                with _widened_per_call(model), _stays_wide():
                    result = run(model)
                if _all_wide(result):
                    return result
            except FLOAT64_ERRORS:
                pass  # run again widened whole: a model that cannot run in float64 fails there, saying why
        with float64_model(model, in_place=in_place) as wide:
            if isinstance(wide, str):
                return wide
            try:
                with _stays_wide():
                    return run(wide)
            except FLOAT64_ERRORS as error:
                return float64_failure(error)
    finally:
        # the float64 activations (30 s of audio through every layer) are freed, but glibc keeps
        # them for reuse: the captures and proofs that follow would sit on top of them
        release_freed_memory()


def _all_wide(result: Any) -> bool:
    """No float32 or float16 array or tensor anywhere in ``result`` (lists, tuples, dicts)."""
    if isinstance(result, (list, tuple)):
        return all(_all_wide(r) for r in result)
    if isinstance(result, dict):
        return all(_all_wide(r) for r in result.values())
    dtype = getattr(result, "dtype", None)
    if dtype is None:
        return True
    import torch

    if isinstance(result, torch.Tensor):
        return not result.is_floating_point() or result.dtype == torch.float64
    return not np.issubdtype(np.dtype(dtype), np.floating) or np.dtype(dtype) == np.float64


@contextlib.contextmanager
def _widened_per_call(model: Any) -> Iterator[None]:
    """The model's units (:data:`WIDEN_UNIT_SHARE`) in float64 while each runs, and, above them,
    each module's own weights while it runs; a weight two running modules share stays wide until
    both are done. Raises :class:`_NotWide` when a float32 tensor reaches a unit."""
    import torch

    def floating(tensors: Iterator[Any]) -> dict[int, Any]:
        return {id(t): t for t in tensors if t is not None and t.is_floating_point()}

    weights = floating(model.parameters())
    total = sum(p.numel() for p in weights.values())
    active: dict[int, int] = {}
    # each weight's own data, given back when its module is done: exact, and no new memory (a
    # model loaded from safetensors keeps viewing the mapped file, which no copy then doubles)
    narrow_data: dict[int, Any] = {}
    saved: dict[int, list[dict[str, Any]]] = {}
    handles = []

    def hooks(module: Any, members: list[Any], check: bool) -> None:
        def widen(_module: Any, args: Any, kwargs: Any) -> None:
            narrow = [a.dtype for a in (*args, *kwargs.values()) if check and isinstance(a, torch.Tensor)
                      and a.is_floating_point() and a.dtype != torch.float64]
            if narrow:
                raise _NotWide(f"a {narrow[0]} tensor reached {type(module).__name__}")
            for m in members:
                for p in m.parameters(recurse=False):
                    if id(p) in weights:
                        active[id(p)] = active.get(id(p), 0) + 1
                        if active[id(p)] == 1:
                            narrow_data[id(p)] = p.data
                            p.data = p.data.to(torch.float64)
                buffers = {n: b for n, b in m._buffers.items() if b is not None and b.is_floating_point()}
                saved.setdefault(id(m), []).append(buffers)
                m._buffers.update({n: b.to(torch.float64) for n, b in buffers.items()})

        def narrow(_module: Any, _args: Any, _output: Any) -> None:
            for m in members:
                for p in m.parameters(recurse=False):
                    if active.get(id(p)):
                        active[id(p)] -= 1
                        if active[id(p)] == 0:
                            p.data = narrow_data.pop(id(p))
                if saved.get(id(m)):
                    m._buffers.update(saved[id(m)].pop())

        handles.append(module.register_forward_pre_hook(widen, with_kwargs=True))
        handles.append(module.register_forward_hook(narrow, always_call=True))

    def place(module: Any, top: bool) -> None:
        inside = floating(module.parameters())
        if not top and sum(p.numel() for p in inside.values()) <= WIDEN_UNIT_SHARE * total:
            if inside or floating(module.buffers()):
                hooks(module, list(module.modules()), check=True)
            return
        if floating(module.parameters(recurse=False)) or floating(module._buffers.values()):
            hooks(module, [module], check=False)
        for child in module.children():
            place(child, False)

    place(model, True)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for key, data in narrow_data.items():  # a call cut short by an error left its weights wide
            weights[key].data = data
        for module in model.modules():
            for buffers in reversed(saved.get(id(module), [])):
                module._buffers.update(buffers)


def _retype(model: Any, dtype_of: Any) -> dict[int, int]:
    """Convert ``model``'s floating parameters (in place: each stays the same Parameter) and buffers
    to ``dtype_of(tensor)``, a tensor held twice converted once; returns new tensor id → old id."""
    done: dict[int, Any] = {}
    for module in model.modules():
        for table, parameters in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_floating_point():
                    continue
                if id(tensor) not in done:
                    if parameters:
                        tensor.data = tensor.data.to(dtype_of(tensor))
                        done[id(tensor)] = tensor
                    else:
                        done[id(tensor)] = tensor.to(dtype_of(tensor))
                table[name] = done[id(tensor)]
    return {id(new): old for old, new in done.items()}


def _floating(model: Any) -> list[Any]:
    return list({id(t): t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}.values())


def float64_failure(error: BaseException) -> str:
    """Why a model did not run in float64, in the words a :class:`WeakerCheckWarning` uses."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"it does not run in float64 ({type(error).__name__}: {first})"


#: what a model that cannot run in float64 raises (torch's dtype checks, a missing double kernel)
FLOAT64_ERRORS = (RuntimeError, TypeError, NotImplementedError)


def nonfinite_reason(wide: list[np.ndarray], narrow: list[np.ndarray]) -> str | None:
    """Why a float64 run is no reference: it has NaN or infinity where the float32 run is finite (a
    mask built from the dtype's minimum that overflows in float64, say)."""
    for a, b in zip(wide, narrow):
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a) | ~np.isfinite(b)):
            return "its float64 run gives NaN or infinity where its float32 run is finite"
    return None


def _float64_run(wide: Any, sample: Any, batches: list[tuple]) -> Any:
    """The float64 copy ``wide`` (or the reason there is none) on the batches (float inputs
    widened), or the reason it cannot run so."""
    from .._core.inputs import bind_sample
    from .._core.torch_helpers import eval_mode

    if isinstance(wide, str):
        return wide
    try:
        call, _, _ = bind_sample(wide, sample)
        wide_batches = [tuple(t.double() if t.is_floating_point() else t for t in batch) for batch in batches]
        with eval_mode(wide), _stays_wide():
            return torch_batches(call, wide_batches, "torch (float64)")
    except FLOAT64_ERRORS as error:
        return float64_failure(error)


def compare_onnx(
    model: Any,
    onnx_path: str | os.PathLike,
    sample: Any,
    rtol: float | None = None,
    atol: float | None = None,
    *,
    rounding_floor: bool = False,
) -> Report:
    """Run ``model`` and the ONNX file on ``sample`` and compare every output.

    Args:
        model: the PyTorch ``nn.Module`` the file was exported from (run in eval mode, then its
            mode is restored; a float64 copy for ``rounding_floor``, the model itself untouched).
        onnx_path: the ONNX file.
        sample: a tensor, a tuple of tensors (one per input) or a dict of them by name (as for
            :func:`export_onnx`).
        rtol, atol: the fixed tolerance (default ``1e-3``, ``1e-5``): each element within
            ``atol · max(1, M) + rtol · |expected|`` of PyTorch's, ``M`` the output's largest
            magnitude (:class:`ScaledAllclose`).
        rounding_floor: judge by the model's own float floor instead: the model run in float64 is
            the reference, its float32 run's relative distance from it (``‖a − b‖ / ‖b‖``) the
            floor, and each output of the file must be within :data:`FLOAT_FLOOR_MULTIPLE` times
            the floor (integer outputs equal). A model that cannot run in float64, or whose
            float64 copy would take over half the available memory, is judged by the fixed
            tolerance instead, with a :class:`~onnxport.errors.WeakerCheckWarning` naming why.
            Not with ``rtol``/``atol``.

    Returns the :class:`Report`: ``bool(report)`` is the verdict, ``str(report)`` the table (with
    ``rounding_floor``: per output the file's distance, the floor and their ratio).
    """
    return compare_onnx_sizes(model, onnx_path, [sample], rtol, atol, rounding_floor=rounding_floor)[0]


def compare_onnx_sizes(
    model: Any,
    onnx_path: str | os.PathLike,
    samples: list[Any],
    rtol: float | None = None,
    atol: float | None = None,
    *,
    rounding_floor: bool = False,
) -> list[Report]:
    """:func:`compare_onnx` on each of ``samples`` (the sizes of a symbolic axis, say), one
    :class:`Report` each, with one ONNX Runtime session and one float64 copy of the model for all."""
    from .._core.inputs import bind_sample, file_batch, split_batches
    from .._core.torch_helpers import eval_mode, require_module
    from ..runtime import ONNXModel

    if rounding_floor not in (True, False):
        raise InvalidArgumentError(f"rounding_floor must be True or False, not {rounding_floor!r}.")
    if rounding_floor and (rtol is not None or atol is not None):
        raise InvalidArgumentError(
            "rounding_floor=True judges by the model's own float floor, and rtol/atol by a fixed tolerance; "
            "give one of them."
        )
    require_module(model)
    strategy = ScaledAllclose(DEFAULT_RTOL if rtol is None else rtol, DEFAULT_ATOL if atol is None else atol)
    runner = ONNXModel(onnx_path)
    wide_model: Any = None
    reports = []
    for sample in samples:
        call, inputs, names = bind_sample(model, sample)
        # a file exported with a fixed batch runs the sample in batches of its own size
        batches = split_batches(inputs, 1, file_batch(onnx_path))
        with eval_mode(model):
            reference = torch_batches(call, batches)
        got = onnx_batches(runner, batches, names, "default level")
        if not rounding_floor:
            reports.append(compare_runs(got, reference, strategy))
            continue
        if wide_model is None:
            wide_model = float64_copy(model)
        wide = _float64_run(wide_model, sample, batches)
        reason = wide if isinstance(wide, str) else nonfinite_reason(wide.arrays, reference.arrays)
        if reason is not None:
            warnings.warn(
                f"compare_onnx(rounding_floor=True) cannot measure this model's float floor: {reason}. The file is "
                f"judged by the fixed tolerance instead ({strategy.describe()}).",
                WeakerCheckWarning,
                stacklevel=3,
            )
            reports.append(compare_runs(got, reference, strategy))
            continue
        floors = {name: relative_distance(ours, wide_out)
                  for name, ours, wide_out in zip(got.names, reference.arrays, wide.arrays)}
        reports.append(compare_runs(got, wide, WithinFloatFloor(FLOAT_FLOOR_MULTIPLE), float_floors=floors))
    return reports


def verify_onnx(
    model: Any,
    onnx_path: str | os.PathLike,
    sample: Any,
    rtol: float | None = None,
    atol: float | None = None,
    *,
    rounding_floor: bool = False,
) -> bool:
    """True when every output of the ONNX file matches the PyTorch model: within the fixed tolerance
    (default ``rtol=1e-3``, ``atol=1e-5``), or with ``rounding_floor=True`` within
    :data:`FLOAT_FLOOR_MULTIPLE` times the model's own float32 floor.

    See :func:`compare_onnx` for the per-output figures behind the answer.
    """
    return bool(compare_onnx(model, onnx_path, sample, rtol=rtol, atol=atol, rounding_floor=rounding_floor))
