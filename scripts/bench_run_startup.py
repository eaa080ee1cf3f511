"""What ``bnsurgeon run`` adds to a script's first conversion, against torch's own converter in the same run.

A script that imports only torch builds a small model and converts it with
``nn.SyncBatchNorm.convert_sync_batchnorm``, then runs one forward; it times that (the first call pays every
import bnsurgeon's conversion makes) and counts the modules loaded. The script runs alternately as
``python SCRIPT`` (torch's converter) and ``python -m bnsurgeon run SCRIPT`` (bnsurgeon's), ``--repeat`` times
each, and the medians are compared: the difference in seconds and modules, and the ratio.

usage: python scripts/bench_run_startup.py [--repeat 5]
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

SCRIPT = """
import json, sys, time
import torch
from torch import nn

model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8))
start = time.perf_counter()
model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
model(torch.randn(2, 3, 8, 8))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "modules": len(sys.modules), "layer": type(model[1]).__module__}))
"""


def measure(command: list[str], cwd: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "convert.py"
        script.write_text(SCRIPT)
        runs: dict[str, list[dict]] = {"python": [], "bnsurgeon run": []}
        for _ in range(args.repeat):  # alternated, so that a busy moment of the machine hits both
            runs["python"].append(measure([sys.executable, str(script)], work))
            runs["bnsurgeon run"].append(
                measure([sys.executable, "-m", "bnsurgeon", "run", "--quiet", str(script)], work)
            )
    assert all(run["layer"].startswith("torch.") for run in runs["python"])
    assert all(run["layer"].startswith("bnsurgeon.") for run in runs["bnsurgeon run"]), "bnsurgeon's layer expected"
    seconds = {name: statistics.median(run["seconds"] for run in values) for name, values in runs.items()}
    modules = {name: statistics.median(run["modules"] for run in values) for name, values in runs.items()}
    for name in runs:
        print(f"{name:>14}: first convert + forward {seconds[name]:.3f} s, {modules[name]:.0f} modules loaded")
    extra = seconds["bnsurgeon run"] - seconds["python"]
    print(
        f"bnsurgeon run adds {extra:.3f} s ({seconds['bnsurgeon run'] / seconds['python']:.1f}x torch's converter) "
        f"and {modules['bnsurgeon run'] - modules['python']:.0f} modules (median of {args.repeat})"
    )


if __name__ == "__main__":
    main()
