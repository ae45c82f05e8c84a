"""``QuantSpec``: the precision record every model ``Quantizer`` returns carries."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: Attribute (and GraphModule ``meta`` key) under which a quantized model carries its record.
SPEC_ATTRIBUTE = "onnxport_quant_spec"


@dataclass(frozen=True)
class QuantSpec:
    """What a quantized model computes in, recorded when it was quantized.

    Attributes:
        backend: ``'pt2e'`` or ``'torchao'``.
        method: ``'static'``, ``'qat'``, ``'dynamic'`` (pt2e, activations quantized at run time),
            ``'int8_weight_only'``, ``'int8_dynamic'`` or ``'int4_weight_only'``.
        weight_bits: bits of the stored weights.
        activation_bits: bits of the activations between operators (``None``: float, or
            quantized on the fly at run time).
        qscheme: ``'per_channel'``, ``'per_tensor'`` or ``'per_group'`` for weights.
        symmetric: whether activation zero-points are all 0 (weight-only recipes: the weights').
        group_size: the weight group size of grouped recipes, else ``None``.
        placement: the Q/DQ placement policy (``'per_op'``, ``'skip_conv_add'``) of pt2e models.
        skipped_modules: modules whose output activations were left in float.
        float_layers: modules left entirely in float (weights and outputs), e.g. the ones
            ``quantize_within_budget`` kept to meet an accuracy budget.
        observer: the activation observer used for calibration.
        dynamic_activations: activations are quantized at run time from their own range.
        target: the deployment target preset the model was quantized for, if any.
        float_layers: see above.
        quantized_embeddings: weight-only recipes: ``nn.Embedding`` weights are quantized too.
        weight_range: pt2e: ``'portable'`` (int8 weights on [-64, 64], exact in ONNX Runtime's and
            OpenVINO's U8S8 kernels on every x86 CPU) or ``'full'`` ([-127, 127], for deployments
            known to have VNNI/AMX or ARM dot products, or consumers that are not x86 CPUs).
    """

    backend: str
    method: str
    weight_bits: int
    activation_bits: int | None
    qscheme: str
    symmetric: bool
    group_size: int | None = None
    placement: str | None = None
    skipped_modules: tuple[str, ...] = ()
    observer: str | None = None
    dynamic_activations: bool = False
    target: str | None = None
    float_layers: tuple[str, ...] = ()
    quantized_embeddings: bool = False
    weight_range: str = "full"

    @property
    def weight_only(self) -> bool:
        """True for the torchao recipes that quantize weights and leave activations float."""
        return self.backend == "torchao" and self.activation_bits is None and not self.dynamic_activations

    @property
    def qdq_opset(self) -> int:
        """The oldest default-domain opset whose Q/DQ operators say this precision."""
        if self.weight_only or self.activation_bits == 16:
            return 21  # int4 and blocked DequantizeLinear, uint16 pairs: opset 21
        return 13

    def qdq_refusal(self) -> str | None:
        """Why this precision has no QuantizeLinear/DequantizeLinear form, or ``None`` if it has one."""
        if self.dynamic_activations and self.backend != "pt2e":
            return ("torchao quantizes its activations at run time inside its own tensor type, which has no ONNX "
                    "form; use Quantizer(activations='dynamic') (pt2e), written as DynamicQuantizeLinear")
        return None

    @property
    def has_qdq_form(self) -> bool:
        """True when ``export_qdq`` can write this precision as Q/DQ pairs."""
        return self.qdq_refusal() is None

    def describe(self) -> str:
        """A one-line summary such as ``pt2e static W8A8 per_channel symmetric``."""
        act = f"A{self.activation_bits}" if self.activation_bits else ("Adyn" if self.dynamic_activations else "A16/32f")
        group = f" group {self.group_size}" if self.group_size else ""
        sym = "symmetric" if self.symmetric else "affine"
        portable = ", weights on [-64, 64]" if self.weight_range == "portable" else ""
        return f"{self.backend} {self.method} W{self.weight_bits}{act} {self.qscheme}{group} {sym}{portable}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def attach_spec(model: Any, spec: QuantSpec) -> Any:
    """Record ``spec`` on ``model`` so that it survives ``copy.deepcopy`` and pickling."""
    setattr(model, SPEC_ATTRIBUTE, spec)
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict):
        meta[SPEC_ATTRIBUTE] = spec
    return model


def quant_spec(model: Any) -> QuantSpec | None:
    """The :class:`QuantSpec` a model carries, or ``None`` for a model ``Quantizer`` did not make."""
    spec = getattr(model, SPEC_ATTRIBUTE, None)
    if spec is None:
        meta = getattr(model, "meta", None)
        if isinstance(meta, dict):
            spec = meta.get(SPEC_ATTRIBUTE)
    return spec if isinstance(spec, QuantSpec) else None


_TABLE = [
    # backend, method, weights, activations, runs as (PyTorch CPU), exports as
    ("pt2e", "static", "int8 per-channel (axis 0; 1 for transposed conv), symmetric",
     "int8 per-tensor, zero-point 0", "fake-quantized float (reference)", "ONNX Q/DQ (`export_qdq`)"),
    ("pt2e", "static, symmetric=False", "int8 per-channel, symmetric",
     "int8 per-tensor, affine", "fake-quantized float (reference)", "ONNX Q/DQ, non-zero zero-points (not TensorRT)"),
    ("pt2e", "qat", "int8 per-channel, symmetric", "int8 per-tensor, zero-point 0",
     "fake-quant training, then as static", "ONNX Q/DQ (`export_qdq`)"),
    ("pt2e", "static, activations='dynamic'", "int8 per-channel, symmetric, [-64, 64]",
     "linears' inputs uint8 per tensor at run time; the rest float", "fake-quantized float (reference)",
     "`DynamicQuantizeLinear` + `MatMulInteger` → Cast → Mul (ORT: `DynamicQuantizeMatMul`)"),
    ("torchao", "int8_weight_only", "int8 per-channel or per-group, symmetric or affine", "float",
     "dequantize, then the float op (`IntxWeightOnlyConfig`)",
     "opset 21: int8 `DequantizeLinear` (per-axis or `block_size`) → MatMul/Gather; ORT `MatMulNBits`"),
    ("torchao", "int8_dynamic", "int8 per-channel", "int8 per-token at run time", "torchao dynamic kernels",
     "refused: torchao's tensor type has no ONNX form (use activations='dynamic')"),
    ("torchao", "int4_weight_only", "int4 per-group (group_size) or per-channel, symmetric or affine", "float",
     "dequantize, then the float op (`IntxWeightOnlyConfig`)",
     "opset 21: int4 `DequantizeLinear` (`block_size`) → MatMul/Gather; ORT `MatMulNBits`"),
]


def precision_table() -> str:
    """A Markdown table of what each backend/method runs and what it exports as."""
    rows = ["| backend | method | weights | activations | runs in PyTorch as | exports as |", "|---|---|---|---|---|---|"]
    rows += [f"| {' | '.join(r)} |" for r in _TABLE]
    return "\n".join(rows)
