"""Running ONNX files: ``ONNXModel``, sessions, and latency measured interleaved."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .errors import InvalidArgumentError

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def _providers_for(device: str) -> tuple[list[str], dict | None, int | None]:
    if not isinstance(device, str):
        device = str(device)  # torch.device
    if device == "cpu":
        return ["CPUExecutionProvider"], None, None
    if device == "cuda" or device.startswith("cuda:"):
        index = 0
        if ":" in device:
            try:
                index = int(device.split(":", 1)[1])
            except ValueError:
                raise InvalidArgumentError(f"device '{device}' is not 'cuda:N' with an integer N.") from None
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise InvalidArgumentError(
                f"device '{device}' needs ONNX Runtime's CUDAExecutionProvider, which this install "
                f"lacks (available: {', '.join(ort.get_available_providers())}); install "
                f"onnxruntime-gpu, or use device='cpu'."
            )
        return ["CUDAExecutionProvider"], {"device_id": index}, index
    raise InvalidArgumentError(f"device must be 'cpu', 'cuda' or 'cuda:N', not '{device}'.")


def contrib_schema(name: str, domain: str = "com.microsoft") -> Any:
    """ONNX Runtime's schema of a contrib operator as an ``onnx.defs.OpSchema`` (onnx's registry
    lacks them), for builders that need one to emit the node, such as onnxscript's ``Op``.
    Attributes are all optional here: ONNX Runtime checks them when it loads the node."""
    from onnx import defs
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    found = [s for s in state.get_all_operator_schema() if s.name == name and s.domain == domain]
    if not found:
        raise InvalidArgumentError(f"This ONNX Runtime ({ort.__version__}) has no operator {domain}.{name}.")
    schema = max(found, key=lambda s: s.since_version)
    option = {str(o): getattr(defs.OpSchema.FormalParameterOption, str(o).rsplit(".", 1)[-1])
              for o in {p.option for p in (*schema.inputs, *schema.outputs)}}

    def parameters(formal: Any) -> list[Any]:
        return [defs.OpSchema.FormalParameter(p.name, p.typeStr, param_option=option[str(p.option)]) for p in formal]

    return defs.OpSchema(
        name, domain, schema.since_version, inputs=parameters(schema.inputs), outputs=parameters(schema.outputs),
        type_constraints=[(t.type_param_str, list(t.allowed_type_strs), "") for t in schema.type_constraints],
        attributes=[defs.OpSchema.Attribute(a.name, getattr(defs.OpSchema.AttrType, str(a.type).rsplit(".", 1)[-1]),
                                            required=False) for a in schema.attributes.values()],
    )


def make_session(
    model: str | os.PathLike | bytes,
    *,
    optimized: bool = True,
    providers: Sequence[Any] | None = None,
    session_options: ort.SessionOptions | None = None,
) -> ort.InferenceSession:
    """An ONNX Runtime session on CPU; ``optimized=False`` disables every graph optimisation."""
    options = session_options or ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=list(providers or ["CPUExecutionProvider"]))


class ONNXModel:
    """Run an ONNX file with a PyTorch-like call.

    Args:
        path: the ``.onnx`` file (external data beside it is found automatically).
        device: ``'cpu'``, ``'cuda'`` or ``'cuda:N'``; CUDA needs ONNX Runtime's CUDA provider and
            is never silently replaced by the CPU.
        providers: explicit ONNX Runtime providers, overriding ``device``'s choice.
        session_options: an ``onnxruntime.SessionOptions`` to build the session with.

    Call it with the inputs positionally or by input name. Torch tensors (any device) and numpy
    arrays are accepted; with torch inputs the outputs are torch tensors on ``device``, with numpy
    inputs numpy arrays. One output comes back alone, several as a tuple.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        device: str = "cpu",
        *,
        providers: Sequence[Any] | None = None,
        session_options: ort.SessionOptions | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise InvalidArgumentError(f"path '{self.path}' is not an ONNX file that exists.")

        chosen, options, index = _providers_for(device)
        self.device = "cpu" if index is None else f"cuda:{index}"
        if providers is None:
            providers = [(chosen[0], options)] if options else chosen
        try:
            self.session = make_session(self.path, providers=providers, session_options=session_options)
        except Exception:
            from ._core.io import read_onnx

            read_onnx(self.path, "path")  # a named error when the file is empty, truncated or not ONNX
            raise
        self._inputs = self.session.get_inputs()
        self._outputs = self.session.get_outputs()

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self._inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self._outputs]

    def __repr__(self) -> str:
        def sig(args) -> str:
            return ", ".join(f"{a.name}: {a.type.replace('tensor(', '').rstrip(')')}{list(a.shape)}" for a in args)

        return f"ONNXModel('{self.path}', device='{self.device}', inputs=({sig(self._inputs)}), outputs=({sig(self._outputs)}))"

    def _feeds(self, args: tuple, kwargs: dict) -> tuple[dict[str, np.ndarray], bool]:
        names = self.input_names
        if len(args) > len(names):
            raise InvalidArgumentError(
                f"{len(args)} positional inputs given, but the model takes {len(names)} ({', '.join(names)})."
            )
        given: dict[str, Any] = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise InvalidArgumentError(f"Unknown input '{key}'; the model's inputs are {', '.join(names)}.")
            if key in given:
                raise InvalidArgumentError(f"Input '{key}' given both positionally and by name.")
            given[key] = value
        missing = [n for n in names if n not in given]
        if missing:
            raise InvalidArgumentError(
                f"Missing input(s) {', '.join(missing)}: the model takes {len(names)} input(s) ({', '.join(names)})."
            )
        feeds: dict[str, np.ndarray] = {}
        any_torch = False
        for meta in self._inputs:
            value = given[meta.name]
            if hasattr(value, "detach") and hasattr(value, "cpu"):
                any_torch = True
                value = value.detach().cpu().numpy()
            elif not isinstance(value, np.ndarray):
                raise InvalidArgumentError(
                    f"Input '{meta.name}' must be a torch.Tensor or numpy array, not {type(value).__name__}."
                )
            expected = _ORT_TO_NUMPY.get(meta.type)
            if expected is not None and value.dtype != expected:
                raise InvalidArgumentError(
                    f"Input '{meta.name}' has dtype {value.dtype}, but the file expects "
                    f"{np.dtype(expected).name}; convert it first."
                )
            shape = list(meta.shape)
            if len(shape) != value.ndim or any(
                isinstance(d, int) and d != s for d, s in zip(shape, value.shape)
            ):
                raise InvalidArgumentError(
                    f"Input '{meta.name}' has shape {list(value.shape)}, but the file expects {shape} "
                    f"(names and None are free dimensions)."
                )
            feeds[meta.name] = np.ascontiguousarray(value)
        return feeds, any_torch

    def run_numpy(self, *args: Any, **kwargs: Any) -> list[np.ndarray]:
        """Run and return every output as a numpy array, in the file's output order."""
        feeds, _ = self._feeds(args, kwargs)
        return self.session.run(None, feeds)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        feeds, any_torch = self._feeds(args, kwargs)
        outputs: list[Any] = self.session.run(None, feeds)
        if any_torch:
            import torch

            outputs = [torch.from_numpy(np.asarray(o)).to(self.device) for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def latency_ms(self, *args: Any, repeat: int = 30, warmup: int = 5, **kwargs: Any) -> float:
        """Median wall time of one run on these inputs, in milliseconds, after ``warmup`` runs."""
        feeds, _ = self._feeds(args, kwargs)
        for _ in range(warmup):
            self.session.run(None, feeds)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            self.session.run(None, feeds)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def warmup(self, n: int = 3) -> ONNXModel:
        """Run ``n`` times on zeros (free dimensions set to 1) so later timings are steady."""
        feeds: dict[str, np.ndarray] = {}
        for meta in self._inputs:
            shape = [d if isinstance(d, int) else 1 for d in meta.shape]
            feeds[meta.name] = np.zeros(shape, dtype=_ORT_TO_NUMPY.get(meta.type, np.float32))
        for _ in range(n):
            self.session.run(None, feeds)
        return self


def interleaved_ms(
    paths: dict[str, str | os.PathLike],
    feeds: Sequence[dict[str, np.ndarray]],
    *,
    rounds: int,
    runs: int = 6,
    warmup: int = 3,
    session_options: Any = None,
) -> dict[str, list[list[float]]]:
    """Latency of several files measured side by side: ``{name: [per feed: each round's median
    milliseconds]}`` at ONNX Runtime's default level.

    In every round each file runs alone in a fresh session (an idle session's threads keep
    spinning and slow the next one: on two cores by up to half), in an order that rotates, so the
    machine's drift falls on every file alike; compare files by the median of the rounds' own
    ratios, not by a ratio of medians.
    """
    import gc

    times: dict[str, list[list[float]]] = {name: [[] for _ in feeds] for name in paths}
    names = list(paths)
    for turn in range(rounds):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            session = make_session(str(paths[name]), optimized=True, session_options=session_options)
            for index, feed in enumerate(feeds):
                for _ in range(warmup):
                    session.run(None, feed)
                samples = []
                for _ in range(runs):
                    start = time.perf_counter()
                    session.run(None, feed)
                    samples.append((time.perf_counter() - start) * 1e3)
                times[name][index].append(statistics.median(samples))
            del session
            gc.collect()
    return times


def session_options_for(optimized: bool) -> ort.SessionOptions | None:
    """ONNX Runtime's default level (``None``: its own defaults), or every graph optimisation off."""
    if optimized:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options
