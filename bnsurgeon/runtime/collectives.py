"""The collective shapes the sync layers use, in one place."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_rows(local: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """One all_gather of a 1-D tensor; row r of the result is rank r's tensor.

    The output is allocated flat because gloo's all_gather_into_tensor requires it.
    """
    gathered = local.new_empty(world_size * local.numel())
    dist.all_gather_into_tensor(gathered, local, group=group)
    return gathered.view(world_size, local.numel())


def all_reduce_sum(local: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """Sum of a small 1-D tensor over the group, identical on every rank.

    Off the CPU (NCCL and other device backends) an all_reduce. On CPU an all_gather
    plus a local sum: gloo's ring all_reduce needs twice the message rounds of its
    all_gather, and for the few KB of batch-norm statistics the rounds are the whole cost
    (2 ranks: median 383 vs 465 us, 3 ranks: 1183 vs 1956 us on this project's 2-core
    machine).
    """
    if local.device.type != "cpu":
        dist.all_reduce(local, group=group)
        return local
    return all_gather_rows(local, world_size, group).sum(0)
