"""ONNX Runtime's CPU provider: U8S8 QLinear kernels.

uint8 activations (a ReLU's output on [0, max], so ORT drops the ReLU and fuses the conv),
int8 weights on the portable range (its x86 kernels without VNNI saturate on full-range pairs),
int32 biases its integer kernels read, sigmoid and SiLU between pairs, every product of two
activations (attention's, SDPA's or written by hand) left float (ORT's INT8 product of two
activations, QLinearMatMul u8 x u8, is no faster than its float MatMul on x86 CPUs without VNNI,
and the Q/DQ pairs around it cost a pass each besides: docs/targets.md),
linear outputs nothing quantized reads left float (QGemm/MatMulIntegerToFloat), and GELU after a
DequantizeLinear written as ``com.microsoft.Gelu``, the form ORT fuses there, and the bias of a
linear with a float output at its input's rank, so that ORT's MatMul+Add→Gemm fusion of static
shapes does not leave it a float Gemm; where that bias reaches a later constant shift (MobileBERT's
NoNorm), it is added there instead of in a pass of its own, and where a residual Add and a
LayerNormalization follow it (BERT), it goes into ``com.microsoft.SkipLayerNormalization``.
"""

from ._base import I8, U8, Annotation, ExportDefaults, FileRules, Target

TARGET = Target(
    "onnxruntime",
    "ONNX Runtime (CPU, U8S8)",
    annotation=Annotation(
        activations="symmetric_unsigned_after_relu", int8_sigmoid=True, float_activation_products=True,
        float_linear_outputs=True, elementwise_on_quantized=True, int32_bias=True, portable_weights=True,
    ),
    rules=FileRules(
        activation_types=frozenset({U8}), weight_type=I8, relu_range_from_zero=True, portable_weights=True,
        activation_hint="ONNX Runtime's CPU runs U8S8 (uint8 activations) fastest: export with activation_dtype='uint8'.",
    ),
    defaults=ExportDefaults(activation_dtype="uint8", contrib_gelu=True, bias_at_input_rank=True,
                            fold_bias_shifts=True, bias_skip_norm=True),
)
