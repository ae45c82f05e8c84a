"""``compare_layers``: where a Q/DQ file and the pt2e model it came from part ways, layer by layer.

Both sides are run on the same inputs and their tensors are compared at the quantization anchors
(every activation QuantizeLinear of the file and every quantize node of the model): the float
tensor entering each quantizer (the output of the layer before it) and what each
DequantizeLinear gives back. Anchors are matched by their scale and zero-point, shape and order
(the file's scales are the model's, ``export_qdq`` checks that), so the match needs no names.
Errors are in units of the anchor's own quantization step, which tells a one-step rounding
difference from a real defect, and the first row past one step says what broke and where:

* ``qparams``: a scale or zero-point in the file differs from the model's;
* ``float_kernel``: the float computation between two pairs (a Gelu, a Softmax…) gives other
  values, although what it reads agrees;
* ``structure``: an anchor with no counterpart on the other side;
* ``rounding``: at most one step apart — float arithmetic, not a defect;
* ``propagated``: off because something before it is (only the first cause is a defect).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from .._core.ir import const_tensor, read_model
from ..compare import OutputResult, Report
from ..errors import InvalidArgumentError
from ..inspection.view import QDQNode, qdq_nodes

CAUSES = ("rounding", "float_kernel", "qparams", "structure", "propagated")
#: the causes that are a defect of the file (rounding and its propagation are not)
_DEFECTS = ("qparams", "structure", "float_kernel")
#: One quantization step, with room for the float32 rounding of (q - zp) * scale itself.
_ONE_STEP = 1 + 1e-3
_UINT8_SHIFT = 128  # export_qdq's ActivationsToUint8Pass moves int8 zero-points by this


@dataclass(frozen=True)
class LayerRow:
    """One compared tensor.

    ``kind`` is ``'layer'`` (the float tensor a layer hands to its quantizer), ``'dequantize'``
    (what a DequantizeLinear of the file gives back) or ``'output'`` (a graph output).
    ``error_in_steps`` is the largest difference in units of the tensor's quantization step
    (``None`` for an output with no step); ``n_off`` counts the elements that differ at all.
    """

    index: int
    kind: str
    onnx_node: str
    op: str
    torch_node: str | None
    shape: tuple[int, ...]
    max_abs_error: float
    error_in_steps: float | None
    cosine: float
    n_off: int
    scale: float | None
    cause: str | None
    segment: tuple[str, ...] = field(default=())  # the file's float ops feeding this tensor
    note: str = ""
    isolated_error_in_steps: float | None = None  # the layer fed the model's own inputs: its kernel alone


@dataclass(frozen=True)
class LayerReport(Report):
    """Every compared tensor in the file's topological order, and where they first part ways.

    The comparison model's :class:`~onnxport.compare.Report`, per tensor instead of per output:
    ``bool(report)`` is true when no layer is at fault (``first_divergence`` is ``None``).
    ``first_divergence`` is the earliest defect (``qparams``, ``float_kernel``, ``structure``);
    ``first_over_one_step`` the earliest tensor more than one step off for any reason (one-step
    rounding flips that accumulate through later layers read as ``propagated``).
    """

    rows: tuple[LayerRow, ...] = ()
    first_divergence: LayerRow | None = None
    optimized: bool = False
    first_over_one_step: LayerRow | None = None

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def as_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "n_samples": self.n_samples, "optimized": self.optimized,
                "first_divergence": asdict(self.first_divergence) if self.first_divergence else None,
                "first_over_one_step": asdict(self.first_over_one_step) if self.first_over_one_step else None,
                "passed": self.passed}

    def worst(self, n: int = 12) -> list[LayerRow]:
        return sorted(self.rows, key=lambda r: -(r.error_in_steps if r.error_in_steps is not None else 0.0))[:n]

    def __str__(self) -> str:
        against = "ONNX Runtime optimised vs unoptimised" if self.optimized else "Q/DQ file vs pt2e model"
        lines = [f"compare_layers ({against}): {len(self.rows)} tensors on {self.n_samples} inputs"]
        if self.first_divergence is None and self.first_over_one_step is None:
            lines.append("  no tensor is more than one quantization step apart: the file follows the model.")
        elif self.first_divergence is None:
            o = self.first_over_one_step
            lines.append(f"  no defect: every layer computes what the model computes from the same inputs. One-step rounding "
                         f"flips add up from {o.op} '{o.onnx_node}' on ({o.error_in_steps:.1f} steps).")
        else:
            d = self.first_divergence
            steps = f"{d.error_in_steps:.1f} steps" if d.error_in_steps is not None else f"max error {d.max_abs_error:.3g}"
            lines.append(f"  first divergence: {d.op} '{d.onnx_node}' ({d.kind}), {steps}, cause: {d.cause}"
                         + (f" — {d.note}" if d.note else ""))
            if d.segment:
                lines.append(f"  float ops feeding it: {', '.join(d.segment)}")
        lines.append(f"  {'#':>4} {'kind':<10} {'op':<16} {'onnx node':<34} {'torch node':<28} {'steps':>7} {'max abs':>9} {'cosine':>9} {'cause':<12}")
        for r in sorted(self.worst(), key=lambda r: r.index):
            steps = f"{r.error_in_steps:7.2f}" if r.error_in_steps is not None else "      -"
            lines.append(f"  {r.index:>4} {r.kind:<10} {r.op[:16]:<16} {r.onnx_node[:34]:<34} {(r.torch_node or '-')[:28]:<28} "
                         f"{steps} {r.max_abs_error:>9.3g} {r.cosine:>9.6f} {r.cause or '':<12}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> Path:
        """A PNG of each tensor's error (in quantization steps) in topological order."""
        target = Path(path)
        if target.suffix.lower() != ".png":
            raise InvalidArgumentError(f"LayerReport.plot writes a PNG; give a path ending in .png, not '{target}'.")
        if not (target.parent if str(target.parent) else Path(".")).is_dir():
            raise InvalidArgumentError(f"The directory of '{target}' does not exist; create it first.")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise InvalidArgumentError("LayerReport.plot needs matplotlib: pip install 'onnxport[bench]'.") from None
        rows = [r for r in self.rows if r.error_in_steps is not None]
        fig, ax = plt.subplots(figsize=(max(7, len(rows) * 0.12), 3.8))
        colours = {"layer": "#2a7", "dequantize": "#27a", "output": "#a72"}
        for kind, colour in colours.items():
            chosen = [(i, r.error_in_steps) for i, r in enumerate(rows) if r.kind == kind]
            if chosen:
                ax.scatter([c[0] for c in chosen], [max(c[1], 1e-3) for c in chosen], s=10, color=colour, label=kind)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="one step")
        if self.first_divergence is not None and self.first_divergence in rows:
            at = rows.index(self.first_divergence)
            ax.axvline(at, color="#c33", linewidth=1, label=f"first divergence ({self.first_divergence.cause})")
        ax.set_yscale("log")
        ax.set_xlabel("tensor, in the file's topological order")
        ax.set_ylabel("max error, quantization steps\n(exact drawn at 0.001)")
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        handle, scratch = tempfile.mkstemp(suffix=".png", dir=target.parent if str(target.parent) else ".")
        os.close(handle)
        try:
            fig.savefig(scratch, dpi=120)
            os.replace(scratch, target)
        finally:
            plt.close(fig)
            if os.path.exists(scratch):
                os.unlink(scratch)
        return target


# -- the file's side ------------------------------------------------------------------------------------
@dataclass
class _FileAnchor:
    q_input: str  # the tensor the QuantizeLinear reads
    q_output: str
    layer: tuple[str, str]  # (name, op type) of the node computing q_input; (q_input, 'input') for a graph input
    index: int
    scale: float
    zero_point: int
    dtype: int
    readers: list[tuple[int, str, str, float, int]]  # (index, DQ output, DQ name, its scale, its zero-point)
    segment: tuple[str, ...]
    reads: frozenset[str]  # the dequantized tensors the layer before this quantizer reads


def _qparams(q: QDQNode) -> tuple[np.ndarray | None, int, int]:
    """(scale, first zero-point, zero-point type) of a Q/DQ node; no zero-point input means uint8 0."""
    scale = q.scale_values() if q.scale is not None else None
    zp = q.zero_point_values()
    if zp is None:
        return scale, 0, onnx.TensorProto.UINT8
    return scale, int(np.asarray(zp).reshape(-1)[0]), int(q.zero_point.dtype)


def _file_anchors(model: ir.Model) -> list[_FileAnchor]:
    graph = model.graph
    order = {id(node): index for index, node in enumerate(graph)}
    anchors: dict[str, _FileAnchor] = {}
    for q in qdq_nodes(model):
        if q.graph is not graph or q.input is None:
            continue  # bodies are compared through their If/Loop node's outputs
        index = order[id(q.node)]
        if q.op_type == "QuantizeLinear" and q.kind == "activation":
            scale, zp, dtype = _qparams(q)
            if scale is None or np.size(scale) != 1:
                continue  # a per-channel activation quantizer: compared as an output only
            producer = q.input.producer()
            layer = (producer.name, producer.op_type) if producer is not None else (q.input.name, "input")
            anchors[q.output.name] = _FileAnchor(q.input.name, q.output.name, layer, index,
                                                 float(np.asarray(scale).reshape(())), zp, dtype, [], *_segment(q.input))
        elif q.op_type == "DequantizeLinear" and q.input.name in anchors:
            scale, zp, _ = _qparams(q)
            anchors[q.input.name].readers.append(
                (index, q.output.name, q.node.name or q.output.name, float(np.asarray(scale).reshape(-1)[0]), zp))
    return list(anchors.values())


def _segment(value: ir.Value) -> tuple[tuple[str, ...], frozenset[str]]:
    """The float ops that compute ``value`` from the dequantized tensors before it, and those tensors."""
    found: list[str] = []
    reads: set[str] = set()
    frontier, seen = [value], set()
    while frontier:
        current = frontier.pop()
        if current is None or id(current) in seen or const_tensor(current) is not None or current.producer() is None:
            continue
        seen.add(id(current))
        node = current.producer()
        if node.op_type in ("DequantizeLinear", "QuantizeLinear"):
            reads.add(current.name)
            continue
        found.append(f"{node.op_type} '{node.name or node.outputs[0].name}'")
        frontier.extend(i for i in node.inputs if i is not None)
    return tuple(reversed(found)), frozenset(reads)


def _cut_at(model: onnx.ModelProto, cuts: dict[str, str]) -> onnx.ModelProto:
    """A copy whose readers of each dequantized tensor read a new graph input instead (``cuts``
    maps tensor → input name): fed the model's own values, every layer then shows its kernel alone."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    for node in work.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in cuts:
            continue
        for i, name in enumerate(node.input):
            if name in cuts:
                node.input[i] = cuts[name]
    for new in cuts.values():
        work.graph.input.append(onnx.ValueInfoProto(name=new))
        work.graph.input[-1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return work


def _run_file(model: onnx.ModelProto, wanted: list[str], batches: list[tuple],
              extra_feeds: list[dict[str, np.ndarray]] | None = None) -> list[dict[str, np.ndarray]]:
    """Run the file, unoptimised, with ``wanted`` tensors made graph outputs of a copy."""
    import onnxruntime as ort

    work = onnx.ModelProto()
    work.CopyFrom(model)
    present = {o.name for o in work.graph.output}
    for name in dict.fromkeys(wanted):
        if name not in present:
            work.graph.output.append(onnx.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(work.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    results = []
    for number, batch in enumerate(batches):
        feeds = {n: t.numpy() for n, t in zip(names, batch)}
        if extra_feeds is not None:
            feeds.update(extra_feeds[number])
        try:
            results.append(dict(zip(outputs, session.run(None, feeds))))
        except Exception as error:  # noqa: BLE001 - ORT's own exception types are not importable by name
            expected = [tuple(i.shape) for i in session.get_inputs()]
            raise InvalidArgumentError(
                f"ONNX Runtime could not run the file on a batch of {tuple(batch[0].shape)}: it expects inputs "
                f"{expected}. A file exported with a fixed batch needs n_batches that splits sample into batches of "
                f"that size. ({str(error).splitlines()[0]})"
            ) from None
    return results


# -- the model's side ------------------------------------------------------------------------------------
@dataclass
class _TorchAnchor:
    node: Any
    index: int
    scale: float
    zero_point: int
    source: str
    # torch's (before, after) amounts, last axis first, when the quantizer reads a zero pad: the file
    # may quantize the unpadded tensor and leave the padding to its Conv (a QuantizeLinear maps 0 to
    # its zero-point, so both hold the same integers where they overlap)
    pad: tuple[int, ...] | None = None


def _is_quantize(target: Any) -> bool:
    import torch

    ops = torch.ops.quantized_decomposed
    return target in (ops.quantize_per_tensor.default, ops.quantize_per_tensor.tensor)


def _torch_anchors(model: Any) -> list[_TorchAnchor]:
    anchors = []
    for index, node in enumerate(model.graph.nodes):
        if node.op != "call_function" or not _is_quantize(node.target):
            continue
        source = node.args[0]
        if getattr(source, "op", None) == "get_attr":
            continue  # a weight: its integers are checked by export_qdq's faithfulness proof
        scale, zp = node.args[1], node.args[2]
        if not isinstance(scale, (int, float)):
            scale = float(getattr(model, scale.target)) if getattr(scale, "op", None) == "get_attr" else None
            zp = int(getattr(model, zp.target)) if getattr(zp, "op", None) == "get_attr" else 0
        if scale is None:
            continue
        anchors.append(_TorchAnchor(node, index, float(np.float32(scale)), int(zp), getattr(source, "name", str(source)),
                                    _zero_pad(source)))
    return anchors


def _zero_pad(node: Any) -> tuple[int, ...] | None:
    """The amounts of a constant zero pad (``F.pad(x, pad)``, ``aten.constant_pad_nd``), else None."""
    from ..quantize.annotate import PAD_OPS, is_zero_padding

    if getattr(node, "op", None) != "call_function" or node.target not in PAD_OPS or not is_zero_padding(node):
        return None
    amounts = node.args[1]
    return tuple(amounts) if all(isinstance(a, int) and a >= 0 for a in amounts) else None


def _unpadded_shape(shape: tuple[int, ...], pad: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``shape`` (without the batch) before ``pad`` was applied, or None when it was not padded."""
    if not pad or len(pad) // 2 > len(shape):
        return None
    out = list(shape)
    for axis in range(len(pad) // 2):
        out[-1 - axis] -= pad[2 * axis] + pad[2 * axis + 1]
    return tuple(out) if min(out) > 0 else None


def _unpad(values: np.ndarray, pad: tuple[int, ...]) -> np.ndarray:
    """The region of a padded tensor that its input occupied."""
    region = [slice(None)] * values.ndim
    for axis in range(len(pad) // 2):
        size = values.shape[-1 - axis]
        region[-1 - axis] = slice(pad[2 * axis], size - pad[2 * axis + 1])
    return values[tuple(region)]


def _run_torch(model: Any, anchors: list[_TorchAnchor], batches: list[tuple]) -> list[dict[str, tuple]]:
    """Per batch: each anchor's (input, quantized) values, and the outputs, from one interpreted run."""
    import torch
    from torch.fx import Interpreter

    wanted = {a.node: a for a in anchors}

    class _Recorder(Interpreter):
        def __init__(self, module: Any) -> None:
            super().__init__(module)
            self.seen: dict[str, tuple] = {}

        def run_node(self, node: Any) -> Any:
            value = super().run_node(node)
            if node in wanted:
                before = self.env[node.args[0]]
                self.seen[node.name] = (before.detach().numpy().copy(), value.detach().numpy().copy())
            return value

    results = []
    with torch.no_grad():
        for batch in batches:
            recorder = _Recorder(model)
            outputs = recorder.run(*batch)
            from .._core.inputs import flatten_outputs

            recorder.seen["__outputs__"] = tuple(t.detach().numpy() for t in flatten_outputs(outputs))
            results.append(recorder.seen)
    return results


# -- matching and rows ---------------------------------------------------------------------------------------
def _same_qparams(scale: float, zero_point: int, dtype: int, t: _TorchAnchor) -> bool:
    """The file's scale and zero-point are the model's (a uint8 file's zero-point moved by 128)."""
    return np.float32(scale) == np.float32(t.scale) and (
        zero_point == t.zero_point or (dtype == onnx.TensorProto.UINT8 and zero_point == t.zero_point + _UINT8_SHIFT))


def _match(file_anchors: list[_FileAnchor], torch_anchors: list[_TorchAnchor],
           file_shapes: dict[str, tuple], torch_shapes: dict[str, set],
           distance: Callable[[_FileAnchor, _TorchAnchor], float] | None = None) -> dict[int, _TorchAnchor | None]:
    """File anchor index → model anchor: same scale, zero-point (up to the uint8 move) and shape
    (``torch_shapes`` holds each model anchor's shape, and its unpadded one when it reads a zero
    pad), earliest first; then, for those left, the same shape at the nearest relative position.
    Where several model anchors tie (pieces of one tensor share its pair: two slices of a
    concat, a split), ``distance`` between the file's and the model's values decides."""
    free = list(torch_anchors)
    matched: dict[int, _TorchAnchor | None] = {}

    for f in file_anchors:
        shape = file_shapes.get(f.q_output)
        tied = [t for t in free if _same_qparams(f.scale, f.zero_point, f.dtype, t)
                and shape in torch_shapes.get(t.node.name, ())]
        pick = tied[0] if tied else None
        if len(tied) > 1 and distance is not None:
            pick = min(tied, key=lambda t: distance(f, t))  # min keeps the earliest of equals
        if pick is not None:
            free.remove(pick)
        matched[f.index] = pick
    n_file, n_torch = max(len(file_anchors), 1), max(len(torch_anchors), 1)
    for position, f in enumerate(file_anchors):
        if matched[f.index] is not None:
            continue
        shape = file_shapes.get(f.q_output)
        candidates = [t for t in free if shape in torch_shapes.get(t.node.name, ())]
        if candidates:
            pick = min(candidates, key=lambda t: abs(torch_anchors.index(t) / n_torch - position / n_file))
            free.remove(pick)
            matched[f.index] = pick
    return matched


def _metrics(got: np.ndarray, ref: np.ndarray) -> tuple[float, float, int]:
    """(max abs difference, cosine, elements that differ), in float32 like the tensors themselves."""
    got = np.asarray(got, np.float32).ravel()
    ref = np.asarray(ref, np.float32).ravel()
    diff = np.abs(got - ref)
    norms = float(np.sqrt(np.dot(got, got)) * np.sqrt(np.dot(ref, ref)))
    cosine = float(np.dot(got, ref)) / norms if norms else float(np.array_equal(got, ref))
    return float(diff.max()) if diff.size else 0.0, min(cosine, 1.0), int(np.count_nonzero(diff))


def _dequantize(q: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    return ((q.astype(np.float32) - np.float32(zero_point)) * np.float32(scale)).astype(np.float32)


def compare_layers(model: Any, onnx_path: str | os.PathLike, sample: Any, *, optimized: bool = False,
                   n_batches: int = 1) -> LayerReport:
    """Compare a pt2e-quantized model with its Q/DQ file tensor by tensor.

    Args:
        model: the pt2e-quantized ``GraphModule`` the file was exported from (with
            ``optimized=True`` it is not run, and may be ``None``).
        onnx_path: the ONNX file.
        sample: a tensor, a tuple of tensors or a dict of them by name, batch first.
        optimized: compare ONNX Runtime's optimised run of the file (its fusions, e.g.
            QLinearConv) with the unoptimised one instead, at every quantized tensor that
            survives optimisation.
        n_batches: split ``sample`` into this many equal batches (a file with a fixed batch).

    Returns:
        A :class:`LayerReport`; ``report.first_divergence`` is the earliest tensor, in the
        file's order, more than one quantization step away, with its ``cause``.
    """
    from .._core.io import read_onnx
    from ..compare.quantized import split_sample

    file_model = read_onnx(onnx_path, "onnx_path", load_external_data=True)  # the probe copy runs from memory
    _, batches, _ = split_sample(model, sample, n_batches, file_model)
    if optimized:
        return _compare_optimized(file_model, batches)
    from .._core.torch_helpers import require_module

    require_module(model)
    if not hasattr(model, "graph"):
        raise InvalidArgumentError(
            f"compare_layers needs the pt2e-quantized GraphModule the file came from, not a "
            f"{type(model).__name__}: pass the model Quantizer(backend='pt2e').quantize returned."
        )
    view, _ = read_model(file_model)
    file_anchors = _file_anchors(view)
    torch_anchors = _torch_anchors(model)
    wanted = [a.q_input for a in file_anchors] + [a.q_output for a in file_anchors]
    wanted += [r[1] for a in file_anchors for r in a.readers]
    got = _run_file(file_model, wanted, batches)
    ref = _run_torch(model, torch_anchors, batches)

    def joined(runs: list[dict], key: str, part: int | None = None) -> np.ndarray:
        parts = [np.asarray(r[key] if part is None else r[key][part]) for r in runs]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    file_shapes = {a.q_output: tuple(np.shape(got[0][a.q_output])[1:]) for a in file_anchors}
    full = {t.node.name: tuple(np.shape(ref[0][t.node.name][1])[1:]) for t in torch_anchors}
    torch_shapes = {t.node.name: {full[t.node.name], _unpadded_shape(full[t.node.name], t.pad)} for t in torch_anchors}
    def distance(f: _FileAnchor, t: _TorchAnchor) -> float:
        """Mean distance in steps between the file's and the model's integers (first batch)."""
        mine, theirs = np.asarray(got[0][f.q_output]), np.asarray(ref[0][t.node.name][1])
        if mine.shape != theirs.shape and t.pad:  # the file quantizes the region a zero pad surrounds
            theirs = _unpad(theirs, t.pad)
        if mine.shape != theirs.shape:
            return float("inf")
        return float(np.mean(np.abs((mine.astype(np.int64) - f.zero_point) - (theirs.astype(np.int64) - t.zero_point))))

    matched = _match(file_anchors, torch_anchors, file_shapes, torch_shapes, distance)
    for f in file_anchors:  # a file that moved a zero pad into its Conv quantizes the unpadded tensor
        t = matched[f.index]
        if t is not None and file_shapes[f.q_output] != full[t.node.name]:
            for run in ref:
                run[t.node.name] = tuple(_unpad(v, t.pad) for v in run[t.node.name])
    isolated = _isolated_run(file_model, file_anchors, matched, batches, ref)
    rows: list[LayerRow] = []
    for f in file_anchors:
        t = matched[f.index]
        layer_name, layer_op = f.layer
        shape = file_shapes[f.q_output]
        if t is None:
            rows.append(LayerRow(f.index, "layer", layer_name, layer_op, None, shape, float("nan"), None, float("nan"),
                                 0, f.scale, "structure", f.segment, "the model has no quantizer of this shape here"))
            continue
        qparams_ok = _same_qparams(f.scale, f.zero_point, f.dtype, t)
        x_file, x_model = joined(got, f.q_input), joined(ref, t.node.name, 0)
        max_abs, cosine, n_off = _metrics(x_file, x_model)
        steps = max_abs / t.scale
        alone = _metrics(joined(isolated, f.q_input), x_model)[0] / t.scale if isolated else None
        if not qparams_ok:
            cause, note = "qparams", (f"QuantizeLinear scale {f.scale:.6g} / zero-point {f.zero_point}, the model's "
                                      f"{t.scale:.6g} / {t.zero_point}")
        elif alone is not None and alone > _ONE_STEP:
            cause, note = "float_kernel", f"fed the model's own inputs, this layer is {alone:.1f} steps off"
        elif steps > _ONE_STEP:
            cause, note = "propagated", "fed the model's own inputs it agrees: earlier differences add up here"
        else:
            cause, note = ("rounding" if n_off else None), ""
        rows.append(LayerRow(f.index, "layer", layer_name, layer_op, t.source, shape, max_abs, steps, cosine, n_off,
                             t.scale, cause, f.segment, note, alone))
        dq_model = _dequantize(joined(ref, t.node.name, 1), t.scale, t.zero_point)
        for index, reader, reader_name, scale, zp in f.readers:
            out_file = joined(got, reader)
            max_abs, cosine, n_off = _metrics(out_file, dq_model)
            steps = max_abs / t.scale
            reader_ok = _same_qparams(scale, zp, f.dtype, t)
            if not reader_ok:
                cause, note = "qparams", f"DequantizeLinear scale {scale:.6g} / zero-point {zp}, the model's {t.scale:.6g} / {t.zero_point}"
            elif steps > _ONE_STEP:
                cause, note = "propagated", "its quantizer's input differs: see the layer row before it"
            else:
                cause, note = ("rounding" if n_off else None), ""
            rows.append(LayerRow(index, "dequantize", reader_name, "DequantizeLinear", t.node.name,
                                 shape, max_abs, steps, cosine, n_off, t.scale, cause, (), note))
    outputs = _output_rows(view, got, ref, joined, isolated)
    rows += [row for _, row in outputs]
    rows.sort(key=lambda r: (r.index, r.kind != "layer"))
    over = next((r for r in rows if r.error_in_steps is not None and r.error_in_steps > _ONE_STEP), None)
    return LayerReport(outputs=_as_outputs(outputs), rows=tuple(rows), first_divergence=_first_divergence(rows), n_samples=sum(int(b[0].shape[0]) for b in batches),
                       optimized=False, first_over_one_step=over, strategy="compare_layers: the file's tensors against the pt2e model's",
                       runners=("onnxruntime (unoptimised)", "torch"))


def _isolated_run(file_model: onnx.ModelProto, anchors: list[_FileAnchor], matched: dict, batches: list[tuple],
                  ref: list[dict]) -> list[dict[str, np.ndarray]] | None:
    """One run of the file cut at every dequantized activation, fed the model's dequantized values."""
    cuts: dict[str, str] = {}
    feeds: list[dict[str, np.ndarray]] = [{} for _ in batches]
    for f in anchors:
        t = matched[f.index]
        if t is None:
            continue
        for _, reader, _, _, _ in f.readers:
            new = f"{reader}__from_model"
            cuts[reader] = new
            for number, run in enumerate(ref):
                feeds[number][new] = _dequantize(run[t.node.name][1], t.scale, t.zero_point)
    if not cuts:
        return None
    wanted = [a.q_input for a in anchors] + [o.name for o in file_model.graph.output]
    return _run_file(_cut_at(file_model, cuts), wanted, batches, feeds)


def _output_rows(view: ir.Model, got: list, ref: list, joined: Any,
                 isolated: list | None) -> list[tuple[str, LayerRow]]:
    """Per graph output that the model also gives: its name and its row."""
    from ..compare.quantized import output_scale

    rows = []
    order = {id(n): i for i, n in enumerate(view.graph)}
    for position, output in enumerate(view.graph.outputs):
        values = joined(got, output.name)
        model_values = np.concatenate([r["__outputs__"][position] for r in ref]) if position < len(ref[0]["__outputs__"]) else None
        node = output.producer()
        if model_values is None or model_values.shape != values.shape:
            continue
        max_abs, cosine, n_off = _metrics(values, model_values)
        scale = output_scale(view, output.name)
        steps = max_abs / scale if scale else None
        alone_abs = _metrics(joined(isolated, output.name), model_values)[0] if isolated else max_abs

        limit = scale * _ONE_STEP if scale else 1e-4 * max(1.0, float(np.abs(model_values).max()))
        cause = ("float_kernel" if alone_abs > limit else "propagated" if max_abs > limit else "rounding" if n_off else None)
        rows.append((output.name, LayerRow(
            order.get(id(node), len(view.graph)), "output", node.name if node is not None else output.name,
            node.op_type if node is not None else "output", "output", tuple(values.shape[1:]), max_abs, steps,
            cosine, n_off, scale, cause, (), "graph output")))
    return rows


def _as_outputs(rows: list[tuple[str, LayerRow]]) -> tuple[OutputResult, ...]:
    """The graph outputs' rows as the comparison model's per-output results."""
    return tuple(
        OutputResult(name, r.shape, r.max_abs_error, float("nan"), r.cosine, float("nan"),
                     passed=r.cause not in _DEFECTS, criterion="no defect (qparams, float_kernel, structure)",
                     output_scale=r.scale, max_error_in_steps=r.error_in_steps)
        for name, r in rows
    )


def _first_divergence(rows: list[LayerRow]) -> LayerRow | None:
    for row in rows:
        if row.cause in _DEFECTS:
            return row
    return None


def _compare_optimized(file_model: onnx.ModelProto, batches: list[tuple]) -> LayerReport:
    """ONNX Runtime's optimised graph against the unoptimised one, at every surviving quantized tensor."""
    import onnxruntime as ort

    anchors = _file_anchors(read_model(file_model)[0])
    with tempfile.TemporaryDirectory() as scratch:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(scratch) / "optimised.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(file_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimised = onnx.load_model(options.optimized_model_filepath)
    made_by = {v.name: n for n in read_model(optimised)[0].graph for v in n.outputs}
    surviving = [a for a in anchors if a.q_output in made_by]
    names = [a.q_output for a in surviving]
    plain = _run_file(file_model, names, batches)
    fused = _run_file(optimised, names, batches)
    rows = []
    for a in surviving:
        name = a.q_output
        q_plain = np.concatenate([r[name] for r in plain]).astype(np.int64)
        q_fused = np.concatenate([r[name] for r in fused]).astype(np.int64)
        diff = np.abs(q_plain - q_fused)
        steps = float(diff.max()) if diff.size else 0.0
        _, cosine, n_off = _metrics(_dequantize(q_fused, a.scale, a.zero_point), _dequantize(q_plain, a.scale, a.zero_point))
        node = made_by.get(name)
        cause = "float_kernel" if steps > 1 else ("rounding" if n_off else None)
        rows.append(LayerRow(a.index, "layer", node.name if node is not None else name, node.op_type if node is not None else "?",
                             None, tuple(q_plain.shape[1:]), steps * a.scale, steps, cosine, n_off, a.scale, cause, (),
                             "fused by ONNX Runtime" if node is not None and node.op_type != "QuantizeLinear" else ""))
    return LayerReport(outputs=(), rows=tuple(rows), first_divergence=_first_divergence(rows), n_samples=sum(int(b[0].shape[0]) for b in batches),
                       optimized=True, strategy="compare_layers: ONNX Runtime optimised against unoptimised",
                       runners=("onnxruntime (default level)", "onnxruntime (unoptimised)"))
