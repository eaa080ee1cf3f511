"""The "Do I need sync BN?" picture of the README: a small timm model trained a few steps on 2 CPU ranks, per rank
batch size given, under ``bnsurgeon run --stats``.

    torchrun --nproc-per-node 2 -m bnsurgeon run --stats gaps-b8.json scripts/sync_gaps_demo.py 8

No data set is reachable here, so the images are synthetic with what makes real images' statistics differ from
one image to the next: a smooth random scene (noise at 1/8 resolution, upsampled), a brightness and contrast of
its own, and a colour cast per image. The model is built untrained (``pretrained=False``, seed 0) and its BN
layers converted with torch's converter, as a training script with ``--sync-bn`` does.
"""

from __future__ import annotations

import sys

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

MODEL, SIZE, STEPS = "resnet18", 64, 5


def images(count: int, generator: torch.Generator) -> torch.Tensor:
    scene = F.interpolate(torch.randn(count, 3, SIZE // 8, SIZE // 8, generator=generator), size=SIZE, mode="bicubic")
    contrast = torch.rand(count, 1, 1, 1, generator=generator) * 1.5 + 0.25
    brightness = torch.randn(count, 1, 1, 1, generator=generator) * 0.5
    cast = torch.randn(count, 3, 1, 1, generator=generator) * 0.3
    return scene * contrast + brightness + cast


def main() -> None:
    per_rank = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(timm.create_model(MODEL, pretrained=False, num_classes=10))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    for _ in range(STEPS):
        x = images(per_rank, generator)
        y = torch.randint(0, 10, (per_rank,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"{MODEL}: {STEPS} steps at {per_rank} images per rank on {world} ranks")


if __name__ == "__main__":
    main()
