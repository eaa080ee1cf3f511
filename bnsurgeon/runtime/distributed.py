"""Start torch.distributed from torchrun's environment, the way bnsurgeon's layers expect."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from bnsurgeon.runtime.timeout import DEFAULT_TIMEOUT_S, dist_timeout_s

__all__ = ["DEFAULT_TIMEOUT_S", "DistributedInfo", "init_distributed"]


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process stands: its rank, the world, and the device it should use."""

    rank: int
    world_size: int
    local_rank: int
    device: "object"
    backend: str | None
    distributed: bool


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> DistributedInfo:
    """Initialise the default process group from torchrun's environment variables.

    NCCL when CUDA is available, else gloo. The CUDA device is set to LOCAL_RANK before
    anything touches the GPU, so no rank leaks a context onto cuda:0. Collectives time
    out after ``timeout_s`` (``BNSURGEON_DIST_TIMEOUT``, default 600 s) instead of hanging.
    Without torchrun's variables this is a no-op that describes a single process.
    """
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return DistributedInfo(0, 1, 0, device, None, False)

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = backend or ("nccl" if cuda else "gloo")
    if cuda and chosen == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    seconds = timeout_s if timeout_s is not None else dist_timeout_s()
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(chosen, rank=rank, world_size=world_size, timeout=timedelta(seconds=seconds), **kwargs)
    return DistributedInfo(rank, world_size, local_rank, device, chosen, True)
