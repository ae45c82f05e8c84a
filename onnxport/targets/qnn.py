"""Qualcomm QNN (HTP): uint8 affine activations (or uint16 for A16W8), int8 symmetric weights,
int32 biases."""

from ._base import I8, U8, U16, Annotation, ExportDefaults, FileRules, Target

TARGET = Target(
    "qnn",
    "Qualcomm QNN (HTP)",
    annotation=Annotation(activations="affine_unsigned", activation_bits=(8, 16), int32_bias=True),
    rules=FileRules(
        activation_types=frozenset({U8, U16}), weight_type=I8, zero_points_zero="weights",
        activation_hint="QNN reads uint8 (or uint16) activations.",
    ),
    defaults=ExportDefaults(activation_dtype="uint8"),
)
