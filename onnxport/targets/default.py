"""No target: the seed's file, int8 symmetric with float biases, for any ONNX consumer."""

from ._base import Target

TARGET = Target("default", "any ONNX consumer")
