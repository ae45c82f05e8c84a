from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.models import train_tiny_classifier

warnings.filterwarnings("ignore", message=".*torchvision.*")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def trained():
    """A tiny classifier trained on synthetic images, and a held-out set: (model, (x, y))."""
    return train_tiny_classifier()


def assert_faithful(quantized, path, sample, **kwargs) -> None:
    """The fidelity criterion for random-weight models, on whichever CPU runs the test: cosine
    >= 0.9999, or within twice the model's own one-ulp rounding floor (measured only when needed:
    it runs the model three times more)."""
    from onnxport import compare_qdq

    first = compare_qdq(quantized, path, sample, **kwargs).outputs[0]
    if first.cosine_similarity < 0.9999:
        first = compare_qdq(quantized, path, sample, rounding_floor=True, **kwargs).outputs[0]
        assert first.within_floor, first


def activation_products(path) -> int:
    """How many MatMuls of the file multiply two activations (attention's q·kᵀ and p·v), which
    the 'onnxruntime' preset leaves float on purpose (``qdq_report`` names each)."""
    from onnxport import qdq_report

    return sum("two activations" in (op.why_float or "") for op in qdq_report(path, ort=False).compute_ops)


def listing(directory: Path) -> dict[str, str]:
    """Every file below ``directory`` with a hash of its bytes: proves 'nothing was written'."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture()
def guarded(tmp_path):
    """A directory holding a previous good file; yields it and asserts nothing there changed."""
    previous = tmp_path / "model.onnx"
    previous.write_bytes(b"a previous, good file")
    before = listing(tmp_path)
    yield previous
    assert listing(tmp_path) == before


def ort_optimised_ops(model) -> list[str]:
    """The op types of ONNX Runtime's optimised graph (extended level: no layout changes), If/Loop bodies included."""
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as scratch:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = f"{scratch}/optimised.onnx"
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimised = onnx.load(options.optimized_model_filepath)
    bodies = [n for node in optimised.graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH
              for n in a.g.node]
    return [n.op_type for n in optimised.graph.node] + [n.op_type for n in bodies]


def families(names, *, by_default) -> list:
    """A per-family matrix's parameters: the families in ``by_default`` (one of each code path the
    matrix covers) run in the default run, which CI runs; the rest are marked slow (``-m slow``)."""
    unknown = set(by_default) - set(names)
    assert not unknown, unknown
    return [name if name in by_default else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that share a module-scoped fixture (exported files, a trained model) run on one
    worker (``--dist=loadgroup``): spread over two, each worker builds the fixture again."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group"):
            continue
        shared = sorted(name for name in info.names_closure
                        if (defs := info.name2fixturedefs.get(name)) and defs[-1].scope == "module")
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{'+'.join(shared)}"))
