"""Per-layer forward+backward time of bnsurgeon's SyncBatchNorm at W gloo ranks on CPU,
against native nn.BatchNorm (no sync) on the same per-rank tensor and against the two
collectives alone, interleaved in the same processes.

    python scripts/bench_runtime.py [--world-size 2] [--iters 30] [--threads 1] [--previous REV]

Prints per shape: native, collectives, sync (ms), sync/native and sync/floor where
floor = native + collectives, then geometric means; once from the medians and once
from the minimums (on a small shared machine the median of a sub-millisecond
collective is mostly scheduler noise, the minimum is its intrinsic cost). A second
reference, "sequenced", runs native BN with the same two collectives placed where the
sync layer needs them (bench_common.py: a gather before normalizing, a sum over ranks in
backward): what any sync BN pays for waiting on the other ranks, which the floor leaves
out. ``--previous REV`` also times the sync layer of an earlier build (the package at a
git revision, imported side by side as ``bnsurgeon_previous``) in the same interleaved
loop, and prints sync/previous.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    from bench_common import LayerCollectives, sequenced

    import bnsurgeon

    torch.set_num_threads(args.threads)
    previous = _import_previous(args.previous_dir) if args.previous_dir else None
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
        runners = {}
        if previous is not None:
            old = previous.convert(_native_for(shape, channels), "sync").model.train()
            runners["previous"] = lambda: old(x).backward(grad)

        def run_native():
            native(x).backward(grad)

        def run_sync():
            sync(x).backward(grad)

        def run_sequenced():
            native(sequenced(x, collectives)).backward(grad)

        run_collectives = collectives.both

        runners = {
            "native": run_native,
            "collectives": run_collectives,
            "sync": run_sync,
            "sequenced": run_sequenced,
            **runners,
        }
        timings = {name: [] for name in runners}
        for _ in range(args.warmup):
            for run in runners.values():
                run()
        for _ in range(args.iters):  # interleaved, so drift hits all of them alike
            for name, run in runners.items():
                timings[name].append(_time(run, barrier))
            x.grad = None
        rows.append({k: (statistics.median(v) * 1e3, min(v) * 1e3) for k, v in timings.items()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--previous", metavar="REV", help="also time the sync layer of the package at this git revision"
    )
    args = parser.parse_args()

    import torch

    from bnsurgeon.checks.multiproc import run_world

    with tempfile.TemporaryDirectory() as scratch:
        args.previous_dir = _export_previous(args.previous, Path(scratch)) if args.previous else None
        _run(args, run_world, torch)


def _export_previous(revision: str, scratch: Path) -> str:
    """The package as it was at ``revision``, as ``bnsurgeon_previous`` under ``scratch`` (its imports are relative)."""
    root = Path(__file__).resolve().parents[1]
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", revision, "bnsurgeon"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
    (scratch / "bnsurgeon").rename(scratch / "bnsurgeon_previous")
    return str(scratch)


def _import_previous(directory: str):
    import importlib
    import warnings

    sys.path.insert(0, directory)
    warnings.filterwarnings("ignore", category=FutureWarning)  # older builds warn on every gather
    return importlib.import_module("bnsurgeon_previous")


def _run(args, run_world, torch) -> None:
    by_rank = run_world(args.world_size, _worker, args, timeout=3600, collective_timeout=600)

    print(
        f"torch {torch.__version__}, CPU, gloo, {args.world_size} ranks x {args.threads} thread(s), "
        f"{args.iters} interleaved iterations (forward + backward, ms, rank 0)"
        + (f"; previous = the package at {args.previous}" if args.previous else "")
    )
    for index, statistic in enumerate(("median", "minimum")):
        _print_table(statistic, [{k: v[index] for k, v in row.items()} for row in by_rank[0]])


def _print_table(statistic: str, rows: list[dict]) -> None:
    from bench_common import geometric_mean

    previous = "previous" in rows[0]
    print(f"\n{statistic}:")
    print(
        f"{'shape':>18} {'native':>9} {'collect.':>9} {'sequenced':>10} {'sync':>9} "
        f"{'sync/native':>12} {'sync/floor':>11} {'sync/sequenced':>15}"
        + (f" {'previous':>9} {'sync/previous':>14}" if previous else "")
    )
    ratios = {"native": [], "floor": [], "sequenced": []} | ({"previous": []} if previous else {})
    for shape, row in zip(SHAPES, rows):
        row = dict(row, floor=row["native"] + row["collectives"])
        for name in ratios:
            ratios[name].append(row["sync"] / row[name])
        print(
            f"{str(shape):>18} {row['native']:9.3f} {row['collectives']:9.3f} {row['sequenced']:10.3f} "
            f"{row['sync']:9.3f} {ratios['native'][-1]:12.3f} {ratios['floor'][-1]:11.3f} "
            f"{ratios['sequenced'][-1]:15.3f}"
            + (f" {row['previous']:9.3f} {ratios['previous'][-1]:14.3f}" if previous else "")
        )
    geo = {name: geometric_mean(values) for name, values in ratios.items()}
    print(
        f"{'geometric mean':>18} {'':9} {'':9} {'':10} {'':9} {geo['native']:12.3f} "
        f"{geo['floor']:11.3f} {geo['sequenced']:15.3f}" + (f" {'':9} {geo['previous']:14.3f}" if previous else "")
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
