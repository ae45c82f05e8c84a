"""A family's quirks, registered by ``model_type`` (as Optimum keeps one config per architecture):
how to load it and what to change before it exports. The front door's code never names a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Adapter:
    """What one family needs to export.

    Attributes:
        load_kwargs: given to ``from_pretrained`` (an attention implementation that exports).
        prepare: changes the loaded model in place before export (a data-dependent branch off).
    """

    load_kwargs: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[torch.nn.Module], None] = lambda model: None


#: transformers' eager attention: SDPA's export carries a NaN guard per attention (IsNaN and Where
#: after its softmax) that ONNX Runtime runs on every call; the eager form is the plain three ops
DEFAULT = Adapter(load_kwargs={"attn_implementation": "eager"})
ADAPTERS: dict[str, Adapter] = {}


def register(*model_types: str) -> Callable[[Adapter], Adapter]:
    def add(adapter: Adapter) -> Adapter:
        for model_type in model_types:
            ADAPTERS[model_type] = adapter
        return adapter

    return add


def adapter_for(model_type: str) -> Adapter:
    return ADAPTERS.get(model_type, DEFAULT)
