"""Tiny models the CLI tests load by 'tests.cli_models:NAME'."""

import torch
from torch import nn


def tiny() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every process
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).eval()


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(ids)))


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return _TinyLM().eval()


not_a_model = 42


def failing_factory():
    """A MODEL callable whose own code fails (a missing checkpoint, say)."""
    raise FileNotFoundError("weights.pt not found")



def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()


def tiny_mlp_tanh_gelu() -> nn.Module:
    """tiny_mlp with its GELUs written as the tanh approximation: the same weights, another function
    (a planted defect for the float proofs)."""
    model = tiny_mlp()
    for layer in (model[1], model[3]):
        layer.approximate = "tanh"
    return model
