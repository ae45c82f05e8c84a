"""OpenVINO's CPU plugin: FakeQuantize fused into oneDNN's U8S8 kernels.

Its low-precision transformations fold a Q/DQ pair into the op that reads it, so everything
NNCF's default (performance) preset quantizes is quantized here: convolutions, linear layers,
both operands of attention's products and of residual adds; a ReLU's output on the unsigned
range from 0 (uint8, so the u8 x s8 kernels read it with no shift), other activations int8
symmetric, written as uint8 with zero-point 128. Weights are int8 per channel on the portable
range: oneDNN's x86 kernels without VNNI add pairs of products in a saturating int16, as ONNX
Runtime's do (NNCF's ``overflow_fix`` addresses the first layer only). Sigmoid and GELU stay
float (no INT8 kernel in the plugin).

Three rules keep the file's promise as the plugin deploys it (the measurements behind each are in
docs/targets.md):

- a linear layer's output that nothing quantized reads (the logits) stays float, and biases are
  int32 (input scale x weight scale), added exactly: the plugin requantizes through FakeQuantize's
  range formula, which rounds a last bit differently from ``x / scale``;
- activations are written uint8: with int8 ones the plugin runs s8 x s8 kernels, shifting the
  activations to u8 and, without VNNI, rescaling the weights to keep pair sums in int16;
- a conv or linear output that only a residual Add reads stays float (``fused_sum``): the plugin
  adds the residual inside that layer (a sum post-op) and skips the rounding of the layer's
  FakeQuantize, so the model adds what the plugin adds.
"""

from ._base import I8, U8, Annotation, ExportDefaults, FileRules, Target

TARGET = Target(
    "openvino",
    "OpenVINO (CPU plugin)",
    annotation=Annotation(
        activations="symmetric_unsigned_after_relu", int8_attention=True, elementwise_on_quantized=True,
        float_linear_outputs=True, fused_sum=True, int32_bias=True, portable_weights=True,
    ),
    rules=FileRules(
        activation_types=frozenset({U8}), weight_type=I8, portable_weights=True,
        activation_hint="OpenVINO's CPU plugin runs int8 activations with s8 x s8 kernels, which halve the "
                        "weights on x86 without VNNI: export with activation_dtype='uint8'.",
    ),
    defaults=ExportDefaults(activation_dtype="uint8", opset=17),
)
