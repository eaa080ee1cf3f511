"""Start torch.distributed from torchrun's environment, the way bnsurgeon's layers expect."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from bnsurgeon.runtime.timeout import DEFAULT_TIMEOUT_S, dist_timeout_s

__all__ = ["DEFAULT_TIMEOUT_S", "DistributedInfo", "default_backend", "init_distributed"]


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process stands: its rank, the world, and the device it should use."""

    rank: int
    world_size: int
    local_rank: int
    device: "object"
    backend: str | None
    distributed: bool


def default_backend(cuda: bool, device_count: int) -> str:
    """NCCL when each of this node's ranks (torchrun's LOCAL_WORLD_SIZE) gets a GPU of its own, else gloo.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so more local ranks than GPUs
    (a one-GPU machine running a 2-rank job, as the test suite does) train on gloo.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1").strip()
    local_ranks = int(raw) if raw.isdigit() else 1
    return "nccl" if cuda and device_count >= max(local_ranks, 1) else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> DistributedInfo:
    """Initialise the default process group from torchrun's environment variables.

    NCCL when every local rank can have a GPU of its own, else gloo (``default_backend``). The CUDA device is set to LOCAL_RANK before
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
    chosen = backend or default_backend(cuda, torch.cuda.device_count() if cuda else 0)
    if cuda and chosen == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    seconds = timeout_s if timeout_s is not None else dist_timeout_s()
    if not dist.is_initialized():
        dist.init_process_group(
            chosen,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=seconds),
            device_id=device if device.type == "cuda" else None,
        )
    return DistributedInfo(rank, world_size, local_rank, device, chosen, True)
