"""DDP training-step time of a converted timm model at W gloo ranks on CPU: bnsurgeon's sync
layers vs the same model with plain (unsynced) BN, interleaved in the same processes.

    python scripts/bench_train.py [--model resnet18] [--batch 8] [--size 96] [--steps 12]

Prints the median step time of each and the ratio sync/plain (goal <= 1.05). A third
model, "sequenced", is plain BN with a sync layer's two collectives in front of every BN
(bench_common.py): the communication any synchronized BN must wait for, without
bnsurgeon's own work, so sync/sequenced is the part of the overhead that is ours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time



def _worker(rank, world_size, args):
    import timm
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import bnsurgeon
    from bench_common import add_sequenced_collectives

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = timm.create_model(args.model, pretrained=False, num_classes=10)
    synced = bnsurgeon.convert(timm.create_model(args.model, pretrained=False, num_classes=10), "sync").model
    reference = timm.create_model(args.model, pretrained=False, num_classes=10)
    layers = add_sequenced_collectives(reference, world_size)
    runs = {}
    for name, model in (("plain", plain), ("sync", synced), ("sequenced", reference)):
        ddp = DistributedDataParallel(model.train())
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)

    def step(name):
        ddp, optimizer = runs[name]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    times = {name: [] for name in runs}
    for index in range(args.warmup + args.steps):
        order = list(runs) if index % 2 == 0 else list(runs)[::-1]  # interleaved, order alternating
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {"layers": layers, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from bnsurgeon.multiproc import run_world

    by_rank = run_world(args.world_size, _worker, args, timeout=3600, collective_timeout=600)
    row = by_rank[0]
    print(f"torch {torch.__version__}, CPU, gloo, {args.world_size} ranks x {args.threads} thread(s); {args.model}, "
          f"batch {args.batch}/rank, {args.size}x{args.size}; median of {args.steps} interleaved DDP steps")
    print(f"plain BN (unsynced): {row['plain'] * 1e3:.1f} ms/step; bnsurgeon sync: {row['sync'] * 1e3:.1f} ms/step; "
          f"sequenced ({row['layers']} BN layers x 2 collectives): {row['sequenced'] * 1e3:.1f} ms/step")
    print(f"sync/plain = {row['sync'] / row['plain']:.3f}; sequenced/plain = {row['sequenced'] / row['plain']:.3f}; "
          f"sync/sequenced = {row['sync'] / row['sequenced']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
