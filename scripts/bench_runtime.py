"""Per-layer forward+backward time of bnsurgeon's SyncBatchNorm at W gloo ranks on CPU,
against native nn.BatchNorm (no sync) on the same per-rank tensor and against the two
collectives alone, interleaved in the same processes.

    python scripts/bench_runtime.py [--world-size 2] [--iters 30] [--threads 1]

Prints per shape: native, collectives, sync (ms), sync/native and sync/floor where
floor = native + collectives, then geometric means; once from the medians and once
from the minimums (on a small shared machine the median of a sub-millisecond
collective is mostly scheduler noise, the minimum is its intrinsic cost). A second
reference, "sequenced", runs native BN with the same two collectives placed where the
sync layer needs them (bench_common.py: a gather before normalizing, a sum over ranks in
backward): what any sync BN pays for waiting on the other ranks, which the floor leaves
out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SHAPES = [(8, 64, 56, 56), (8, 256, 14, 14), (32, 512, 7, 7), (64, 128)]



def _native_for(shape, channels):
    from torch import nn

    return {2: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)](channels)


def _time(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _worker(rank, world_size, args):
    import torch
    import torch.distributed as dist

    import bnsurgeon
    from bench_common import LayerCollectives, sequenced

    torch.set_num_threads(args.threads)
    barrier = dist.barrier
    rows = []
    for shape in SHAPES:
        channels = shape[1]
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(shape, generator=generator).requires_grad_()
        grad = torch.randn(shape, generator=generator)
        native = _native_for(shape, channels).train()
        sync = bnsurgeon.convert(_native_for(shape, channels), "sync").model.train()
        collectives = LayerCollectives(channels, world_size)

        def run_native():
            native(x).backward(grad)

        def run_sync():
            sync(x).backward(grad)

        def run_sequenced():
            native(sequenced(x, collectives)).backward(grad)

        run_collectives = collectives.both

        timings = {"native": [], "collectives": [], "sync": [], "sequenced": []}
        for _ in range(args.warmup):
            run_native(), run_sync(), run_collectives(), run_sequenced()
        for _ in range(args.iters):  # interleaved, so drift hits all three alike
            timings["native"].append(_time(run_native, barrier))
            timings["collectives"].append(_time(run_collectives, barrier))
            timings["sync"].append(_time(run_sync, barrier))
            timings["sequenced"].append(_time(run_sequenced, barrier))
            x.grad = None
        rows.append({k: (statistics.median(v) * 1e3, min(v) * 1e3) for k, v in timings.items()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()

    import torch
    from bnsurgeon.multiproc import run_world

    by_rank = run_world(args.world_size, _worker, args, timeout=3600, collective_timeout=600)

    print(f"torch {torch.__version__}, CPU, gloo, {args.world_size} ranks x {args.threads} thread(s), "
          f"{args.iters} interleaved iterations (forward + backward, ms, rank 0)")
    for index, statistic in enumerate(("median", "minimum")):
        _print_table(statistic, [{k: v[index] for k, v in row.items()} for row in by_rank[0]])


def _print_table(statistic: str, rows: list[dict]) -> None:
    from bench_common import geometric_mean

    print(f"\n{statistic}:")
    print(f"{'shape':>18} {'native':>9} {'collect.':>9} {'sequenced':>10} {'sync':>9} "
          f"{'sync/native':>12} {'sync/floor':>11} {'sync/sequenced':>15}")
    ratios = {"native": [], "floor": [], "sequenced": []}
    for shape, row in zip(SHAPES, rows):
        row = dict(row, floor=row["native"] + row["collectives"])
        for name in ratios:
            ratios[name].append(row["sync"] / row[name])
        print(f"{str(shape):>18} {row['native']:9.3f} {row['collectives']:9.3f} {row['sequenced']:10.3f} "
              f"{row['sync']:9.3f} {ratios['native'][-1]:12.3f} {ratios['floor'][-1]:11.3f} "
              f"{ratios['sequenced'][-1]:15.3f}")
    geo = {name: geometric_mean(values) for name, values in ratios.items()}
    print(f"{'geometric mean':>18} {'':9} {'':9} {'':10} {'':9} {geo['native']:12.3f} "
          f"{geo['floor']:11.3f} {geo['sequenced']:15.3f}")

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
