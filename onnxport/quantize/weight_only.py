"""Weight-only INT4/INT8 through torchao's CPU-capable ``IntxWeightOnlyConfig``.

torchao's ``Int4WeightOnlyConfig`` needs a kernel package (``mslk``) the CPU build lacks, and
``Int8WeightOnlyConfig`` stores a different tensor type per release. ``IntxWeightOnlyConfig``
runs everywhere (its forward dequantizes, then calls the float op), stores plain int8 integers
with a scale and zero-point per block for any bit width, and takes per-group or per-channel
granularity and a symmetric or asymmetric mapping: one layout for both precisions, and the one
``export_qdq`` reads back exactly.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Iterator

import torch

from ..errors import DependencyError, InvalidArgumentError

#: The torchao methods that quantize weights only, and their integer width.
WEIGHT_ONLY_BITS = {"int4_weight_only": 4, "int8_weight_only": 8}
#: The 3-D weights of transformers' mixture-of-experts layers (its experts interface's names):
#: ``[experts, out, in]``, or ``[experts, in, out]`` where the class says ``is_transposed``.
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def expert_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, int]]:
    """``(module name, module, weight name, input-feature axis)`` of every expert weight: the
    modules transformers' experts interface manages (they say ``is_transposed`` and
    ``has_gate``), whatever the family."""
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "is_transposed") and hasattr(module, "has_gate")):
            continue
        for weight in EXPERT_WEIGHTS:
            value = module._parameters.get(weight)
            if isinstance(value, torch.Tensor) and value.dim() == 3:
                found.append((name, module, weight, 1 if module.is_transposed else 2))
    return found


class DequantizedExperts(torch.nn.Module):
    """A parametrization: an expert weight stored as torchao's integers and read as their float
    values, dequantized as torchao's quantized Linear dequantizes before its matmul. The experts'
    own forward indexes the weight by expert, which torchao's tensor does not implement.
    ``axis``: the input features' axis, along which the blocks run."""

    def __init__(self, axis: int) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return original.dequantize()


def _quantize_experts(model: torch.nn.Module, bits: int, group_size: int | None, symmetric: bool) -> int:
    """Quantize every expert weight of ``model`` in place (the copy quantize_weight_only made: its
    modules are its own, its tensors shared with the model given, so only attributes change)."""
    from torch.nn.utils import parametrize
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from torchao.quantization.quant_primitives import MappingType

    found = expert_weights(model)
    for _, module, weight, axis in found:
        value = module._parameters[weight].detach()
        block = [1, 1, 1]
        block[axis] = int(value.shape[axis]) if group_size is None else group_size
        integers = IntxUnpackedToInt8Tensor.from_hp(
            value, tuple(block), torch.int4 if bits == 4 else torch.int8,  # type: ignore[attr-defined]  # torch's stubs lack int4
            mapping_type=MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC)
        setattr(module, weight, torch.nn.Parameter(integers, requires_grad=False))
        parametrize.register_parametrization(module, weight, DequantizedExperts(axis), unsafe=True)
    return len(found)


def _targets(model: torch.nn.Module, embeddings: bool) -> Iterator[tuple[str, torch.nn.Module]]:
    kinds = (torch.nn.Linear, torch.nn.Embedding) if embeddings else (torch.nn.Linear,)
    for name, module in model.named_modules():
        if type(module) in kinds:  # subclasses may compute something else with the weight
            yield name, module


def _check_groups(model: torch.nn.Module, group_size: int | None, embeddings: bool) -> list[str]:
    for name, _, weight, axis in expert_weights(model):
        width = int(getattr(model.get_submodule(name), weight).shape[axis])
        if group_size is not None and width % group_size:
            raise InvalidArgumentError(
                f"group_size={group_size} does not divide the input features of '{name}.{weight}' ({width}); "
                f"choose a group size that divides every quantized layer's width (a power of two such as 32, 64 "
                f"or 128), or qscheme='per_channel'."
            )
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


def _check_shared_weights(model: torch.nn.Module, quantized: set[str], untie: frozenset[str]) -> None:
    """A weight read by a quantized and a float layer would silently become two tensors (unless
    the caller asked for exactly that: ``untie``)."""
    readers: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if isinstance(weight, torch.Tensor):
            readers.setdefault(id(weight), []).append(name)
    for names in readers.values():
        mixed = [n for n in names if n in quantized and n not in untie], [n for n in names if n not in quantized]
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
    untie: frozenset[str] = frozenset(),
) -> torch.nn.Module:
    """Return a copy of ``model`` whose Linear (and Embedding) weights are torchao int4/int8.

    A mixture of experts' 3-D expert weights (transformers' experts interface) are quantized
    the same way, each expert's rows in groups along its input features; the copy reads them
    through :class:`DequantizedExperts`.

    Args:
        model: the float model; never modified.
        method: ``'int4_weight_only'`` or ``'int8_weight_only'``.
        group_size: input features per scale, or ``None`` for one scale per output channel.
        symmetric: zero-points all 0 (``True``) or one zero-point per block.
        embeddings: quantize ``nn.Embedding`` weights too (grouped along the embedding width).
        untie: the names of layers quantized although a float layer reads their weight too (a
            head tied to float embeddings): the copy holds their integers beside the float
            weight, which the other readers keep (the model given stays tied).
    """
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    names = _check_groups(model, group_size, embeddings)
    if not names and not expert_weights(model):
        kinds = (torch.nn.Linear, torch.nn.Embedding) if embeddings else (torch.nn.Linear,)
        subclasses = [f"'{name}' ({type(m).__module__}.{type(m).__qualname__})" for name, m in model.named_modules()
                      if isinstance(m, kinds) and type(m) not in kinds]
        left = (f"; subclasses of them are left float, as they may compute something else with the weight: "
                f"{', '.join(subclasses[:3])}" if subclasses else "")
        raise InvalidArgumentError(
            f"{type(model).__name__} has no nn.Linear{' or nn.Embedding' if embeddings else ''} layer, so "
            f"'{method}' has nothing to quantize{left}."
        )
    _check_shared_weights(model, set(names), untie)
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
    _quantize_experts(work, WEIGHT_ONLY_BITS[method], group_size, symmetric)
    drop_bound_reprs(work)
    return work


@contextlib.contextmanager
def dequantized_once(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` whose weight-only quantized linears hold their dequantized weights for as long as
    the block runs, then their torchao tensors again.

    torchao computes such a linear as ``F.linear(x, weight.dequantize(), bias)`` at every call;
    each weight dequantized once here, the same ``F.linear`` gives the same numbers, and decoding a
    few tokens with a 1.1B model no longer dequantizes every weight at every step (26 s of an
    export). The dequantized weights cost their float bytes while the block runs."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    swapped: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    try:
        for module in model.modules():
            weight = getattr(module, "weight", None) if isinstance(module, torch.nn.Linear) else None
            if isinstance(weight, torch.nn.Parameter) and isinstance(weight.data, IntxUnpackedToInt8Tensor) \
                    and weight.data.activation_quantization is None:
                swapped.append((module, weight))
                module.weight = torch.nn.Parameter(weight.data.dequantize(), requires_grad=False)
        yield model
    finally:
        for module, weight in swapped:
            module.weight = weight
