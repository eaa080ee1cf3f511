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
