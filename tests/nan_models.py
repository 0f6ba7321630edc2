"""Models that produce NaN at a known layer, in the forward or in the backward (NaN/Inf provenance tests)."""

from __future__ import annotations

import torch
from torch import nn


class InjectNaN(nn.Module):
    """Puts a NaN into its output while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x):
        if self.armed:
            x = x.clone()
            x[0, 0] = float("nan")
        return x


def nan_model() -> nn.Sequential:
    """Layer "1" produces the NaN in the forward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), InjectNaN(), nn.Linear(4, 4), nn.ReLU())


class NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class BadBackward(nn.Module):
    """Identity forward; its backward returns NaN gradients."""

    def forward(self, x):
        return NaNGrad.apply(x)


def bad_backward_model() -> nn.Sequential:
    """Layer "1" produces the NaN in the backward; "2" backward is fine, "0" backward only receives it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), BadBackward(), nn.Linear(4, 1))
