"""Training-step time of a converted timm model at W gloo ranks on CPU, eager and compiled:
bnsurgeon's sync layers vs plain (unsynced) BN vs "sequenced", interleaved in the same processes.

    python scripts/bench_train.py [--model resnet18] [--batch 8] [--size 96] [--steps 12]
                                  [--compile inductor|aot_eager|none] [--checkpoint]

Each rank runs every variant on the same batch, in alternating order, and the median
step (forward, backward, gradient all_reduce, SGD) is reported:

- plain: the timm model with plain (unsynced) BN.
- sequenced: plain BN with a sync layer's two collectives at every BN (bench_common.py: a
  gather before normalizing, a sum over ranks in backward): the communication any
  synchronized BN waits for, without bnsurgeon's own work, so sync/sequenced is the part of
  the overhead that is ours. Compiled, it is BN as inductor decomposes it with its local
  statistics passed through the collectives (custom ops), so that they stay where a sync BN
  must wait for them instead of being hoisted off the critical path.
- sync: bnsurgeon's sync layers.
- with ``--compile``, the same three under ``torch.compile(fullgraph=True)``, compiled
  before timing starts.
- with ``--checkpoint``, also eager sync with timm's ``set_grad_checkpointing()``, and the
  number of sync collectives per step it issues (goal: BN layers x 2, not x 3).

Gradients are summed over the ranks with one all_reduce of them all, flattened, after
backward (no DDP: its bucket hooks would split the compiled graph), the same for every variant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _variants(args, world_size):
    import timm
    import torch
    from bench_common import add_sequenced_collectives

    import bnsurgeon

    def build():
        torch.manual_seed(0)
        return timm.create_model(args.model, pretrained=False, num_classes=10).train()

    plain, sequenced = build(), build()
    layers = add_sequenced_collectives(sequenced, world_size)
    synced = bnsurgeon.convert(build(), "sync").model
    models = {"plain": plain, "sequenced": sequenced, "sync": synced}
    runs = {name: (model, model) for name, model in models.items()}
    if args.compile != "none":
        for name, model in models.items():
            runs[f"{name} compiled"] = (model, torch.compile(model, fullgraph=True, backend=args.compile))
    if args.checkpoint:
        checkpointed = bnsurgeon.convert(build(), "sync").model
        checkpointed.set_grad_checkpointing(True)
        runs["sync checkpointed"] = (checkpointed, checkpointed)
    return runs, layers


def _worker(rank, world_size, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from bnsurgeon.runtime import sync_function

    torch.set_num_threads(args.threads)
    runs, layers = _variants(args, world_size)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) for name, (model, _) in runs.items()}
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)

    gathers = [0]
    original = sync_function.all_gather_rows

    def counting(*a, **k):
        gathers[0] += 1
        return original(*a, **k)

    sync_function.all_gather_rows = counting

    def step(name):
        model, call = runs[name]
        optimizer = optimizers[name]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(call(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)  # one all_reduce, as DDP's buckets would
        dist.all_reduce(flat)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)
        optimizer.step()

    compile_s = {}
    for name in runs:  # compiles (and warms up) every variant before any timing
        start = time.perf_counter()
        step(name)
        compile_s[name] = time.perf_counter() - start
    times = {name: [] for name in runs}
    collectives = {name: [] for name in runs}
    for index in range(args.warmup + args.steps):
        order = list(runs) if index % 2 == 0 else list(runs)[::-1]  # interleaved, order alternating
        for name in order:
            dist.barrier()
            gathers[0] = 0
            start = time.perf_counter()
            step(name)
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
                collectives[name].append(gathers[0])
    return {
        "layers": layers,
        "compile_s": compile_s,
        "median": {k: statistics.median(v) for k, v in times.items()},
        "collectives": {k: max(v) for k, v in collectives.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", default="none", help="torch.compile backend for the compiled runs (none: skip)")
    parser.add_argument("--checkpoint", action="store_true", help="also time eager sync with timm's grad checkpointing")
    args = parser.parse_args()

    import torch

    from bnsurgeon.checks.multiproc import run_world

    by_rank = run_world(args.world_size, _worker, args, timeout=7200, collective_timeout=1800)
    row = by_rank[0]
    median = row["median"]
    print(
        f"torch {torch.__version__}, CPU, gloo, {args.world_size} ranks x {args.threads} thread(s); {args.model}, "
        f"batch {args.batch}/rank, {args.size}x{args.size}; median of {args.steps} interleaved steps; "
        f"{row['layers']} BN layers; compile backend: {args.compile}"
    )
    print(f"{'variant':>22} {'ms/step':>9} {'sync collectives/step':>22} {'first step s':>13}")
    for name, seconds in median.items():
        print(f"{name:>22} {seconds * 1e3:9.1f} {row['collectives'][name]:>22} {row['compile_s'][name]:13.1f}")
    for suffix in ("", " compiled"):
        if f"sync{suffix}" in median:
            print(
                f"{('eager' if not suffix else 'compiled'):>9}: sync/plain = {median['sync' + suffix] / median['plain' + suffix]:.3f}; "
                f"sequenced/plain = {median['sequenced' + suffix] / median['plain' + suffix]:.3f}; "
                f"sync/sequenced = {median['sync' + suffix] / median['sequenced' + suffix]:.3f}"
            )
    if "sync compiled" in median:
        print(f"compiled sync / eager sync = {median['sync compiled'] / median['sync']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
