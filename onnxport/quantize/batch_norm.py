"""Keep torchao's QAT batch-norm fold away from the batch norms an inference model keeps.

``prepare_pt2e`` folds every batch norm that follows a conv into the conv's weights. The ones it
cannot fold stay as they are: a norm after an activation (DenseNet's and pre-activation ResNets'
BN → ReLU → conv, XCiT's local patch interaction), over a linear layer's features, or on an
identity branch (RepVGG). ``convert_pt2e`` then runs its QAT conv/BN fold whenever *any* batch
norm node is left, even after post-training calibration, where it has nothing to fold: it builds
96 pattern graphs with ``torch.export`` and matches each against the model. That is 36 of the 53
seconds of a DenseNet-121 quantization (47 of 48 on XCiT-nano), paid again for every trial of a
sensitivity search.

:func:`retarget_inference_batch_norms` writes each such norm as ``native_batch_norm`` (the same
kernel, the same values; its first output) instead, which the fold does not look for. The
exporter writes it as the same ONNX ``BatchNormalization``.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from .decompose import call_like, finish

aten = torch.ops.aten


def retarget_inference_batch_norms(model: GraphModule) -> GraphModule:
    """Rewrite every inference-mode ``batch_norm`` (running statistics, not training) as
    ``native_batch_norm(...)[0]``. Post-training only: QAT folds its norms at convert."""
    graph = model.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.batch_norm.default:
            continue
        x, weight, bias, mean, var, training, momentum, eps = node.args[:8]
        if training or mean is None or var is None:
            continue  # statistics of the batch: not the inference norm this is for
        with graph.inserting_before(node):
            native = call_like(graph, node, aten.native_batch_norm.default, (x, weight, bias, mean, var, False, momentum, eps))
            output = call_like(graph, node, operator.getitem, (native, 0))
        node.replace_all_uses_with(output)
        graph.erase_node(node)
        changed = True
    return finish(model, changed)
