"""Graph rewrites, each an ``onnx_ir`` pass that does one thing, is idempotent and reaches into
subgraphs; the function forms exported here take and return an ``onnx.ModelProto`` (a new one)."""

from .conv_kernel_shape import add_conv_kernel_shape, convs_missing_kernel_shape
from .fold_weight_transpose import fold_weight_transpose
from .global_pool import global_pools
from .lower_opset import lower_opset
from .strip_unused_opsets import strip_unused_opsets
from .uint8_activations import activations_to_uint8

__all__ = [
    "activations_to_uint8",
    "add_conv_kernel_shape",
    "convs_missing_kernel_shape",
    "fold_weight_transpose",
    "global_pools",
    "lower_opset",
    "strip_unused_opsets",
]
