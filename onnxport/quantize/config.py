"""The Quantizer's choices as types, and the configuration objects its keyword form builds.

Each choice is a ``Literal`` (so a type checker catches ``observer='histo'`` before a run), and the
tuple of valid strings the runtime checks is read from it: one list per choice. ``Quantizer(...)``
validates its keywords and keeps them as a :class:`PT2EConfig` or a :class:`TorchaoConfig`
(``quantizer.config``); ``Quantizer.from_config(config)`` builds the same quantizer back from one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Backend = Literal["pt2e", "torchao"]
PT2EMethod = Literal["static", "qat"]
TorchaoMethod = Literal["int8_weight_only", "int8_dynamic", "int4_weight_only"]
Activations = Literal["static", "dynamic"]
QScheme = Literal["per_channel", "per_tensor"]
WeightOnlyQScheme = Literal["per_group", "per_channel"]
Observer = Literal["histogram", "minmax", "percentile"]
Placement = Literal["per_op", "skip_conv_add"]
TargetName = Literal["tensorrt", "onnxruntime", "qnn", "openvino"]
WeightRange = Literal["portable", "full"]

BACKENDS: tuple[str, ...] = get_args(Backend)
PT2E_METHODS: tuple[str, ...] = get_args(PT2EMethod)
TORCHAO_METHODS: tuple[str, ...] = get_args(TorchaoMethod)
#: pt2e activations: scales from calibration, or computed from each tensor at run time.
ACTIVATION_MODES: tuple[str, ...] = get_args(Activations)
QSCHEMES: tuple[str, ...] = get_args(QScheme)
WEIGHT_ONLY_QSCHEMES: tuple[str, ...] = get_args(WeightOnlyQScheme)


@dataclass(frozen=True)
class PT2EConfig:
    """A pt2e quantizer, as :class:`~onnxport.Quantizer`'s keywords resolved it (target defaults
    applied: ``symmetric`` and ``weight_range`` are what the model gets). Fields as the keywords."""

    method: PT2EMethod = "static"
    activations: Activations = "static"
    qscheme: QScheme = "per_channel"
    symmetric: bool = True
    observer: Observer = "histogram"
    qdq_placement: Placement = "per_op"
    skip_activations: tuple[str, ...] = ()
    float_layers: tuple[str, ...] = ()
    target: TargetName | None = None
    activation_bits: Literal[8, 16] = 8
    weight_range: WeightRange = "full"

    @property
    def backend(self) -> Backend:
        return "pt2e"


@dataclass(frozen=True)
class TorchaoConfig:
    """A torchao recipe, as :class:`~onnxport.Quantizer`'s keywords resolved it. Fields as the
    keywords; ``group_size`` is ``None`` unless ``qscheme='per_group'``."""

    method: TorchaoMethod
    qscheme: WeightOnlyQScheme | QScheme = "per_channel"
    symmetric: bool = True
    group_size: int | None = None
    quantize_embeddings: bool = False

    @property
    def backend(self) -> Backend:
        return "torchao"
