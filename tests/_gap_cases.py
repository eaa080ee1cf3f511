"""Rank functions and a training script for the sync-gap tests (test_sync_gaps.py): data whose per-rank gap is
known in closed form.

Every rank's batch is a base whose values are -1 and +1 in equal numbers per channel (mean 0, biased variance 1,
exactly), plus a per-channel shift of its own. With equal counts, the global batch's mean is the mean of the
shifts, its biased variance 1 + the shifts' own (biased) variance over the ranks, so rank r's

    mean gap  = (s_r - mean(s)) / sqrt(1 + var(s) + eps)
    scale gap = sqrt((1 + var(s) + eps) / (1 + eps)) - 1
"""

from __future__ import annotations

import math
import sys

import torch

EPS = 1e-5
N, C, H, W = 4, 3, 2, 2
#: per rank and channel: channel 2 is never shifted
SHIFTS = [[0.5, -1.0, 0.0], [-0.5, 1.0, 0.0]]


def batch(shift: list[float], dtype=torch.float64) -> torch.Tensor:
    signs = torch.tensor([1.0, -1.0], dtype=dtype).repeat(N * H * W // 2).view(N, H, W)
    return torch.stack([signs + value for value in shift], dim=1)  # (N, C, H, W)


def expected(shifts: list[list[float]]) -> tuple[list[list[float]], list[float]]:
    """(mean gap per rank and channel, scale gap per channel) in closed form."""
    world = len(shifts)
    means = [sum(s[c] for s in shifts) / world for c in range(C)]
    between = [sum((s[c] - means[c]) ** 2 for s in shifts) / world for c in range(C)]
    mean_gaps = [[(s[c] - means[c]) / math.sqrt(1 + between[c] + EPS) for c in range(C)] for s in shifts]
    scale_gaps = [math.sqrt((1 + between[c] + EPS) / (1 + EPS)) - 1 for c in range(C)]
    return mean_gaps, scale_gaps


def gap_rank(rank: int, world_size: int, shifted: bool) -> dict:
    """Two train-mode calls of bnsurgeon's layer built directly, recorded; the raw gaps of the first call and the
    summary."""
    from bnsurgeon.runtime import SyncBatchNorm
    from bnsurgeon.runtime.gaps import GapRecorder, start_recording

    layer = SyncBatchNorm(C, eps=EPS).double().train()
    recorder = GapRecorder(steps=2)
    start_recording(recorder)
    x = batch(SHIFTS[rank] if shifted else [0.25, 0.25, 0.25])
    for _ in range(3):  # the third call starts step 3: the recorder completes there
        layer(x)
    (layer,) = recorder.layers.values()
    mean_gaps, scale_gaps = layer.gaps()
    return {
        "done": recorder.done,
        "calls": len(layer.calls),
        "mean_gaps": mean_gaps[0].tolist(),
        "scale_gaps": scale_gaps[0].tolist(),
        "summary": recorder.summarize(),
    }


def main() -> None:
    """The training script ``bnsurgeon run --stats`` runs under torchrun: torch's SyncBatchNorm in a model the
    script builds, DDP, rank r fed its own shifted batch each step."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    steps = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Identity(), nn.SyncBatchNorm(C, eps=EPS)).double()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        ddp(batch(SHIFTS[rank])).sum().backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()


def api_rank(rank: int, world_size: int, path: str) -> dict | None:
    """A script that converts its model itself records through the Python API; the with block ends it early."""
    import bnsurgeon
    from bnsurgeon.runtime import SyncBatchNorm

    layer = SyncBatchNorm(C, eps=EPS).double().train()
    with bnsurgeon.record_sync_gaps(path, steps=5, quiet=True) as recording:
        for _ in range(2):
            layer(batch(SHIFTS[rank]))
    return recording.document
