"""OpenVINO's CPU plugin: FakeQuantize fused into oneDNN's U8S8 kernels.

Its low-precision transformations fold a Q/DQ pair into the op that reads it, so everything
NNCF's default (performance) preset quantizes is quantized here: convolutions, linear layers,
both operands of attention's products and of residual adds; a ReLU's output on the unsigned
range from 0 (uint8, so the u8 x s8 kernels read it with no shift), other activations int8
symmetric, written as uint8 with zero-point 128. Weights are int8 per channel on the portable
range: oneDNN's x86 kernels without VNNI add pairs of products in a saturating int16 exactly as
ONNX Runtime's do (measured on an AVX2 EPYC; NNCF's ``overflow_fix`` addresses the first layer
only). Sigmoid and GELU stay float (no
INT8 kernel in the plugin).

Two choices are made for fidelity, measured on a trained CNN as the plugin deploys the file (AVX2
EPYC, OpenVINO 2026.4): the plugin requantizes through FakeQuantize's range formula, which rounds
a last bit differently from ``x / scale``, so a linear layer's output that nothing quantized reads
(the logits) stays float instead of taking one more requantization, and biases are int32
(input scale x weight scale), added exactly. Cosine with the pt2e model 0.999905 and top-1 0.996
with quantized logits and float biases; 0.999960 and 1.0 with both. Activations are written
uint8: with int8 ones the plugin runs its s8 x s8 kernels (oneDNN shifts the activations to u8
and, without VNNI, rescales the weights to keep pair sums in int16), and a trained transformer
came out at cosine 0.99979; with uint8 ones, run u8 x s8, at 0.9999999.

A third, measured on a 4th-generation Xeon (AVX-512, VNNI, AMX): the plugin fuses a residual Add
into the conv or linear layer computing one operand (a sum post-op) and skips the rounding of that
layer's FakeQuantize. With the pair in the file, a trained CNN's first residual block came out a
step or more apart from the file at 24% of its outputs and one top-1 of 256 flipped; so that
output stays float (``fused_sum``), and the model adds what the plugin adds (OpenVINO 2026.4,
the same INT8 layers and speed).
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
