"""Write ``x * (1 / sqrt(v))`` as ``x / sqrt(v)``, the form ONNX Runtime fuses into an RMSNorm.

torch.onnx writes ``torch.rsqrt`` as ``Reciprocal(Sqrt(v))``, so the RMSNorm of Llama, Mistral,
Qwen, Gemma and T5 (``x * rsqrt(mean(x²) + eps) * w``) exports as Pow, ReduceMean, Add, Sqrt,
Reciprocal, Mul, Mul: seven float passes. ONNX Runtime's ``SimplifiedLayerNormalization``
fusion matches ``x / sqrt(…)`` only, and its fused kernel itself multiplies by the reciprocal.
The quotient rounds once where the product of a reciprocal rounds twice, so a last bit can move:
the step is proven by the checker, after every identical-outputs step.
"""

from __future__ import annotations

import onnx_ir as ir

from .._core.ir import is_default, nodes, only_reader


def _reciprocal_of_sqrt(value: ir.Value | None) -> ir.Node | None:
    """The Reciprocal producing ``value`` from a Sqrt, when only a Mul reads it."""
    reciprocal = value.producer() if value is not None else None
    if reciprocal is None or reciprocal.op_type != "Reciprocal" or not is_default(reciprocal):
        return None
    if only_reader(value, "Mul") is None:
        return None
    root = reciprocal.inputs[0].producer() if reciprocal.inputs and reciprocal.inputs[0] is not None else None
    return reciprocal if root is not None and root.op_type == "Sqrt" and is_default(root) else None


class RsqrtToDivPass(ir.passes.InPlacePass):
    """Rewrite every ``Mul(x, Reciprocal(Sqrt(v)))`` (either operand order, in any body) as ``Div(x, Sqrt(v))``."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for mul in list(nodes(model)):
            if mul.op_type != "Mul" or not is_default(mul) or len(mul.inputs) != 2 or mul.graph is None:
                continue
            for side in (1, 0):
                reciprocal = _reciprocal_of_sqrt(mul.inputs[side])
                if reciprocal is None:
                    continue
                div = ir.node("Div", inputs=[mul.inputs[1 - side], reciprocal.inputs[0]], name=mul.name)
                # the quotient keeps the product's value (its name, type, shape and every reader)
                ir.convenience.replace_nodes_and_values(mul.graph, mul, [mul], [div], [mul.outputs[0]], [div.outputs[0]])
                reciprocal.graph.remove(reciprocal, safe=True)
                modified = True
                break
        return ir.passes.PassResult(model, modified)
