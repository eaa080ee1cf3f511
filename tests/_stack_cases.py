"""Rank workers for the training stacks people use now: FSDP2 and DDP ``no_sync`` accumulation
(importable by the forked ranks). Each rank trains on its slice of every batch; the reference is
one process of plain BN on the whole batch, in float64."""

from __future__ import annotations

import torch
from torch import nn

SPLIT = [3, 5]  # uneven on purpose: statistics merged by count, not averaged per rank
STEPS = 2
MICRO = 2  # micro-batches accumulated per optimizer step under no_sync


def model() -> nn.Module:
    """conv -> BN -> ReLU -> conv -> BN(momentum=None) -> pool -> linear, float64, fixed weights."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 5, 3, padding=1),
        nn.BatchNorm2d(5, momentum=None),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
    ).double()
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return net


def batch(step: int, micro: int = 0):
    generator = torch.Generator().manual_seed(1000 + 10 * step + micro)
    x = torch.randn(sum(SPLIT), 3, 6, 6, generator=generator, dtype=torch.float64) * 2 + 1
    return x, torch.randn(sum(SPLIT), 4, generator=generator, dtype=torch.float64)


def rows(rank: int) -> slice:
    start = sum(SPLIT[:rank])
    return slice(start, start + SPLIT[rank])


def reference_state(micro_batches: int = 1) -> dict:
    """One process, plain BN, the whole batch: the state the ranks must reach."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            x, g = batch(step, micro)
            (net(x) * g).sum().div(sum(SPLIT) * micro_batches).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _state(net: nn.Module) -> dict:
    state = {}
    for key, value in net.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        state[key.replace("module.", "", 1) if key.startswith("module.") else key] = full.detach().clone()
    return state


def fsdp2_rank(rank: int, world_size: int) -> dict:
    """FSDP2 (``fully_shard``) over a converted model: parameters sharded, BN buffers replicated."""
    from torch.distributed.fsdp import fully_shard

    import bnsurgeon

    net = bnsurgeon.convert(model(), "sync").model
    for index in (0, 3):
        fully_shard(net[index])
    fully_shard(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, g = batch(step)
        optimizer.zero_grad()
        # FSDP averages gradients over the ranks: scale each rank's sum by W / (whole batch)
        (net(x[rows(rank)]) * g[rows(rank)]).sum().mul(world_size / sum(SPLIT)).backward()
        optimizer.step()
    return _state(net)


def no_sync_rank(rank: int, world_size: int) -> dict:
    """DDP with gradient accumulation: every micro-batch but the last under ``no_sync()``; the sync
    layers still synchronize each forward (only DDP's gradient all-reduce waits)."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    import bnsurgeon

    net = DistributedDataParallel(bnsurgeon.convert(model(), "sync").model, broadcast_buffers=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(MICRO):
            x, g = batch(step, micro)
            accumulate = net.no_sync() if micro < MICRO - 1 else contextlib.nullcontext()
            with accumulate:
                (net(x[rows(rank)]) * g[rows(rank)]).sum().mul(world_size / (sum(SPLIT) * MICRO)).backward()
        optimizer.step()
    return _state(net)
