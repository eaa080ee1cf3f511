"""Where `bnsurgeon verify` spends its time, against the way it ran before, in one run.

    python scripts/bench_verify.py                      # efficientnet_b0, -w 2 -w 3 (the README's example)
    python scripts/bench_verify.py --model resnet18 --world-size 2 --no-yardstick

Prints, for the README's example:

1. process start-up: a fresh interpreter importing the CLI, then torch + timm;
2. the command itself, end to end (a subprocess, as a user runs it), with the line
   each check streams as it finishes;
3. in this process: loading both sides, the one-process checks, the float64 reference
   the N-rank checks compare against, and each N-rank check;
4. the yardstick: the same checks with ``share_work=False`` (fresh processes and a fresh
   float64 reference for every N-rank check, as verify ran before the pool; its processes fork
   from the same warm server, so the spawned ranks' imports are not in it) and the ratio.

The machine is shared: run it alone (under the heavy-job lock) and read the ratios.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_subprocess(args: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, **kwargs)
    return time.monotonic() - started, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_b0")
    parser.add_argument("--world-size", "-w", type=int, action="append", default=None)
    parser.add_argument("--no-yardstick", action="store_true", help="skip the share_work=False run")
    options = parser.parse_args()
    world_sizes = tuple(options.world_size or [2, 3])
    python = sys.executable

    print(f"bnsurgeon verify {options.model} CONVERTED " + " ".join(f"-w {w}" for w in world_sizes), flush=True)
    cli_import, _ = timed_subprocess([python, "-c", "import bnsurgeon.cli"])
    heavy_import, _ = timed_subprocess([python, "-c", "import torch, timm"])
    print(
        f"  start-up: python + CLI import {cli_import:6.1f} s; python + torch + timm {heavy_import:6.1f} s", flush=True
    )

    with tempfile.TemporaryDirectory() as scratch:
        converted = Path(scratch) / "model.sync.safetensors"
        done = subprocess.run(
            [python, "-m", "bnsurgeon", "convert", options.model, "-o", str(converted), "-q"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(f"convert failed: {done.stderr}")
        command = [python, "-m", "bnsurgeon", "verify", options.model, str(converted)]
        for world_size in world_sizes:
            command += ["-w", str(world_size)]
        end_to_end, done = timed_subprocess(command)
        print(f"  the command, end to end: {end_to_end:6.1f} s (exit {done.returncode}); it printed:", flush=True)
        for line in done.stderr.splitlines():
            print(f"    | {line}")

        in_process(options.model, str(converted), world_sizes, yardstick=not options.no_yardstick)


def in_process(model: str, converted: str, world_sizes: tuple[int, ...], *, yardstick: bool) -> None:
    import copy

    from bnsurgeon.checks.eval_check import first_runnable_shape
    from bnsurgeon.checks.verify import perturb_bn, rank_batch, rank_reference, verify_models
    from bnsurgeon.loading.sources import load_source

    started = time.monotonic()
    left, right = load_source(model), load_source(converted)
    shape = first_runnable_shape(left.model, tuple(left.input_shape))
    print(f"  in this process, input {shape}:")
    print(f"    loading both sides                   {time.monotonic() - started:6.1f} s", flush=True)

    started = time.monotonic()
    rank_reference(
        perturb_bn(copy.deepcopy(left.model)), perturb_bn(copy.deepcopy(right.model)), shape, rank_batch(world_sizes)
    )
    print(
        f"    one float64 reference (batch {rank_batch(world_sizes)})      {time.monotonic() - started:6.1f} s "
        "(computed once per variant now, once per N-rank check before)",
        flush=True,
    )

    totals = {}
    for label, share in [("shared (now)", True)] + ([("fresh per check (before)", False)] if yardstick else []):
        started = time.monotonic()
        result = verify_models(left.model, right.model, shape, world_sizes=world_sizes, share_work=share)
        totals[label] = time.monotonic() - started
        print(f"    checks, {label}: {totals[label]:6.1f} s, passed={result.passed}")
        for check in result.checks:
            print(f"      {check.name:32s} {check.seconds:6.1f} s")
    if yardstick:
        now, before = totals["shared (now)"], totals["fresh per check (before)"]
        print(f"  checks: {before:.1f} s before -> {now:.1f} s now (ratio before/now {before / now:.2f})")


if __name__ == "__main__":
    main()
