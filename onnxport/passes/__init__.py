"""Graph rewrites, each an ``onnx_ir`` pass that does one thing, is idempotent, reaches into
subgraphs and is honest about ``modified``; the exporters run them as Pipeline steps. To run one
on an ``onnx.ModelProto``, ``onnxport._core.ir.on_proto(SomePass(), model)`` returns a new proto."""

from .bias_skip_norm import BiasSkipLayerNormPass
from .conv_kernel_shape import AddConvKernelShapePass, convs_missing_kernel_shape
from .fold_bias_shift import FoldBiasIntoShiftPass
from .fold_pad import FoldPadIntoConvPass
from .fold_weight_transpose import FoldWeightTransposePass
from .gelu_order import GeluOrderPass
from .global_mean import SpatialMeanToGlobalPoolPass
from .linear_bias_rank import LinearBiasRankPass
from .lower_opset import LowerOpsetPass
from .pool_window import PoolWindowPass
from .qdq_parameters import FoldQDQParameterCastsPass
from .rsqrt_div import RsqrtToDivPass
from .uint8_activations import ActivationsToUint8Pass

__all__ = [
    "ActivationsToUint8Pass",
    "AddConvKernelShapePass",
    "BiasSkipLayerNormPass",
    "FoldBiasIntoShiftPass",
    "FoldPadIntoConvPass",
    "FoldQDQParameterCastsPass",
    "FoldWeightTransposePass",
    "GeluOrderPass",
    "LinearBiasRankPass",
    "LowerOpsetPass",
    "PoolWindowPass",
    "RsqrtToDivPass",
    "SpatialMeanToGlobalPoolPass",
    "convs_missing_kernel_shape",
]
