"""Write an exact GELU that reads a DequantizeLinear as ONNX Runtime's one-op ``Gelu``.

ONNX Runtime fuses the exporter's five-op GELU (``(x * (1 + erf(x / √2))) * 0.5``, in the order
:class:`~onnxport.passes.gelu_order.GeluOrderPass` writes) into one ``Gelu`` only when both of
its readers of ``x`` read the same value. When ``x`` is a DequantizeLinear's output (a GELU after
a quantized conv: timm's ConvNeXt MLP, SegFormer's Mix-FFN, Whisper's stem) ORT first gives each
reader its own copy of that DequantizeLinear, so the fusion never sees one ``x`` and the GELU
runs as five float passes over the widest tensor of the block. The standard single-op ``Gelu``
exists only from opset 20, so for files meant for ORT this pass writes the ``com.microsoft``
``Gelu`` that ORT's own fusion would have produced (OpenVINO reads it too). Its kernel computes
the same erf GELU in one pass; it may round a last bit differently from the five ops, so the
step's proof is the checker.
"""

from __future__ import annotations

import onnx_ir as ir

from .._ir import CONTRIB_DOMAIN, drop_unread_constants, is_default, is_scalar, nodes, only_reader, other_input
from .gelu_order import one_plus_erf


def _ordered_gelu(div: ir.Node) -> list[ir.Node] | None:
    """The five nodes of ``(x * (1 + erf(x / √2))) * 0.5`` that start at ``div``, or None."""
    start = one_plus_erf(div)
    if start is None:
        return None
    erf, add = start
    product = only_reader(add.outputs[0], "Mul")
    if product is None or other_input(product, add.outputs[0]) is not div.inputs[0]:
        return None
    half = only_reader(product.outputs[0], "Mul")
    if half is None or not is_scalar(other_input(half, product.outputs[0]), 0.5):
        return None
    return [div, erf, add, product, half]


def _dequantized(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.op_type == "DequantizeLinear" and is_default(producer)


class DequantizedGeluPass(ir.passes.InPlacePass):
    """Replace every ordered five-op GELU whose input is a DequantizeLinear's output by one
    ``com.microsoft.Gelu`` (and import that domain). GELUs ORT fuses itself are left standard."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for div in list(nodes(model)):
            if div.graph is None:
                continue
            found = _ordered_gelu(div)
            if found is None or not _dequantized(div.inputs[0]):
                continue
            last = found[-1]
            constants = [v for n in found for v in n.inputs if v is not None and v is not div.inputs[0]
                         and v.producer() not in found]
            gelu = ir.node("Gelu", inputs=[div.inputs[0]], domain=CONTRIB_DOMAIN, name=last.name)
            # the new node's output takes the GELU's output value's place (its name and every reader)
            ir.convenience.replace_nodes_and_values(div.graph, div, found, [gelu], [last.outputs[0]], [gelu.outputs[0]])
            drop_unread_constants(constants)
            modified = True
        if modified and CONTRIB_DOMAIN not in model.opset_imports:
            model.opset_imports[CONTRIB_DOMAIN] = 1
        return ir.passes.PassResult(model, modified)
