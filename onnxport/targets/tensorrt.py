"""TensorRT 8.6+: explicit-quantization Q/DQ, int8 with every zero-point 0.

Its ONNX parser reads opset 17, rejects unsigned Q/DQ and int32-bias DequantizeLinear, and
needs ``kernel_shape`` on every Conv; biases stay float, as TensorRT fuses them itself.
"""

from ._base import ExportDefaults, FileRules, Target

TARGET = Target(
    "tensorrt",
    "TensorRT 8.6+",
    rules=FileRules(
        max_opset=17, zero_points_zero="all", unsigned_allowed=False, int32_bias_allowed=False,
        needs_kernel_shape=True,
    ),
    defaults=ExportDefaults(opset=17),
)
