"""Weight-only INT4/INT8 models (torchao) to ONNX: one ``DequantizeLinear`` per weight, opset 21.

Each quantized ``nn.Linear`` becomes ``DequantizeLinear(int4|int8 [in, out], scale, zero-point,
axis, block_size) → MatMul`` — the pattern ONNX Runtime fuses into ``MatMulNBits`` — and each
quantized ``nn.Embedding`` becomes ``DequantizeLinear → Gather``. Activations stay float.

The integers, scales and zero-points are torchao's own, moved (transposed for MatMul, whose
weight is ``[in, out]``) but never recomputed: a second quantization of the float weights, as
ONNX Runtime's ``MatMulNBitsQuantizer`` does, need not land on the same integers.

The float weights never reach the exporter. The model is exported with an empty placeholder in
place of each quantized weight (its pages are never touched, so it costs no memory), and the
placeholder is then replaced in the ONNX graph by the dequantizer of torchao's integers.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch

from .._core.axes import describe, second_size
from .._core.io import release_freed_memory
from .._core.ir import register_constant
from ..errors import ExportRefusedError, InvalidArgumentError, PerformanceWarning, RuntimePrecisionWarning
from ..rounding import cosine

#: Blocked and int4 DequantizeLinear exist from this opset.
WEIGHT_ONLY_OPSET = 21
#: Agreement the file must reach with the torchao model at ONNX Runtime's unoptimised level.
MIN_COSINE = 0.9999
_ONNX_TYPES = {4: ir.DataType.INT4, 8: ir.DataType.INT8}


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight torchao quantized, in torchao's layout (rows are output channels or tokens).

    Attributes:
        module: the layer's name in the model (``model.layers.0.mlp.up_proj``); for experts, the
            weight's (``model.layers.0.mlp.experts.gate_up_proj``).
        kind: ``'linear'`` (read by MatMul), ``'embedding'`` (read by Gather) or ``'experts'``
            (a mixture of experts' 3-D weight, read whole by ONNX Runtime's MoE kernel; a capture that
            reads it per expert reads :meth:`expert_matrices` instead).
        bits: 4 or 8.
        qdata: the integers, int8 storage, ``[rows, width]`` (experts: ``[experts, out, in]`` or
            ``[experts, in, out]``).
        scale: float32 ``[rows, width / group]`` (experts: the blocked axis divided by ``group``).
        zero_point: int8, shaped as ``scale``, or ``None`` when every zero-point is 0.
        group: elements of a row per scale (``width`` for one scale per channel).
        axis: the axis the blocks run along, in torchao's layout (1 but for experts).
    """

    module: str
    kind: str
    bits: int
    qdata: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    group: int
    axis: int = 1

    @property
    def per_channel(self) -> bool:
        return self.group == self.qdata.shape[self.axis]

    @property
    def placeholder(self) -> str:
        """The initializer name the exporter gives the stand-in for this weight."""
        if self.kind == "experts":
            return self.module
        return f"{self.module}.{'weight_t' if self.kind == 'linear' else 'weight'}"

    def expert_matrices(self) -> list[QuantizedWeight]:
        """An experts weight as one linear weight per expert (``[out, in]``, blocks along the input
        features): torchao's integers, scales and zero-points sliced, never recomputed. Each is
        named :func:`expert_matrix_name`; the file reads them as routed experts do (one product
        per expert, see :mod:`onnxport.llm.experts`)."""
        if self.kind != "experts":
            raise ValueError(f"'{self.module}' is a {self.kind} weight, not a mixture's experts.")
        # the input features are the blocked axis: last in [experts, out, in], else [experts, in, out]
        pick = (lambda a, e: a[e]) if self.axis == 2 else (lambda a, e: a[e].T)
        return [QuantizedWeight(module=expert_matrix_name(self.module, e), kind="linear", bits=self.bits,
                                qdata=np.ascontiguousarray(pick(self.qdata, e)),
                                scale=np.ascontiguousarray(pick(self.scale, e)),
                                zero_point=None if self.zero_point is None else np.ascontiguousarray(pick(self.zero_point, e)),
                                group=self.group)
                for e in range(self.qdata.shape[0])]

    def onnx_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, int]]:
        """(integers, scale, zero-point, DequantizeLinear attributes) as the file stores them.

        MatMul reads its weight as ``[in, out]``, so a Linear's tensors are transposed and its
        blocks run along axis 0; an embedding keeps torchao's ``[tokens, width]`` with blocks
        along axis 1. One scale per channel is written per-axis (no ``block_size``). Experts keep
        torchao's 3-D layout, blocked along their input features (ONNX's per-axis scales are 1-D).
        """
        if self.kind == "experts":
            zp = None if self.zero_point is None else np.ascontiguousarray(self.zero_point, dtype=np.int8)
            return (np.ascontiguousarray(self.qdata, dtype=np.int8), np.ascontiguousarray(self.scale, dtype=np.float32),
                    zp, {"axis": self.axis, "block_size": self.group})
        transpose = self.kind == "linear"
        q = self.qdata.T if transpose else self.qdata
        scale, zp = self.scale, self.zero_point
        if self.per_channel:
            attrs = {"axis": 1 if transpose else 0}
            scale = scale.reshape(-1)
            zp = None if zp is None else zp.reshape(-1)
        else:
            attrs = {"axis": 0 if transpose else 1, "block_size": self.group}
            scale = scale.T if transpose else scale
            zp = None if zp is None else (zp.T if transpose else zp)
        return (
            np.ascontiguousarray(q, dtype=np.int8),
            np.ascontiguousarray(scale, dtype=np.float32),
            None if zp is None else np.ascontiguousarray(zp, dtype=np.int8),
            attrs,
        )


#: the module, beside a mixture's experts, holding one stand-in per expert for ``weight``
EXPERT_MATRICES = "{weight}_per_expert"


def expert_matrix_name(weight: str, expert: int) -> str:
    """The module name of one expert's matrix of the experts weight ``weight``."""
    parent, _, leaf = weight.rpartition(".")
    name = f"{EXPERT_MATRICES.format(weight=leaf)}.{expert}"
    return f"{parent}.{name}" if parent else name


def quantized_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """Every torchao weight-only tensor of ``model``, read exactly (no arithmetic).

    Raises :class:`InvalidArgumentError` for quantized tensors this export cannot say faithfully
    (other layer types, bit widths ONNX has no DequantizeLinear for, dynamic activations).
    """
    from torchao.quantization import IntxUnpackedToInt8Tensor

    found: list[QuantizedWeight] = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None or type(weight) in (torch.nn.Parameter, torch.Tensor):
            continue
        data = weight.data if isinstance(weight, torch.nn.Parameter) else weight
        if not isinstance(data, IntxUnpackedToInt8Tensor):
            if type(data) is not torch.Tensor:
                raise InvalidArgumentError(
                    f"'{name}' holds a {type(data).__name__} weight, which export_qdq cannot read back exactly; "
                    f"quantize with Quantizer(backend='torchao', method='int4_weight_only' or 'int8_weight_only')."
                )
            continue
        if data.activation_quantization is not None:
            raise InvalidArgumentError(
                f"'{name}' quantizes its activations at run time ({data.activation_quantization}), so it has no "
                f"static Q/DQ form; export the weight-only recipe instead."
            )
        kind = {torch.nn.Linear: "linear", torch.nn.Embedding: "embedding"}.get(type(module))
        if kind is None:
            raise InvalidArgumentError(
                f"'{name}' is a quantized {type(module).__name__}; export_qdq writes weight-only Linear and "
                f"Embedding layers only."
            )
        bits = {torch.int4: 4, torch.int8: 8}.get(data.target_dtype)  # type: ignore[attr-defined]  # torch's stubs lack int4
        if bits is None:
            raise InvalidArgumentError(
                f"'{name}' stores {data.target_dtype} weights; ONNX DequantizeLinear reads int4 and int8 (use those)."
            )
        if data.qdata.dim() != 2 or data.block_size[0] != 1:
            raise InvalidArgumentError(
                f"'{name}' is quantized in blocks of {tuple(data.block_size)}; export_qdq writes blocks along a row."
            )
        if data.scale.dtype != torch.float32:
            raise InvalidArgumentError(
                f"'{name}' has {data.scale.dtype} scales; export_qdq writes float32 models. Quantize the "
                f"model in float32 (model.float() before Quantizer)."
            )
        zp = data.zero_point.detach().to(torch.int8).numpy()
        found.append(QuantizedWeight(
            module=name, kind=kind, bits=bits,
            qdata=data.qdata.detach().numpy(),
            scale=data.scale.detach().numpy().astype(np.float32, copy=False),
            zero_point=zp if np.any(zp) else None,
            group=int(data.block_size[1]),
        ))
    return found + _expert_weights(model)


def _expert_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The expert weights quantize_weight_only stored as torchao's integers (read through
    :class:`~onnxport.quantize.weight_only.DequantizedExperts`)."""
    from torch.nn.utils import parametrize

    from ..quantize.weight_only import DequantizedExperts

    found = []
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for weight, chain in module.parametrizations.items():
            dequantize = next((p for p in chain if isinstance(p, DequantizedExperts)), None)
            if dequantize is None:
                continue
            data, axis = chain.original, dequantize.axis
            zp = data.zero_point.detach().to(torch.int8).numpy()
            found.append(QuantizedWeight(
                module=f"{name}.{weight}", kind="experts",
                bits={torch.int4: 4, torch.int8: 8}[data.target_dtype],  # type: ignore[attr-defined]  # torch's stubs lack int4
                qdata=data.qdata.detach().numpy(),
                scale=data.scale.detach().numpy().astype(np.float32, copy=False),
                zero_point=zp if np.any(zp) else None,
                group=int(data.block_size[axis]), axis=axis,
            ))
    return found


#: Initializers up to this many elements can be merged by the exporter's optimizer when their
#: contents are equal (onnx_ir's DeduplicateInitializersPass reaches 1024); stand-ins this small get
#: distinct contents so that each keeps its own place in the graph.
DISTINCT_BELOW = 1 << 16


def _placeholder(shape: tuple[int, ...], tag: int) -> torch.Tensor:
    """A stand-in weight. A large one is never written to: its pages are not touched, so a large
    model costs no memory here. A small one is filled with ``tag``: left empty, same-shaped stand-ins
    often hold the same (zeroed) pages, and the exporter then merges them into one initializer."""
    if int(np.prod(shape)) <= DISTINCT_BELOW:
        return torch.full(shape, float(tag))
    return torch.empty(shape)


class _MatMulStandIn(torch.nn.Module):
    """A quantized Linear as the exporter should see it: ``x @ W[in, out] + b``."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, tag: int) -> None:
        super().__init__()
        self.register_buffer("weight_t", _placeholder((in_features, out_features), tag), persistent=False)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight as model code reads it (T5 reads its dtype to cast to); the graph must read
        ``weight_t`` alone, and a graph reading this too is refused by name when written."""
        weight_t: torch.Tensor = self.weight_t  # type: ignore[assignment]  # a buffer, typed loosely by Module
        return weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class _GatherStandIn(torch.nn.Module):
    def __init__(self, num: int, dim: int, tag: int) -> None:
        super().__init__()
        self.register_buffer("weight", _placeholder((num, dim), tag), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


def export_copy(model: torch.nn.Module, weights: list[QuantizedWeight]) -> torch.nn.Module:
    """A copy of ``model`` (sharing its float tensors) with each quantized layer a stand-in."""
    memo: dict[int, Any] = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    work = copy.deepcopy(model, memo)
    tags = len(weights)  # each stand-in its own tag (see _placeholder)
    for tag, w in enumerate(weights, start=1):
        parent_name, _, leaf = w.module.rpartition(".")
        parent = work.get_submodule(parent_name) if parent_name else work
        if w.kind == "experts":
            # two stand-ins, and the capture reads one: the plain 3-D weight, which the graph then
            # dequantizes whole (ONNX Runtime's QMoE; a parameter: the exporter renames the buffers
            # it reads through an index), and one MatMul stand-in per expert (routed experts: each
            # a weight-only linear of its own, read in place)
            _unparametrize(parent)
            parent.register_parameter(leaf, torch.nn.Parameter(_placeholder(tuple(w.qdata.shape), tag), requires_grad=False))
            inner, outer = (w.qdata.shape[2], w.qdata.shape[1]) if w.axis == 2 else w.qdata.shape[1:]
            matrices = []
            for _ in range(w.qdata.shape[0]):
                tags += 1
                matrices.append(_MatMulStandIn(inner, outer, None, tags))
            parent.add_module(EXPERT_MATRICES.format(weight=leaf), torch.nn.ModuleList(matrices))
            continue
        layer = getattr(parent, leaf)
        stand_in: torch.nn.Module
        if w.kind == "linear":
            stand_in = _MatMulStandIn(layer.in_features, layer.out_features, layer.bias, tag)
        else:
            stand_in = _GatherStandIn(layer.num_embeddings, layer.embedding_dim, tag)
        setattr(parent, leaf, stand_in)
    return work


def _unparametrize(module: torch.nn.Module) -> None:
    """Give a copied experts module its plain class back, without its parametrizations (each of
    its weights becomes a stand-in). torch's ``remove_parametrizations`` would delete the property
    from the parametrized class, which the copy shares with the model it was copied from."""
    from torch.nn.utils import parametrize

    from ..quantize.weight_only import DequantizedExperts

    if not parametrize.is_parametrized(module):
        return
    chains: Any = module._modules["parametrizations"]
    if not all(isinstance(p, DequantizedExperts) for chain in chains.values() for p in chain):
        raise InvalidArgumentError(
            f"'{type(module).__name__}' carries parametrizations besides its quantized experts; remove them "
            f"(torch.nn.utils.parametrize.remove_parametrizations) before quantizing."
        )
    del module._modules["parametrizations"]
    module.__class__ = module.__class__.__bases__[0]




#: onnxscript's optimizer records on a constant it folds the values it was folded from
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def stand_in_value(graph: ir.Graph, w: QuantizedWeight) -> ir.Value | None:
    """The initializer the graph reads ``w`` from: its stand-in, by name. torch.onnx indexes the
    experts' weights (``weight[expert_ids]``) through an identity Transpose, which its optimizer
    folds into a new, renamed constant; that constant, folded from the stand-in alone and shaped
    like it, is the stand-in (a layout it changed would fail the file's proof against the model)."""
    value = graph.initializers.get(w.placeholder)
    if value is not None or w.kind != "experts":
        return value
    for candidate in graph.initializers.values():
        if (candidate.metadata_props.get(_FOLDED_FROM) == repr([w.placeholder])
                and candidate.shape is not None and tuple(candidate.shape) == w.qdata.shape):
            return candidate
    return None


def insert_dequantizers(model: ir.Model, weights: list[QuantizedWeight]) -> None:
    """Replace each stand-in initializer by ``DequantizeLinear`` of torchao's integers (in place)."""
    graph = model.graph
    first = next(iter(graph), None)
    for w in weights:
        stand_in = stand_in_value(graph, w)
        # experts read whole: ONNX Runtime's MoE ('ort-cpu'), or an index (a capture of another
        # implementation); read per expert they are linears by now (resolve_expert_weights)
        readers = {("MatMul", 1)} if w.kind == "linear" else {("Gather", 0), ("GatherND", 0), ("MoE", 2), ("MoE", 4)}
        uses = list(stand_in.uses()) if stand_in is not None else []
        if not uses or any((use.node.op_type, use.idx) not in readers for use in uses):
            found = ", ".join(sorted({f"{u.node.op_type} input {u.idx}" for u in uses})) or "nothing"
            wanted = " or ".join(f"input {i} of a {op}" for op, i in sorted(readers))
            raise ExportRefusedError(
                f"The weight of '{w.module}' should reach the exported graph as {wanted}, and it is read by "
                f"{found}; nothing was kept."
            )
        q, scale, zp, attrs = w.onnx_layout()
        inputs = [
            register_constant(graph, f"{w.module}.qweight", q, _ONNX_TYPES[w.bits]),
            register_constant(graph, f"{w.module}.scale", scale),
        ]
        if zp is not None:
            inputs.append(register_constant(graph, f"{w.module}.zero_point", zp, _ONNX_TYPES[w.bits]))
        node = ir.node("DequantizeLinear", inputs, attrs, name=f"{w.module}.dequantize")
        output = node.outputs[0]
        output.name, output.type, output.shape = f"{w.module}.weight", ir.TensorType(ir.DataType.FLOAT), ir.Shape(q.shape)
        stand_in.replace_all_uses_with(output)
        graph.initializers.pop(stand_in.name)
        if first is None:
            graph.append(node)
        else:
            graph.insert_before(first, node)


_FILE_TYPES = (ir.DataType.INT4, ir.DataType.INT8)


def iter_file_weights(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each DequantizeLinear of an int4/int8 initializer in a file, one at a time.

    Yields ``(output name, entry)``; the entry holds ``q`` (int8 values), ``scale``, ``zp``
    (``None`` when absent), ``axis``, ``block_size``, ``dtype`` and the ``readers``' op types. A
    4-bit ``MatMulNBits`` weight comes as the DequantizeLinear it stands for, named as that one's
    output, its reader ``MatMulNBits``; a 4-bit ``QMoE``'s two weights likewise.
    One weight is unpacked at a time, so an LLM-sized file is checked in bounded memory.
    """
    from .._core.ir import read_model
    from ..inspection.view import qdq_nodes
    from ..passes.matmul_nbits import PACKED_SUFFIX, unpacked
    from ..passes.moe_kernel import PACKED_SUFFIX as EXPERTS_SUFFIX
    from ..passes.moe_kernel import QMOE_WEIGHTS, unpacked_experts

    model, _ = read_model(path)
    for node in model.graph.all_nodes():  # int4 experts the file holds as QMoE ('ort-cpu' decoders)
        if node.op_type != "QMoE" or node.attributes.get_int("expert_weight_bits", 4) != 4:
            continue
        for which, (weight, scales) in QMOE_WEIGHTS.items():
            packed, scale = (node.inputs[i] for i in (weight, scales))
            if packed is None or scale is None or packed.const_value is None or scale.const_value is None:
                continue
            entry = unpacked_experts(node, packed.const_value.numpy(), scale.const_value.numpy(), which == "fc1")
            yield packed.name.removesuffix(EXPERTS_SUFFIX), {**entry, "dtype": ir.DataType.INT4, "readers": ["QMoE"]}
    for node in model.graph.all_nodes():  # int4 weights the file holds as MatMulNBits ('ort-cpu' decoders)
        if node.op_type != "MatMulNBits" or node.attributes.get_int("bits", 4) != 4 or node.inputs[1] is None:
            continue
        arrays = [v.const_value.numpy() if v is not None and v.const_value is not None else None for v in node.inputs[1:4]]
        entry = unpacked(node, arrays[0], arrays[1], arrays[2] if len(arrays) > 2 else None)
        yield node.inputs[1].name.removesuffix(PACKED_SUFFIX), {**entry, "dtype": ir.DataType.INT4, "readers": ["MatMulNBits"]}
    for q in qdq_nodes(model):
        if q.op_type != "DequantizeLinear" or q.integers is None or q.integers.dtype not in _FILE_TYPES:
            continue
        zp = q.zero_point_values()
        yield q.output.name, {
            "q": q.integer_values().astype(np.int8),
            "scale": q.scale_values() if q.scale is not None else None,
            "zp": None if zp is None else zp.astype(np.int8),
            "axis": q.attributes.get("axis", 1),
            "block_size": q.block_size or None,
            "dtype": q.integers.dtype,
            "readers": sorted({node.op_type for node, _ in q.output.uses()}),
        }


def file_weights(path: str | Path) -> dict[str, dict[str, Any]]:
    """:func:`iter_file_weights` as a dict keyed by the DequantizeLinear's output name."""
    return dict(iter_file_weights(path))


def check_weights_faithful(path: str | Path, weights: list[QuantizedWeight]) -> None:
    """The file's integers, scales, zero-points, axes and blocks are torchao's, and nothing else."""
    expected = {f"{w.module}.weight": w for w in weights}
    seen = set()
    for name, entry in iter_file_weights(path):
        w = expected.get(name)
        if w is None or name in seen:
            raise ExportRefusedError(
                f"The written file dequantizes an integer weight the model does not hold ('{name}'); nothing was kept."
            )
        seen.add(name)
        q, scale, zp, attrs = w.onnx_layout()
        problems = []
        if entry["dtype"] != _ONNX_TYPES[w.bits]:
            problems.append(f"its integers are {entry['dtype']}, not int{w.bits}")
        if entry["q"].shape != q.shape or not np.array_equal(entry["q"], q.astype(np.int8)):
            problems.append("its integers differ from torchao's")
        if entry["scale"] is None or entry["scale"].dtype != np.float32 or entry["scale"].tobytes() != scale.tobytes():
            problems.append("its scales differ from torchao's")
        want_zp = np.zeros(scale.shape, np.int8) if zp is None else zp.astype(np.int8)
        have_zp = np.zeros(scale.shape, np.int8) if entry["zp"] is None else entry["zp"]
        if have_zp.shape != want_zp.shape or not np.array_equal(have_zp, want_zp):
            problems.append("its zero-points differ from torchao's")
        if entry["axis"] != attrs["axis"] or entry["block_size"] != attrs.get("block_size"):
            problems.append(f"it is blocked as axis {entry['axis']}, block {entry['block_size']}, not as torchao's")
        if problems:
            raise ExportRefusedError(f"In the written file, the weight of '{w.module}': {'; '.join(problems)}. Nothing was kept.")
    missing = [w.module for w in weights if f"{w.module}.weight" not in seen]
    if missing:
        raise ExportRefusedError(
            f"The written file has no DequantizeLinear for the weight of '{missing[0]}' "
            f"({len(missing)} missing); nothing was kept."
        )


def check_agreement(got: list[np.ndarray], expected: list[np.ndarray], names: list[str], what: str) -> list[float]:
    """Cosine of each float output with the torchao model's (:class:`CosineAtLeast` :data:`MIN_COSINE`;
    integer outputs equal); a failure refuses. Returns the float outputs' cosines."""
    from ..compare import CosineAtLeast, RunResults, compare_runs

    report = compare_runs(RunResults("the file", dict(zip(names, got)), 0),
                          RunResults("the torchao model", dict(zip(names, expected)), 0), CosineAtLeast(MIN_COSINE))
    for result, reference in zip(report.outputs, expected):
        if result.passed:
            continue
        if result.note:  # shapes differ
            raise ExportRefusedError(f"{what}: output '{result.name}' has {result.note}; nothing was kept.")
        if not np.issubdtype(reference.dtype, np.floating):
            raise ExportRefusedError(f"{what}: integer output '{result.name}' differs from the model's; nothing was kept.")
        raise ExportRefusedError(
            f"{what}: output '{result.name}' agrees with the torchao model to cosine {result.cosine_similarity:.6f}, "
            f"below {MIN_COSINE}; nothing was kept."
        )
    return [r.cosine_similarity for r, e in zip(report.outputs, expected) if np.issubdtype(e.dtype, np.floating)]


def _slim_around_weights(model: ir.Model, weights: list[QuantizedWeight]) -> ir.Model:
    """onnxslim's clean-up (what export_onnx applies, so the file matches the FP32 file ORT's own
    quantizer starts from) on a graph whose quantized weights are lifted out as graph inputs.

    onnxslim copies every constant it is handed, unpacking int4 to a byte a value: 3 GB at 1.1B
    parameters. Lifted out, the integers and scales cost it nothing, cannot be folded into float
    weights, and go back into the slimmed graph untouched, whatever its size.
    """
    graph = model.graph
    ours = {f"{w.module}.{part}" for w in weights for part in ("qweight", "scale", "zero_point")}
    lifted: dict[str, ir.TensorProtocol] = {}
    for name in [n for n in graph.initializers if n in ours]:
        value = graph.initializers.pop(name)
        lifted[name], value.const_value = value.const_value, None
        graph.inputs.append(value)
    from ..passes.optimize import OnnxSlimPass

    slimmed = OnnxSlimPass()(model).model  # ``model`` is left lifted: the caller drops it
    inputs = {v.name: v for v in slimmed.graph.inputs}
    for name, tensor in lifted.items():
        value = inputs.get(name)
        if value is None:
            raise ExportRefusedError(
                f"The graph clean-up (onnxslim) dropped the quantized weight '{name}'; nothing was kept."
            )
        slimmed.graph.inputs.remove(value)
        value.const_value = tensor
        slimmed.graph.register_initializer(value)
    return slimmed


def fusable(w: QuantizedWeight) -> bool:
    """Whether ONNX Runtime's CPU provider fuses this weight's DequantizeLinear into MatMulNBits.

    Per-axis weights always fuse; blocked ones when the block is a power of two from 16 up (the
    block sizes ORT's MatMulNBits kernels take). Embeddings (Gather) are not fused.
    """
    if w.kind != "linear":
        return False
    return w.per_channel or (w.group >= 16 and w.group & (w.group - 1) == 0)


def resolve_expert_weights(graph: ir.Graph, weights: list[QuantizedWeight]) -> None:
    """Replace, in ``weights`` (in place), each experts weight the graph reads per expert by its
    :meth:`~QuantizedWeight.expert_matrices`, so that what is inserted and later proven on the
    file is what the file holds. An experts weight read whole (its 3-D stand-in) stays."""
    resolved: list[QuantizedWeight] = []
    for w in weights:
        if w.kind != "experts" or stand_in_value(graph, w) is not None:
            resolved.append(w)
            continue
        matrices = w.expert_matrices()
        if any(stand_in_value(graph, m) is not None for m in matrices):
            resolved.extend(matrices)
        else:
            resolved.append(w)
    weights[:] = resolved


class InsertDequantizersPass(ir.passes.InPlacePass):
    """Each stand-in weight becomes ``DequantizeLinear`` of torchao's integers, scales and zero-points."""

    def __init__(self, weights: list[QuantizedWeight]) -> None:
        super().__init__()
        self.weights = weights

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        resolve_expert_weights(model.graph, self.weights)
        placed = [w for w in self.weights if stand_in_value(model.graph, w) is not None]
        insert_dequantizers(model, placed)
        return ir.passes.PassResult(model, modified=bool(placed))


class SlimAroundWeightsPass(ir.passes.PassBase):
    """onnxslim's clean-up with the quantized weights lifted out of its reach (see
    :func:`_slim_around_weights`). A new model; the input is left with its weights lifted out
    (copying it first would cost the weights' size in memory), so it is not to be used again."""

    @property
    def in_place(self) -> bool:
        return False

    @property
    def changes_input(self) -> bool:
        return True

    def __init__(self, weights: list[QuantizedWeight]) -> None:
        super().__init__()
        self.weights = weights

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(_slim_around_weights(model, self.weights), modified=True)


def weight_only_steps(weights: list[QuantizedWeight]) -> list[Any]:
    """The graph steps of the weight-only export, each with its proof."""
    from ..passes.relu_as_max import ReluAfterWeightOnlyMatMulPass
    from ..pipeline import LastBit, OnFile, Step, Structural

    return [
        # the integers replace float stand-ins: proven on the file (integers equal torchao's, and
        # agreement with the torchao model at two sizes), not against the graph as produced
        Step("store the weights as torchao's integers", InsertDequantizersPass(weights), OnFile),
        Step("optimise with onnxslim around the weights", SlimAroundWeightsPass(weights), LastBit),
        # after onnxslim, which would write it back as a ReLU
        Step("a weight-only MatMul's ReLU as Max(x, 0), which ORT fuses past", ReluAfterWeightOnlyMatMulPass(), Structural),
    ]


def export_weight_only(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    target: Path,
    *,
    weights: list[QuantizedWeight],
    opset_version: int,
    in_names: list[str],
    out_names: list[str] | None,
    axes: dict,
    keywords: tuple[str, ...] | None = None,
) -> None:
    """Write a weight-only model to ``target`` through the engine: its steps, one write, and the
    file proven by the rules below (the integers, the agreement, what ORT fuses). ``keywords``: the
    names of keyword inputs, which the model (and its stand-in copy) then takes positionally."""
    from .._core.capture import EXPORTER_MIN_OPSET, check_names, torch_program
    from .._core.inputs import flatten_outputs, positional_forward
    from .._core.torch_helpers import eval_mode
    from ..engine import ExportPlan, run_plan
    from ..runtime import make_session

    with eval_mode(model), torch.no_grad(), positional_forward(model, keywords):
        reference = [t.detach().cpu().numpy() for t in flatten_outputs(model(*inputs))]
    out_names = check_names(out_names, len(reference), "output_names", "output")
    feeds = {name: t.detach().cpu().numpy() for name, t in zip(in_names, inputs)}
    references = [reference]
    if axes:  # the promise of every symbolic axis: the file agrees at a second size too
        grown = second_size(feeds, axes)
        with eval_mode(model), torch.no_grad(), positional_forward(model, keywords):
            references.append([t.detach().cpu().numpy() for t in flatten_outputs(model(*(torch.from_numpy(v) for v in grown.values())))])

    def capture() -> ir.Model:
        # the copy is made from the model as it is: a forward replaced for keyword inputs would be
        # copied with it and call the original model, whose weights the stand-ins replace
        stand_ins = export_copy(model, weights)
        with eval_mode(stand_ins), positional_forward(stand_ins, keywords):
            return torch_program(
                stand_ins, inputs, opset_version=max(opset_version, EXPORTER_MIN_OPSET), input_names=in_names,
                output_names=out_names, axes=axes,
            ).model

    def integers(path: Path) -> None:
        check_weights_faithful(path, weights)

    def agreement(path: Path) -> None:
        release_freed_memory()
        session = make_session(path, optimized=False)
        sizes = ["", f", one longer on every symbolic axis ({describe(axes)})"]
        for feed, expected, size in zip(plan.sizes(), references, sizes):
            check_agreement(session.run(None, dict(feed)), expected, out_names, f"At ONNX Runtime's unoptimised level{size}")
        del session
        release_freed_memory()

    def as_deployed(outputs: list[list[np.ndarray]], optimised: Path) -> None:
        default_cosines = [cosine(a, b) for a, b in zip(outputs[0], reference) if np.issubdtype(b.dtype, np.floating)]
        if min(default_cosines, default=1.0) < MIN_COSINE:
            # Not the file's doing: the fused MatMulNBits quantizes its activations to int8 at ORT's
            # default accuracy level 4; levels 0-2 compute in float and agree as the unoptimised run.
            warnings.warn(
                f"At ONNX Runtime's default level the file agrees with the torchao model to cosine "
                f"{min(default_cosines):.6f}: ORT's MatMulNBits computes with int8 activations there. Set the "
                f"session option 'session.qdq_matmulnbits_accuracy_level' to '0' for float activations.",
                RuntimePrecisionWarning,
                stacklevel=7,
            )
        warn_unfused(onnx.load_model(str(optimised), load_external_data=False), weights)

    plan = ExportPlan(
        "export_qdq (weight-only)", opset_version, feeds, capture, weight_only_steps(weights), axes=axes,
        # no step is proven by identical outputs: a copy of the graph as captured would cost its weights
        keep_reference=False, rules=[integers, agreement], on_default_run=as_deployed,
    )
    run_plan(plan, target)


def warn_unfused(optimised: onnx.ModelProto, weights: list[QuantizedWeight]) -> None:
    """Say when ONNX Runtime left weights it could run as MatMulNBits dequantized, and why."""
    fused = [n.op_type for n in optimised.graph.node].count("MatMulNBits")
    expected = sum(fusable(w) for w in weights)
    if fused < expected:
        warnings.warn(
            f"ONNX Runtime fused {fused} of the {expected} quantized MatMuls it can run as MatMulNBits; "
            f"the rest dequantize their weight on every run.",
            PerformanceWarning,
            stacklevel=7,
        )
    unfusable = [w for w in weights if w.kind == "linear" and not fusable(w)]
    if unfusable:
        warnings.warn(
            f"{len(unfusable)} quantized Linear layers (first '{unfusable[0].module}') have a block of "
            f"{unfusable[0].group} elements; ONNX Runtime fuses blocks of a "
            f"power of two from 16 up into MatMulNBits, so these dequantize their weight on every run.",
            PerformanceWarning,
            stacklevel=7,
        )
