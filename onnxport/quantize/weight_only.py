"""Weight-only INT4/INT8 through torchao's CPU-capable ``IntxWeightOnlyConfig``.

torchao's ``Int4WeightOnlyConfig`` needs a kernel package (``mslk``) the CPU build lacks, and
``Int8WeightOnlyConfig`` stores a different tensor type per release. ``IntxWeightOnlyConfig``
runs everywhere (its forward dequantizes, then calls the float op), stores plain int8 integers
with a scale and zero-point per block for any bit width, and takes per-group or per-channel
granularity and a symmetric or asymmetric mapping: one layout for both precisions, and the one
``export_qdq`` reads back exactly.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator

import torch

from ..errors import DependencyError, InvalidArgumentError

#: The torchao methods that quantize weights only, and their integer width.
WEIGHT_ONLY_BITS = {"int4_weight_only": 4, "int8_weight_only": 8}


def _targets(model: torch.nn.Module, embeddings: bool) -> Iterator[tuple[str, torch.nn.Module]]:
    kinds = (torch.nn.Linear, torch.nn.Embedding) if embeddings else (torch.nn.Linear,)
    for name, module in model.named_modules():
        if type(module) in kinds:  # subclasses may compute something else with the weight
            yield name, module


def _check_groups(model: torch.nn.Module, group_size: int | None, embeddings: bool) -> list[str]:
    names = []
    for name, module in _targets(model, embeddings):
        width = int(module.in_features if isinstance(module, torch.nn.Linear) else module.embedding_dim)
        if group_size is not None and width % group_size:
            what = "input features" if isinstance(module, torch.nn.Linear) else "embedding width"
            raise InvalidArgumentError(
                f"group_size={group_size} does not divide the {what} of '{name}' ({width}); choose a group "
                f"size that divides every quantized layer's width (a power of two such as 32, 64 or 128), "
                f"or qscheme='per_channel'."
            )
        if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
            raise InvalidArgumentError(
                f"'{name}' is an Embedding with max_norm={module.max_norm}, which rewrites its weight on every "
                f"lookup; a quantized weight cannot be renormalised. Leave embeddings float (quantize_embeddings=False)."
            )
        names.append(name)
    return names


def _check_shared_weights(model: torch.nn.Module, quantized: set[str]) -> None:
    """A weight read by a quantized and a float layer would silently become two tensors."""
    readers: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if isinstance(weight, torch.Tensor):
            readers.setdefault(id(weight), []).append(name)
    for names in readers.values():
        mixed = [n for n in names if n in quantized], [n for n in names if n not in quantized]
        if mixed[0] and mixed[1]:
            raise InvalidArgumentError(
                f"The weight of '{mixed[0][0]}' is shared with '{mixed[1][0]}', which this recipe leaves float "
                f"(tied embeddings): the quantized model would hold two different weights. Pass "
                f"quantize_embeddings=True to quantize both readers, or untie the weights first."
            )


def _share_all_tensors(model: torch.nn.Module) -> dict[int, object]:
    """A deepcopy memo that reuses every parameter and buffer instead of copying it.

    torchao replaces the weights of the copy's layers with new quantized tensors; it never writes
    into the float ones, so the copy can read them where they are: the float weights are held
    once, not twice, however large the model.
    """
    memo: dict[int, object] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        memo[id(tensor)] = tensor
    return memo


def drop_bound_reprs(model: torch.nn.Module) -> None:
    """torchao binds a partial as ``extra_repr`` on each layer it quantizes: cosmetic, and unpicklable."""
    for module in model.modules():
        module.__dict__.pop("extra_repr", None)


def quantize_weight_only(
    model: torch.nn.Module, method: str, *, group_size: int | None, symmetric: bool, embeddings: bool,
    leave_float: frozenset[str] = frozenset(),
) -> torch.nn.Module:
    """Return a copy of ``model`` whose Linear (and Embedding) weights are torchao int4/int8.

    Args:
        model: the float model; never modified.
        method: ``'int4_weight_only'`` or ``'int8_weight_only'``.
        group_size: input features per scale, or ``None`` for one scale per output channel.
        symmetric: zero-points all 0 (``True``) or one zero-point per block.
        embeddings: quantize ``nn.Embedding`` weights too (grouped along the embedding width).
        leave_float: the names of layers to leave float (a head tied to float embeddings).
    """
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    names = [n for n in _check_groups(model, group_size, embeddings) if n not in leave_float]
    if not names:
        raise InvalidArgumentError(
            f"{type(model).__name__} has no nn.Linear{' or nn.Embedding' if embeddings else ''} layer, so "
            f"'{method}' has nothing to quantize."
        )
    _check_shared_weights(model, set(names))
    config = IntxWeightOnlyConfig(
        weight_dtype=torch.int4 if WEIGHT_ONLY_BITS[method] == 4 else torch.int8,  # type: ignore[attr-defined]  # torch's stubs lack int4
        granularity=PerAxis(0) if group_size is None else PerGroup(group_size),
        mapping_type=MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC,
    )
    work = copy.deepcopy(model, _share_all_tensors(model)).eval()
    chosen = set(names)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(work, config, filter_fn=lambda module, fqn: fqn in chosen)
    except Exception as error:  # torchao raises assertion and runtime errors alike
        raise DependencyError(
            f"torchao could not apply '{method}': {type(error).__name__}: "
            f"{(str(error).strip().splitlines() or [''])[0]}."
        ) from error
    drop_bound_reprs(work)
    return work
