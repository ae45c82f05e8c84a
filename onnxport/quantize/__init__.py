"""Quantization in PyTorch: pt2e with our own annotation, torchao recipes, the precision record."""

import logging as _logging


def _quiet_torchao_import() -> None:
    # torchao logs a warning per optional CUDA extension it cannot load on a CPU-only machine,
    # and torch's pytree a deprecation for one of torchao's enums: noise for our users.
    loggers = [_logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(_logging.ERROR)
    try:
        import torchao
        import torchao.quantization  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_quiet_torchao_import()

from .config import PT2EConfig, TorchaoConfig
from .quantizer import Quantizer
from .spec import QuantSpec, precision_table, quant_spec

__all__ = ["PT2EConfig", "QuantSpec", "Quantizer", "TorchaoConfig", "precision_table", "quant_spec"]
