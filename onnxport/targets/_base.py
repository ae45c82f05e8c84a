"""What a deployment target is: three independent parts, one per reader.

``Quantizer`` reads only :class:`Annotation`, the exporters only :class:`ExportDefaults`, and
``check_target`` only :class:`FileRules`, so a consumer whose parser accepts a thing (a file rule)
is never forced to receive it (an annotation choice), and a new consumer is one module that fills
in the three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

U8, U16, I8 = onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.INT8

#: activation quantizers ``Annotation.activations`` names
ACTIVATION_SCHEMES = ("symmetric", "affine_unsigned", "symmetric_unsigned_after_relu")


@dataclass(frozen=True)
class Annotation:
    """How ``Quantizer`` annotates a model for the consumer.

    Attributes:
        activations: ``'symmetric'`` (int8, zero-point 0), ``'affine_unsigned'`` (uint8/uint16 over
            the observed range) or ``'symmetric_unsigned_after_relu'`` (int8 symmetric, but a
            ReLU/Clip output gets an unsigned range from 0, so the runtime folds the ReLU).
        activation_bits: the activation widths the consumer computes in.
        int8_sigmoid: quantize LeakyReLU, Sigmoid and SiLU (as x·sigmoid(x)): the consumer runs
            them between Q/DQ pairs.
        int8_attention: split attention into its products and softmax and quantize both
            operands of each product: the consumer multiplies two activations in INT8.
        float_activation_products: leave every product of two activations (attention's q·kᵀ and
            p·v, split from SDPA or written by hand) float: the consumer's INT8 form of it is no
            faster than its float one.
        float_linear_outputs: leave a linear layer's output that nothing reads quantized
            unquantized: the consumer has a Gemm/MatMul with quantized inputs and a float output,
            and a pair there would requantize, for nothing, what may be a language model's largest
            tensor (GPT-2's logits: 128 × 50257).
        elementwise_on_quantized: quantize an Add/Mul only when both operands already are: the
            consumer runs it in INT8 only between pairs (a float constant operand, such as GELU's
            0.5, keeps it float), and an INT8 Add/Mul beside float producers costs a
            QuantizeLinear per operand and a DequantizeLinear after it: more than the float op.
        fused_sum: leave a conv or linear layer's output float when its only reader is a quantized
            residual Add: the consumer adds the other operand inside that layer (oneDNN's sum
            post-op) without rounding the layer's output to a pair first.
        int32_bias: store Conv/Linear biases as int32 (scale = input scale x weight scale), which
            the consumer reads as its integer kernels' bias; otherwise biases stay float. ONNX
            Runtime rounds a float bias beside dequantized inputs so itself (its BiasQuantization
            step): a model that rounds it first computes what ORT computes.
        portable_weights: keep int8 weights on [-64, 64] unless told otherwise: the consumer runs
            U8S8 kernels on x86 CPUs, which without VNNI add two products in a saturating int16.
    """

    activations: str = "symmetric"
    activation_bits: tuple[int, ...] = (8,)
    int8_sigmoid: bool = False
    int8_attention: bool = False
    float_activation_products: bool = False
    float_linear_outputs: bool = False
    elementwise_on_quantized: bool = False
    fused_sum: bool = False
    int32_bias: bool = False
    portable_weights: bool = False

    def __post_init__(self) -> None:
        assert self.activations in ACTIVATION_SCHEMES, self.activations

    @property
    def forces_affine(self) -> bool:
        return self.activations == "affine_unsigned"


@dataclass(frozen=True)
class FileRules:
    """What ``check_target`` holds a file to: what the consumer's parser and kernels accept.

    Attributes:
        max_opset: the newest opset the parser reads (``None``: any).
        opset_16bit: the oldest opset at which 16-bit activations are allowed.
        activation_types: the Q/DQ types activations may have (``None``: any).
        activation_hint: what to do when an activation has another type.
        weight_type: the type weights must be stored as (``None``: any).
        zero_points_zero: every zero-point must be 0 (``'all'``), only weights' (``'weights'``), or none.
        unsigned_allowed: whether uint8/uint16 Q/DQ nodes may appear at all.
        int32_bias_allowed: whether a DequantizeLinear of an int32 bias may appear.
        needs_kernel_shape: every Conv must say its ``kernel_shape``.
        relu_range_from_zero: a ReLU/Clip feeding a Q must meet a range that starts at 0.
        portable_weights: int8 weights an integer Conv/Gemm/MatMul reads stay on [-64, 64],
            unless the file records ``weight_range='full'``.
    """

    max_opset: int | None = None
    opset_16bit: int = 21
    activation_types: frozenset[int] | None = None
    activation_hint: str = ""
    weight_type: int | None = None
    zero_points_zero: str | None = None
    unsigned_allowed: bool = True
    int32_bias_allowed: bool = True
    needs_kernel_shape: bool = False
    relu_range_from_zero: bool = False
    portable_weights: bool = False

    @property
    def needs_symmetric(self) -> bool:
        return self.zero_points_zero == "all"


@dataclass(frozen=True)
class ExportDefaults:
    """What ``export_qdq`` writes for the consumer when the caller does not say.

    Attributes:
        activation_dtype: the activations' Q/DQ type.
        opset: the opset of 8-bit files.
        opset_16bit: the opset of files with 16-bit activations (uint16 Q/DQ exist from 21).
        contrib_gelu: write a GELU whose input is a DequantizeLinear as ``com.microsoft.Gelu``,
            and one after a bias Add as ``com.microsoft.BiasGelu`` (``FastGelu`` with that bias for
            the tanh form): ONNX Runtime cannot fuse the standard forms there.
        bias_at_input_rank: give the bias of a quantized linear whose output stays float the
            rank of its input, so that ONNX Runtime's MatMul+Add→Gemm fusion (static shapes)
            leaves the linear to its INT8 kernel (:mod:`onnxport.passes.linear_bias_rank`).
        fold_bias_shifts: add a constant Add's constant into the next constant Add downstream of
            it (through Adds and constant Muls), where ONNX Runtime would run it as a pass of its own
            (:mod:`onnxport.passes.fold_bias_shift`).
        bias_skip_norm: write a linear's bias, the residual Add after it and the LayerNormalization
            of that sum as ``com.microsoft.SkipLayerNormalization`` with the bias inside
            (:mod:`onnxport.passes.bias_skip_norm`): ONNX Runtime's own fusion takes a 1-D bias only.
    """

    activation_dtype: str = "int8"
    opset: int = 18
    opset_16bit: int = 21
    contrib_gelu: bool = False
    bias_at_input_rank: bool = False
    fold_bias_shifts: bool = False
    bias_skip_norm: bool = False

    def opset_for(self, activation_bits: int | None) -> int:
        return self.opset_16bit if activation_bits == 16 else self.opset


@dataclass(frozen=True)
class Target:
    """One deployment consumer: its name, who it is, and its three parts."""

    name: str
    consumer: str
    annotation: Annotation = field(default_factory=Annotation)
    rules: FileRules = field(default_factory=FileRules)
    defaults: ExportDefaults = field(default_factory=ExportDefaults)
