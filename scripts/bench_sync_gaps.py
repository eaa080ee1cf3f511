"""What ``--stats`` costs: the training step of a converted timm model at W gloo ranks on CPU with the sync-gap
recorder on and off, interleaved in the same processes.

    python scripts/bench_sync_gaps.py [--model resnet18] [--batch 8] [--size 96] [--steps 20]

Each rank runs both variants on the same batch, in alternating order, and the median step (forward, backward,
gradient all_reduce, SGD) is reported, with their ratio (goal: on/off <= 1.02). The recorder is set to record
more steps than are timed, so every timed step records every layer.

Off, the sync layer's only extra work is one ``gaps.current() is None`` test per call: the script times that
test alone and gives its share of a step, and counts the aten ops a step dispatches off and on (the same count
off as a layer without the recorder: nothing is dispatched; on: the recorder's few ops per layer on (W, C)
tensors). No extra collective either way: the collectives per step are counted too.
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
    from torch.utils._python_dispatch import TorchDispatchMode

    import bnsurgeon
    from bnsurgeon.runtime import gaps, sync_function

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = bnsurgeon.convert(timm.create_model(args.model, pretrained=False, num_classes=10).train(), "sync").model
    layers = sum(isinstance(m, bnsurgeon.SyncBatchNorm) for m in model.modules())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    recorder = gaps.GapRecorder(steps=10**9)

    gathers = [0]
    original = sync_function.all_gather_rows

    def counting(*a, **k):
        gathers[0] += 1
        return original(*a, **k)

    sync_function.all_gather_rows = counting

    def step(on: bool):
        if on:
            gaps.start_recording(recorder)
        try:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)
            optimizer.step()
        finally:
            gaps.stop_recording()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    ops = {}
    collectives = {}
    for on in (False, True):
        step(on)  # warm-up
        with Count() as counter:
            gathers[0] = 0
            step(on)
        ops[on], collectives[on] = counter.ops, gathers[0]
    times = {False: [], True: []}
    for index in range(args.warmup + args.steps):
        for on in (False, True) if index % 2 == 0 else (True, False):
            dist.barrier()
            start = time.perf_counter()
            step(on)
            if index >= args.warmup:
                times[on].append(time.perf_counter() - start)
    calls = 10**6
    start = time.perf_counter()
    for _ in range(calls):
        gaps.current() is None  # noqa: B015 - the off path's one test, timed alone
    check_s = (time.perf_counter() - start) / calls
    return {
        "layers": layers,
        "median": {on: statistics.median(values) for on, values in times.items()},
        "ops": ops,
        "collectives": collectives,
        "check_s": check_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from bnsurgeon.checks.multiproc import run_world

    row = run_world(args.world_size, _worker, args, timeout=3600, collective_timeout=1800)[0]
    off, on = row["median"][False], row["median"][True]
    print(
        f"torch {torch.__version__}, CPU, gloo, {args.world_size} ranks x {args.threads} thread(s); {args.model}, "
        f"batch {args.batch}/rank, {args.size}x{args.size}; median of {args.steps} interleaved steps; "
        f"{row['layers']} sync BN layers"
    )
    print(f"{'recorder':>9} {'ms/step':>9} {'aten ops/step':>14} {'sync collectives/step':>22}")
    for name, flag, seconds in (("off", False, off), ("on", True, on)):
        print(f"{name:>9} {seconds * 1e3:9.1f} {row['ops'][flag]:>14} {row['collectives'][flag]:>22}")
    print(f"on/off = {on / off:.4f} (goal <= 1.02)")
    share = row["check_s"] * row["layers"] / off
    print(
        f"off: {row['check_s'] * 1e9:.0f} ns per layer call (the recorder test), {row['layers']} calls per step: "
        f"{share:.1e} of a step; ops dispatched on - off = {row['ops'][True] - row['ops'][False]}"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
