"""Writing ONNX files the way onnxport writes its own: atomically, checked, with external data
when a model is over protobuf's 2 GB limit."""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from ._io import check_output_path, staged_output
from ._ir import write_model
from .errors import InvalidArgumentError


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    check: bool = True,
) -> Path:
    """Write ``model`` to ``path`` atomically, with external data when it is over 2 GB.

    Args:
        model: the model to write; it is not modified.
        path: the target ``.onnx`` file; a previous file there is replaced only once the new one
            is complete and (with ``check``) has passed ``onnx.checker``.
        external_data: ``None`` decides by size; ``True``/``False`` force it.
        check: run ``onnx.checker`` on the staged file before it replaces the target.
    """
    if not isinstance(model, onnx.ModelProto):
        raise InvalidArgumentError(f"model must be an onnx.ModelProto, not {type(model).__name__}.")
    target = check_output_path(path, "path")
    with staged_output(target) as staged:
        write_model(model, staged, external_data=external_data)
        if check:
            try:
                onnx.checker.check_model(str(staged))
            except onnx.checker.ValidationError as error:
                raise InvalidArgumentError(
                    f"The model fails onnx.checker, so '{target}' was not written: {str(error).splitlines()[0]} "
                    f"Fix the model, or pass check=False to write it anyway."
                ) from error
    return target
