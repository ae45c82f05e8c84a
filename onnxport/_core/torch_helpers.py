"""Small torch helpers shared by the exporters (imported lazily: torch is heavy)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import InvalidArgumentError


def require_module(model: Any, argument: str = "model") -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            f"{argument} must be a torch.nn.Module, not {type(model).__name__}; pass the model object itself."
        )
    return model


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put ``model`` in eval mode for the block and restore every submodule's own flag after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
    except NotImplementedError:
        pass  # a pt2e graph module that forbids eval(): it is exported as captured
    try:
        yield model
    finally:
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def without_kv_cache(model: Any) -> Iterator[None]:
    """``model`` computing without its key/value cache for the block, then as it was.

    A transformers decoder as ``from_pretrained`` gives it (GPT-2, Llama, BART: ``config.use_cache``
    True) returns a ``Cache`` object beside its logits; torch.export cannot return that type, and a
    graph that reads the whole sequence at once has no use for it. Every config among the model's
    modules with ``use_cache`` on is switched off for the block and restored after.
    """
    configs = {id(c): c for m in (model.modules() if isinstance(model, torch.nn.Module) else ())
               if (c := getattr(m, "config", None)) is not None and getattr(c, "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def drop_weights(*models: torch.nn.Module) -> None:
    """Free the parameters and buffers of models whose every tensor the caller owns and will not
    run again (their configs stay), and hand the memory back to the OS.

    Each tensor's data is replaced by an empty one, so the memory goes even where a library still
    holds the tensor object (onnxscript's rewrite rules keep the last graph they matched, and its
    initializers wrap the model's parameters); the modules then hold no tensors at all.
    """
    from .io import release_freed_memory

    for model in models:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is not None:
                        with contextlib.suppress(RuntimeError, TypeError):  # a tensor subclass keeps its data
                            tensor.data = torch.empty(0, dtype=tensor.dtype)
                    table[name] = None
    release_freed_memory()
