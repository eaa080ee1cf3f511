"""Train a bnsurgeon-converted checkpoint a few steps under DDP (CPU/gloo by default, NCCL on GPUs).

    bnsurgeon convert efficientnet_b0 -o b0.sync.safetensors
    torchrun --nproc-per-node 2 scripts/train_ddp.py b0.sync.safetensors

Prints the loss per step and checks that every rank ends with identical running
statistics (the point of synchronized batch norm).
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint written by `bnsurgeon convert`")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch size")
    parser.add_argument("--size", type=int, default=64, help="input height/width")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import bnsurgeon
    from bnsurgeon.runtime import init_distributed

    info = init_distributed()
    model = bnsurgeon.load(args.checkpoint).to(info.device).train()
    cfg = getattr(model, "pretrained_cfg", None) or {}
    channels = (cfg.get("input_size") or (3,))[0]
    classes = getattr(model, "num_classes", 1000)
    ddp = (
        DistributedDataParallel(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
        if info.distributed
        else model
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    generator = torch.Generator().manual_seed(1234 + info.rank)
    for step in range(args.steps):
        x = torch.randn(args.batch, channels, args.size, args.size, generator=generator).to(info.device)
        target = torch.randint(0, classes, (args.batch,), generator=generator).to(info.device)
        loss = F.cross_entropy(ddp(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if info.rank == 0:
            print(
                f"step {step}: loss {loss.item():.4f} (rank 0 of {info.world_size}, {info.backend or 'single process'})",
                flush=True,
            )

    stats = torch.cat(
        [b.detach().float().flatten() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))]
    )
    if info.distributed:
        reference = stats.clone()
        dist.broadcast(reference, src=0)
        diff = (stats - reference).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        identical = diff.item() == 0.0
        if info.rank == 0:
            print(
                f"running stats identical across {info.world_size} ranks: {identical} (max |diff| {diff.item():.3g})",
                flush=True,
            )
        # every rank past its last collective before any tears the group down: a rank that left early closed its
        # sockets under the other's gloo threads, which aborted it (SIGABRT, seen once in a loaded CI run)
        dist.barrier()
        dist.destroy_process_group()
        if not identical:
            raise SystemExit(1)
    else:
        print("not launched distributed (use torchrun): trained as a single process", flush=True)


if __name__ == "__main__":
    main()
