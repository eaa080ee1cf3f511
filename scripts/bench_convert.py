"""Wall time and peak RSS of `bnsurgeon convert CHECKPOINT -o OUT` vs the naive script a user
would write, both as whole processes in the same run; `bnsurgeon.load` of the output (peak RSS
over the file's size); and `bnsurgeon inspect` vs `import timm`.

    python scripts/bench_convert.py [--models regnety_320] [--repeats 2]

The naive script: timm.create_model + torch.load + load_state_dict +
timm.layers.convert_sync_batchnorm + torch.save. bnsurgeon's run includes its pre-write
eval check, as users run it. Peak RSS is each process's own (getrusage of the child);
"above baseline" subtracts a process that only imports torch and timm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

NAIVE = """
import sys, torch, timm
from timm.layers import convert_sync_batchnorm
arch, ckpt, out = sys.argv[1:4]
model = timm.create_model(arch, pretrained=False)
model.load_state_dict(torch.load(ckpt, map_location="cpu"))
model = convert_sync_batchnorm(model)
torch.save(model.state_dict(), out)
"""

LOAD = """
import sys, bnsurgeon
bnsurgeon.load(sys.argv[1])  # a model owning its memory: the whole checkpoint read, no memory map
"""

MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
wall = time.perf_counter() - start
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code)
"""


def measure(command: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one whole process."""
    done = subprocess.run([PYTHON, "-c", MEASURE, *command], capture_output=True, text=True, check=True)
    wall, rss, code = done.stdout.split()
    if int(code) != 0:
        raise RuntimeError(f"{command} exited {code}")
    return float(wall), int(rss)


def make_checkpoint(arch: str, directory: Path) -> Path:
    path = directory / f"{arch}.pth"
    code = (
        f"import torch, timm; torch.manual_seed(0); "
        f"torch.save(timm.create_model({arch!r}, pretrained=False).state_dict(), {str(path)!r})"
    )
    subprocess.run([PYTHON, "-c", code], check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["regnety_320"])
    parser.add_argument("--inspect-model", default="regnety_320", help="model for the inspect vs `import timm` timing")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    bnsurgeon = str(Path(PYTHON).with_name("bnsurgeon"))
    baseline_wall, baseline_rss = measure([PYTHON, "-c", "import torch, timm"])
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
        scratch = Path(scratch)
        for arch in args.models:
            checkpoint = make_checkpoint(arch, scratch)
            size = checkpoint.stat().st_size
            ours, naive, loads = [], [], []
            for repeat in range(args.repeats):  # interleaved
                out = scratch / f"out{repeat}.safetensors"
                ours.append(
                    measure([bnsurgeon, "convert", str(checkpoint), "-m", arch, "-o", str(out), "--force", "-q"])
                )
                naive.append(measure([PYTHON, "-c", NAIVE, arch, str(checkpoint), str(scratch / f"naive{repeat}.pth")]))
                loads.append(measure([PYTHON, "-c", LOAD, str(out)]))
            ours_wall = statistics.median(w for w, _ in ours)
            naive_wall = statistics.median(w for w, _ in naive)
            ours_rss = max(r for _, r in ours) - baseline_rss
            naive_rss = max(r for _, r in naive) - baseline_rss
            load_rss = max(r for _, r in loads) - baseline_rss
            rows.append(
                {
                    "model": arch,
                    "checkpoint_mb": size / 2**20,
                    "ours_s": ours_wall,
                    "naive_s": naive_wall,
                    "time_ratio": ours_wall / naive_wall,
                    "ours_rss_over_ckpt": ours_rss / size,
                    "naive_rss_over_ckpt": naive_rss / size,
                    "load_s": statistics.median(w for w, _ in loads),
                    "load_rss_over_ckpt": load_rss / out.stat().st_size,
                }
            )
        inspect_wall = statistics.median(
            measure([bnsurgeon, "inspect", args.inspect_model, "-q"])[0] for _ in range(args.repeats)
        )
        import_wall = statistics.median(measure([PYTHON, "-c", "import timm"])[0] for _ in range(args.repeats))

    print(f"baseline (python -c 'import torch, timm'): {baseline_wall:.2f} s, {baseline_rss / 2**20:.0f} MiB")
    print(
        f"{'model':>14} {'ckpt MiB':>9} {'ours s':>8} {'naive s':>8} {'ours/naive':>11} "
        f"{'ours RSS/ckpt':>14} {'naive RSS/ckpt':>15} {'load s':>7} {'load RSS/file':>14}"
    )
    for r in rows:
        print(
            f"{r['model']:>14} {r['checkpoint_mb']:9.0f} {r['ours_s']:8.2f} {r['naive_s']:8.2f} {r['time_ratio']:11.2f} "
            f"{r['ours_rss_over_ckpt']:14.2f} {r['naive_rss_over_ckpt']:15.2f} {r['load_s']:7.2f} "
            f"{r['load_rss_over_ckpt']:14.2f}"
        )
    print(
        f"inspect {args.inspect_model}: {inspect_wall:.2f} s vs `import timm` {import_wall:.2f} s "
        f"-> {inspect_wall / import_wall:.2f}x"
    )
    print(json.dumps(rows))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
