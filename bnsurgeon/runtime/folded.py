"""What stays of a norm-act module once its BN is folded into the layer before it: drop, then act."""

from __future__ import annotations

import torch
from torch import nn


class FoldedNormAct(nn.Module):
    """timm's BatchNormAct2d after folding: ``act(drop(x))`` with the source's own drop and act modules."""

    def __init__(self, drop: nn.Module | None = None, act: nn.Module | None = None) -> None:
        super().__init__()
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(x))
