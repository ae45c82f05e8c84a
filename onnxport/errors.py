"""The exceptions onnxport raises.

Every refusal is an :class:`OnnxportError` carrying a full-sentence message that names what was
wrong and what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence


class OnnxportError(Exception):
    """Base class of every error onnxport raises on purpose."""


class InvalidArgumentError(OnnxportError, ValueError, TypeError):
    """An argument is of the wrong type or value; raised before anything is written.

    It is both a ``ValueError`` and a ``TypeError`` so callers that catch either keep working.
    """


def check_choice(value: object, choices: Sequence[object], argument: str) -> object:
    """Return ``value`` if it is one of ``choices``; else an error listing the valid ones."""
    if value not in choices:
        raise InvalidArgumentError(f"{argument} must be one of {', '.join(map(repr, choices))}, not {value!r}.")
    return value


class UnsafeExternalDataError(InvalidArgumentError):
    """A model names external data outside its own folder (``..``, an absolute path, a link that
    leads out, or a ``basepath`` entry onnxport did not write); refused before a byte is read."""


class FixedAxesError(InvalidArgumentError):
    """torch.export proves that the model's code fixes the size of an axis asked to be symbolic.

    Attributes:
        fixed: the axes' labels and the size the code fixes each to.
        reason: the finding alone (which axes, the line of model code), without the advice.
    """

    def __init__(self, message: str, fixed: dict[str, int], reason: str = "") -> None:
        super().__init__(message)
        self.fixed = dict(fixed)
        self.reason = reason or message


class ExportRefusedError(OnnxportError, RuntimeError):
    """A produced file broke one of its promises (opset, outputs, placement…); nothing was kept."""


class DependencyError(OnnxportError, RuntimeError):
    """A library onnxport drives (torchao, torch.export, ONNX Runtime) failed on this model or
    machine; its own error is named in the message and chained as the cause."""


class WriteError(OnnxportError, OSError):
    """Writing an output failed part-way (disk full, a file-size limit, I/O error); nothing was
    left behind and a previous file at the target is untouched."""


class OnnxportWarning(UserWarning):
    """Base class of onnxport's warnings."""


class PerformanceWarning(OnnxportWarning):
    """The file is correct but will likely run slower than the caller expects."""


class RuntimePrecisionWarning(OnnxportWarning):
    """The file is correct, but a runtime's default setting computes it less exactly than the model."""


class WeakerCheckWarning(OnnxportWarning):
    """A check fell back to a weaker criterion than the one asked for (the model's float floor
    could not be measured: no float64 kernel for one of its operators, or a float64 copy over the
    memory budget); the message names why and the criterion used instead."""


class FixedShapeWarning(OnnxportWarning):
    """An axis that would be symbolic is fixed in the file, because the model's code fixes it; the
    message names the axis, its size and the line of model code."""


class VacuousCheckWarning(OnnxportWarning):
    """A check that cannot fail on this input: the reference gives (nearly) one output, or one
    class, for every sample, so any file that computes that one value agrees with it; or a float
    proof whose floor is so wide (the model's float32 outputs underflow or cancel) that a file
    of zeros would pass."""
