"""Graph rewrites, each an ``onnx_ir`` pass that does one thing, is idempotent and reaches into
subgraphs; the function forms exported here take and return an ``onnx.ModelProto`` (a new one)."""

from .conv_kernel_shape import add_conv_kernel_shape, convs_missing_kernel_shape
from .fold_pad import fold_pads_into_convs
from .fold_weight_transpose import fold_weight_transpose
from .gelu_order import order_gelus_for_fusion
from .global_mean import spatial_means_to_global_pools
from .lower_opset import lower_opset
from .pool_window import clip_pool_windows
from .qdq_parameters import fold_qdq_parameter_casts
from .rsqrt_div import rsqrt_to_div
from .strip_unused_opsets import strip_unused_opsets
from .uint8_activations import activations_to_uint8

__all__ = [
    "activations_to_uint8",
    "add_conv_kernel_shape",
    "clip_pool_windows",
    "convs_missing_kernel_shape",
    "fold_pads_into_convs",
    "fold_qdq_parameter_casts",
    "fold_weight_transpose",
    "lower_opset",
    "order_gelus_for_fusion",
    "rsqrt_to_div",
    "spatial_means_to_global_pools",
    "strip_unused_opsets",
]
