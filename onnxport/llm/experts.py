"""Mixture-of-experts layers in a decoder file.

transformers 5 runs a mixture's experts through its experts interface
(``config._experts_implementation``). Its default, a grouped matmul, reaches torch.onnx as a custom
operator (``transformers::grouped_mm_fallback``) that it cannot translate, so a capture picks one
of two implementations instead:

- :data:`EXPORTABLE_EXPERTS`, :func:`routed_experts_forward`: standard operators, one group per
  expert — the tokens that chose it found (``NonZero``), its products run on those rows with its
  weights read in place, the weighted rows added back (``ScatterND``, reduction ``add``). The
  portable form, and every file's form for experts the kernel cannot take. (transformers' own
  ``batched_mm`` also exports, but copies each chosen expert's matrices per token: a 128-token
  prompt through 8 Mixtral-shaped layers took 16x eager's time.)
- :data:`KERNEL_EXPERTS` (``'ort-cpu'``): ONNX Runtime's ``com.microsoft.MoE`` (int4 experts: its
  ``QMoE``), which groups the tokens by expert and reads each expert's weights in place.

Either way the router is the model's own, in standard operators: the experts receive its chosen
experts and weights. ``MoE`` takes router logits instead (softmax, top-k, optionally renormalised),
so the file hands it the logarithms of the router's weights at the chosen experts and ``-inf``
elsewhere, asks it to renormalise (the chosen weights divided by their sum), and multiplies its
output by that sum: the router's weights, whatever its rule (renormalised or not, softmax or
sigmoid), up to a rounding or two. The node states the model's own layout (gate rows, then up
rows: ``swiglu_fusion=2``); ONNX Runtime's CPU kernel takes them interleaved, which
:class:`~onnxport.passes.moe_kernel.MoEInterleavePass` (float experts) and
:class:`~onnxport.passes.moe_kernel.QMoEPass` (int4 experts, as ``QMoE``) write.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

EXPORTABLE_EXPERTS = "onnxport_routed"
KERNEL_EXPERTS = "onnxport_moe"
#: The most experts (summed over the layers) a capture routes expert by expert. Each adds about 19
#: nodes, and the onnxscript optimizer torch.onnx runs costs about the square of the node count
#: (onnxscript 0.7's two-Slice rule lists the whole graph for every node it tries): 64 (8 layers of
#: 8) added 28 s to a Mixtral-shaped export; on a tiny Mixtral, 128 took the optimizer 2.6x the time
#: of 64 for 1.6x the nodes, which puts OLMoE's 1,024 at an hour or more. Past the limit, the
#: experts are captured as transformers' ``batched_mm`` (a copy of each chosen expert per token).
ROUTED_EXPERTS_LIMIT = 256


def _product(module: torch.nn.Module, name: str, expert: int, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from ..exporters.weight_only import EXPERT_MATRICES

    # a weight-only export gives each expert's matrix a stand-in of its own, read as a linear's
    per_expert = getattr(module, EXPERT_MATRICES.format(weight=name), None)
    if per_expert is not None:
        out = per_expert[expert](rows)
    else:
        weight = getattr(module, name)[expert]
        out = rows @ weight if module.is_transposed else torch.nn.functional.linear(rows, weight)
    return out if bias is None else out + bias


def routed_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface, computed expert by expert on the tokens that chose it.

    What transformers' loop over the experts computes (its layout flags, gate, activation, biases
    and post-expert norm honoured), but over every expert, so a capture holds no data-dependent
    control flow: an expert no token chose runs on zero rows. Expert ids at or past the number of
    experts (expert parallelism's sentinels, whose weights are zero) match no expert and are dropped.
    The weighted rows are summed in float32 (or wider), as torch's sum of half floats is, and the
    sum rounded once to the hidden states' dtype.
    """
    layer: Any = self  # transformers' experts class: its attributes are its interface's
    has_gate, has_bias = bool(layer.has_gate), bool(getattr(self, "has_bias", False))
    first = "gate_up_proj" if has_gate else "up_proj"
    first_bias = getattr(self, f"{first}_bias") if has_bias else None
    second_bias = layer.down_proj_bias if has_bias else None
    # summed in float32 at least, as torch sums half floats (and ONNX Runtime's CPU ScatterND adds
    # no float16), then rounded once to the hidden states' dtype
    dtype = torch.promote_types(torch.promote_types(hidden_states.dtype, top_k_weights.dtype), torch.float32)
    out = torch.zeros(hidden_states.shape, dtype=dtype, device=hidden_states.device)
    # the choices flattened once: each expert then finds its (token, slot) pairs as positions in
    # one list, and its tokens by one division. Few nodes per expert matter: the exporter's rewriter
    # costs about the square of the graph's node count, and a mixture repeats these per expert.
    # (embedding: a plain Gather of rows, where index_select adds a Reshape of its index)
    chosen, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1, 1)
    token_of = torch.arange(top_k_index.shape[0], device=chosen.device).repeat_interleave(top_k_index.shape[-1])[:, None]
    for expert in range(getattr(self, first).shape[0]):
        position = torch.nonzero(chosen == expert).squeeze(-1)
        token = torch.nn.functional.embedding(position, token_of).squeeze(-1)
        rows = _product(self, first, expert, torch.nn.functional.embedding(token, hidden_states),
                        None if first_bias is None else first_bias[expert])
        rows = layer._apply_gate(rows) if has_gate else layer.act_fn(rows)
        rows = _product(self, "down_proj", expert, rows, None if second_bias is None else second_bias[expert])
        if getattr(self, "has_post_expert_norm", False):
            rows = layer.post_expert_norm(rows)
        out = out.index_add(0, token, (rows * torch.nn.functional.embedding(position, weights)).to(dtype))
    return out.to(hidden_states.dtype)


@torch.library.custom_op("onnxport::moe", mutates_args=())
def moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, fc1: torch.Tensor,
        fc2: torch.Tensor, fc1_bias: torch.Tensor | None, fc2_bias: torch.Tensor | None, k: int) -> torch.Tensor:
    """ONNX Runtime's ``MoE`` with a gated SiLU (``swiglu``; ``fc1``: [experts, gate rows then up
    rows, hidden]; ``fc2``: [experts, hidden, inner]), given the router's choice: ``hidden``
    [tokens, hidden], ``top_k_index`` and ``top_k_weights`` [tokens, k]."""
    expert = top_k_index.reshape(-1)
    rows = hidden.repeat_interleave(k, dim=0)
    both = torch.bmm(fc1[expert], rows.unsqueeze(-1)).squeeze(-1)
    if fc1_bias is not None:
        both = both + fc1_bias[expert]
    gate, up = both.chunk(2, dim=-1)
    inner = torch.nn.functional.silu(gate) * up
    out = torch.bmm(fc2[expert], inner.unsqueeze(-1)).squeeze(-1)
    if fc2_bias is not None:
        out = out + fc2_bias[expert]
    weighted = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return weighted.view(hidden.shape[0], k, hidden.shape[1]).sum(dim=1).to(hidden.dtype)


@moe.register_fake
def _moe_fake(hidden, top_k_index, top_k_weights, fc1, fc2, fc1_bias, fc2_bias, k):
    return torch.empty_like(hidden)


def translation_table() -> dict[Any, Any]:
    """torch.onnx's translation of :func:`moe`: ONNX Runtime's ``MoE`` fed the router's choice as
    logits (see the module's docstring)."""
    import numpy as np
    import onnx
    from onnxscript import opset18 as op
    from onnxscript import values

    from ..runtime import contrib_schema

    schema = contrib_schema("MoE")
    mixture = values.Op(values.Opset(schema.domain, schema.since_version), "MoE", schema)
    never = onnx.numpy_helper.from_array(np.array([-np.inf], np.float32))

    def moe_onnx(hidden, top_k_index, top_k_weights, fc1, fc2, fc1_bias=None, fc2_bias=None, k: int = 1):
        shape = op.Concat(op.Shape(hidden, end=1), op.Shape(fc1, end=1), axis=0)
        logits = op.ScatterElements(op.ConstantOfShape(shape, value=never), top_k_index, op.Log(top_k_weights), axis=1)
        mixed = mixture(hidden, logits, fc1, fc1_bias, fc2, fc2_bias, k=k, activation_type="swiglu",
                            swiglu_fusion=2, normalize_routing_weights=1)
        return op.Mul(mixed, op.ReduceSum(top_k_weights, op.Constant(value_ints=[1]), keepdims=1))

    return {torch.ops.onnxport.moe.default: moe_onnx}


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers' experts interface runs (they carry its layout flags)."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def kernel_takes(module: torch.nn.Module) -> bool:
    """Whether ONNX Runtime's ``MoE`` computes what ``module`` computes: gated SiLU experts
    (transformers' default gate), gate and up concatenated, weights [experts, out, in] in float32
    (or torchao's quantized experts' plain stand-ins), no norm after the experts."""
    from transformers.integrations import moe as hf_moe

    act = getattr(module, "act_fn", None)
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    return (bool(getattr(module, "has_gate", False)) and bool(getattr(module, "is_concatenated", False))
            and not getattr(module, "is_transposed", True) and not getattr(module, "has_post_expert_norm", True)
            and not getattr(module, "_is_expert_parallel", False)
            and getattr(type(module), "_apply_gate", None) is hf_moe._default_apply_gate
            and type(act).__name__ in ("SiLU", "SiLUActivation")
            and all(type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor and w.dtype == torch.float32
                    and w.dim() == 3 for w in weights))


#: the experts modules the kernel takes while a capture runs
_TAKEN: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def qmoe_holds(weights: list) -> bool:
    """Whether ONNX Runtime's ``QMoE`` can hold every quantized expert weight of ``weights``
    (:class:`~onnxport.exporters.weight_only.QuantizedWeight`): int4, symmetric, blocked along the
    input features by a power of two from 16 (:class:`~onnxport.passes.moe_kernel.QMoEPass`)."""
    return all(w.bits == 4 and w.zero_point is None and w.axis == 2 and w.group >= 16 and not w.group & (w.group - 1)
               for w in weights if w.kind == "experts")


#: the experts modules a capture gathers (``batched_mm``): past :data:`ROUTED_EXPERTS_LIMIT`
_GATHERED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _exportable_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    if self in _GATHERED:
        from transformers.integrations import moe as hf_moe

        return hf_moe.batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return routed_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _kernel_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    if self not in _TAKEN:  # decided before the capture: its parameters are fake tensors here
        return _exportable_forward(self, hidden_states, top_k_index, top_k_weights)
    bias = bool(getattr(self, "has_bias", False))
    return torch.ops.onnxport.moe(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), self.gate_up_proj,
                                  self.down_proj, self.gate_up_proj_bias if bias else None,
                                  self.down_proj_bias if bias else None, top_k_index.shape[-1])


@contextlib.contextmanager
def exportable_experts(model: torch.nn.Module, *, kernel: bool = False, capture: bool = True) -> Iterator[list[torch.nn.Module]]:
    """Capture ``model``'s experts with :data:`EXPORTABLE_EXPERTS`, or with ONNX Runtime's kernel
    where ``kernel`` and :func:`kernel_takes` (then ``torch_program`` needs
    :func:`translation_table`); give the model back its own implementation afterwards. Yields the
    modules the kernel takes. Models without experts are left alone; no weight is changed.

    For a ``capture``, more than :data:`ROUTED_EXPERTS_LIMIT` routed experts are gathered per token
    instead, with a :class:`~onnxport.errors.PerformanceWarning` (an eager run, ``capture=False``,
    always routes them)."""
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_experts_implementation_internal")]
    configs = list({id(c): c for c in configs}.values())
    saved = [c._experts_implementation_internal for c in configs]
    taken = [m for m in experts_modules(model) if kernel and kernel_takes(m)]
    routed = [m for m in experts_modules(model) if m not in taken]
    count = sum(int(getattr(m, "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj").shape[0]) for m in routed)
    gathered = routed if capture and count > ROUTED_EXPERTS_LIMIT else []
    if gathered:
        from ..errors import PerformanceWarning

        warnings.warn(
            f"{type(model).__name__} has {count} experts to route in {len(routed)} layers, more than the "
            f"{ROUTED_EXPERTS_LIMIT} a capture routes expert by expert (torch.onnx's optimizer takes time that grows "
            f"with the square of the graph's size): they are captured as transformers' batched_mm, which copies each chosen expert's "
            f"matrices per token, so prompts run slower in this file. flavour='ort-cpu' runs ONNX Runtime's "
            f"MoE kernel where it takes the experts.",
            PerformanceWarning,
            stacklevel=3,
        )
    interface: Any = None
    added: list[str] = []
    try:
        if configs:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            interface = ALL_EXPERTS_FUNCTIONS
            for name, forward in ((EXPORTABLE_EXPERTS, _exportable_forward), (KERNEL_EXPERTS, _kernel_forward)):
                if name not in interface:  # a capture inside another leaves the outer one's in place
                    interface[name] = forward
                    added.append(name)
        _TAKEN.update(taken)
        _GATHERED.update(gathered)
        for config in configs:
            config._experts_implementation_internal = KERNEL_EXPERTS if taken else EXPORTABLE_EXPERTS
        yield taken
    finally:
        for config, value in zip(configs, saved):
            config._experts_implementation_internal = value
        for module in taken:
            _TAKEN.discard(module)
        for module in gathered:
            _GATHERED.discard(module)
        for name in added:
            del interface[name]
