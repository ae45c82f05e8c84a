"""Drop opset imports of domains that no node uses (ORT's pre-processing adds a dozen)."""

from __future__ import annotations

import onnx
from onnx_ir.passes.common import RemoveUnusedOpsetsPass

from ._ir import on_proto


def strip_unused_opsets(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` importing only the domains its nodes and functions use.

    The default domain is always kept (``onnx_ir``'s ``RemoveUnusedOpsetsPass``).
    """
    return on_proto(RemoveUnusedOpsetsPass(), model)
