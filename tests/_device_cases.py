"""Rank functions for the CUDA path forced onto CPU tensors (strict kernel stand-ins, real gloo collectives)."""

from __future__ import annotations

import torch
from torch import nn

SPLITS = {"leading empty rank": [0, 5, 2], "only rank 0": [3, 0, 0], "uneven": [1, 2, 4]}
STEPS = 2


def batch(splits: list[int], step: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(100 + step)
    total = sum(splits)
    x = torch.randn(total, 4, 3, 3, generator=generator, dtype=torch.float64) * 5 + 30  # |mean| >> std
    dy = torch.randn(total, 4, 3, 3, generator=generator, dtype=torch.float64)
    return x.to(dtype), dy.to(dtype)


def layer(dtype=torch.float64) -> nn.BatchNorm2d:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    return bn.to(dtype)


def device_path_rank(rank: int, world_size: int, splits: list[int]) -> dict:
    """STEPS training steps of a converted layer on this rank's slice, through the CUDA path."""
    from _cuda_standin import installed

    import bnsurgeon

    model = bnsurgeon.convert(nn.Sequential(layer()), "sync").model.train()
    outputs, grads = [], []
    start = sum(splits[:rank])
    with installed():
        for step in range(STEPS):
            x, dy = batch(splits, step)
            x = x[start : start + splits[rank]].clone().requires_grad_()
            y = model(x)
            y.backward(dy[start : start + splits[rank]])
            outputs.append(y.detach())
            grads.append(x.grad)
    bn = model[0]
    return {
        "outputs": outputs,
        "grads": grads,
        "weight_grad": bn.weight.grad,
        "bias_grad": bn.bias.grad,
        "state": {k: v.clone() for k, v in bn.state_dict().items()},
    }
