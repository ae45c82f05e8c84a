"""Batch norms pt2e cannot fold into a conv (pre-activation DenseNet layers) stay batch norms in
the quantized model and the file, and are kept out of torchao's QAT fold at convert."""

from __future__ import annotations

import onnx
import torch

from onnxport import Quantizer, compare_qdq, export_qdq
from tests.models import PreActDenseNet, with_statistics

SAMPLE = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
_QAT_FOLD_LOOKS_FOR = {torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
                       torch.ops.aten._native_batch_norm_legit_no_training.default}


def _targets(model) -> list:
    return [n.target for n in model.graph.nodes if n.op == "call_function"]


def test_unfoldable_batch_norms_are_kept_as_native_batch_norms_and_exported_as_batch_normalization(tmp_path):
    torch.manual_seed(0)
    model = with_statistics(PreActDenseNet(), (8, 3, 32, 32))
    quantized = Quantizer(target="onnxruntime").quantize(model, [torch.randn(4, 3, 32, 32) for _ in range(2)])
    targets = _targets(quantized)
    # layers 2-4 start with a norm of a Concat, and the last norm reads one too: four stay; the
    # first layer's first norm follows the stem conv and each layer's second its 1x1 conv: folded
    assert targets.count(torch.ops.aten.native_batch_norm.default) == 4
    assert not _QAT_FOLD_LOOKS_FOR & set(targets)  # convert's QAT fold had nothing to look at
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(quantized(SAMPLE).flatten(), model(SAMPLE).flatten(), 0)
    assert cosine > 0.9  # a random 5-layer net in INT8: the norms still normalise
    path = export_qdq(quantized, SAMPLE, tmp_path / "dense.onnx")
    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("BatchNormalization") == 4
    assert compare_qdq(quantized, path, SAMPLE).outputs[0].cosine_similarity > 0.9999


def test_qat_keeps_its_batch_norms_for_the_fold_at_convert():
    torch.manual_seed(0)
    model = with_statistics(PreActDenseNet(layers=2), (8, 3, 32, 32))
    quantizer = Quantizer(method="qat")
    prepared = quantizer.prepare(model, (SAMPLE,))
    assert torch.ops.aten.native_batch_norm.default not in _targets(prepared)
    assert _QAT_FOLD_LOOKS_FOR & set(_targets(prepared))
