"""Tiny models the CLI tests load by 'tests.cli_models:NAME'."""

import torch
import torch.nn as nn


def tiny() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every process
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).eval()


not_a_model = 42
