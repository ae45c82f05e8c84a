"""ONNX Runtime's own quantizer (``quantize_static`` / ``quantize_dynamic``) as a pass.

ORT's quantizer reads and writes files, so the pass writes the graph to a scratch folder, runs
``quant_pre_process`` and the quantizer there, and loads the result back (its weights lazily,
from the scratch folder, which must outlive the model: the Pipeline's does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from ..errors import DependencyError


@dataclass
class OrtQuantizeOptions:
    """What :func:`onnxport.export_onnx` passes through to ONNX Runtime's quantizer."""

    mode: str  # 'dynamic' or 'static'
    calibration: list[Mapping[str, np.ndarray]] = field(default_factory=list)  # feeds, for 'static'
    calibration_method: str = "minmax"
    activation_type: str = "uint8"
    weight_type: str = "int8"
    per_channel: bool = True
    op_types: Sequence[str] | None = None
    reduce_range: bool = True


class OrtQuantizePass(ir.passes.FunctionalPass):
    """Quantize the graph with ONNX Runtime's quantizer (QDQ format for static)."""

    def __init__(self, scratch: Path, options: OrtQuantizeOptions) -> None:
        super().__init__()
        self.scratch = scratch
        self.options = options

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from .._core.io import external_data_files
        from .._core.ir import save_ir

        source = self.scratch / "float.onnx"
        quantized = self.scratch / "quantized.onnx"
        save_ir(model, source)
        try:
            quantize_file(source, quantized, self.options, large=bool(external_data_files(source)))
        except Exception as error:  # ORT's quantizer raises anything from KeyError to RuntimeError
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DependencyError(f"ONNX Runtime's quantizer failed on this graph: {first}") from error
        return ir.passes.PassResult(ir.load(quantized), modified=True)


def quantize_file(source: Path, out: Path, o: OrtQuantizeOptions, *, large: bool) -> None:
    """Run ORT's ``quant_pre_process`` and quantizer on the file ``source``, writing ``out``.

    The pre-processed copy is written beside ``source`` (``preprocessed.onnx``). ``large`` writes
    the weights as external data, for graphs over 2 GB.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    op_types = list(o.op_types) if o.op_types else None
    pre = source.with_name("preprocessed.onnx")
    quant_pre_process(str(source), str(pre), skip_symbolic_shape=False, save_as_external_data=large)
    if o.mode == "dynamic":
        quantize_dynamic(str(pre), str(out), weight_type=types[o.weight_type], per_channel=o.per_channel,
                         reduce_range=o.reduce_range, op_types_to_quantize=op_types, use_external_data_format=large)
        return

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds = iter(o.calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            feeds = next(self._feeds, None)
            return None if feeds is None else dict(feeds)

    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[o.calibration_method]
    quantize_static(
        str(pre), str(out), _Reader(), quant_format=QuantFormat.QDQ, per_channel=o.per_channel,
        activation_type=types[o.activation_type], weight_type=types[o.weight_type], calibrate_method=method,
        op_types_to_quantize=op_types, use_external_data_format=large, reduce_range=o.reduce_range,
    )


class SetMetadataPass(ir.passes.InPlacePass):
    """Set ``metadata_props`` entries of the model (a record the file carries, e.g. its weight range)."""

    def __init__(self, entries: Mapping[str, str]) -> None:
        super().__init__()
        self.entries = dict(entries)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = any(model.metadata_props.get(k) != v for k, v in self.entries.items())
        model.metadata_props.update(self.entries)
        return ir.passes.PassResult(model, modified=modified)
