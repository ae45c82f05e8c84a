"""Write the exact GELU in the order ONNX Runtime fuses.

torch.onnx writes ``gelu(x)`` (erf form) as ``x * (0.5 * (1 + erf(x / √2)))``. ONNX Runtime's
``GeluFusion`` recognises ``(x * 0.5) * (1 + erf(x / √2))`` and ``(x * (1 + erf(x / √2))) * 0.5``
but not this order, so every GELU of a BERT, ViT, Swin or Whisper file ran as five float ops
(Div, Erf, Add, Mul, Mul: five passes over the MLP's widest tensor) instead of one ``Gelu``, in
the float export and between the pairs of a Q/DQ file alike. Halving is exact in binary floating
point, so ``x * (a * 0.5)`` and ``(x * a) * 0.5`` are the same number (short of subnormals):
the rewrite is proven by identical outputs.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from .._core.ir import is_default, is_scalar, nodes, only_reader, other_input


def one_plus_erf(div: ir.Node) -> tuple[ir.Node, ir.Node] | None:
    """(Erf, Add) of ``1 + erf(x / √2)`` when ``div`` is that ``x / √2`` and each part has
    one reader: the start every erf GELU the exporter writes shares."""
    if div.op_type != "Div" or not is_default(div) or len(div.inputs) != 2:
        return None
    if not is_scalar(div.inputs[1], math.sqrt(2.0), 1e-6):
        return None
    erf = only_reader(div.outputs[0], "Erf")
    add = erf and only_reader(erf.outputs[0], "Add")
    if add is None or not is_scalar(other_input(add, erf.outputs[0]), 1.0):
        return None
    return erf, add


def _match(div: ir.Node) -> tuple[ir.Value, ir.Node, ir.Node, ir.Value, ir.Value] | None:
    """For ``x / √2`` starting the exporter's GELU: (x, half, outer, add_out, half_constant)."""
    start = one_plus_erf(div)
    if start is None:
        return None
    x, add = div.inputs[0], start[1]
    half = only_reader(add.outputs[0], "Mul")
    constant = half and other_input(half, add.outputs[0])
    if constant is None or not is_scalar(constant, 0.5):
        return None
    outer = only_reader(half.outputs[0], "Mul")
    if outer is None or other_input(outer, half.outputs[0]) is not x:
        return None
    return x, half, outer, add.outputs[0], constant  # type: ignore[return-value]  # each link checked above


class GeluOrderPass(ir.passes.InPlacePass):
    """Rewrite every ``x * (0.5 * (1 + erf(x / √2)))`` as ``(x * (1 + erf(x / √2))) * 0.5``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for div in list(nodes(model)):
            if div.graph is None:
                continue
            found = _match(div)
            if found is None:
                continue
            x, half, outer, one_plus_erf, constant = found
            product = ir.node("Mul", inputs=[x, one_plus_erf], name=half.name)
            halved = ir.node("Mul", inputs=[product.outputs[0], constant], name=outer.name)
            # the last Mul keeps the GELU's output value (its name, shape and every reader)
            ir.convenience.replace_nodes_and_values(div.graph, half, [half, outer], [product, halved],
                                                    [outer.outputs[0]], [halved.outputs[0]])
            product.outputs[0].dtype, product.outputs[0].shape = x.dtype, outer.outputs[0].shape
            modified = True
        return ir.passes.PassResult(model, modified)
