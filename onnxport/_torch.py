"""Small torch helpers shared by the exporters (imported lazily: torch is heavy)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .errors import InvalidArgumentError


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
