"""Recalibration cost on single timm models, one process, one thread: CPU time of bnsurgeon.recalibrate
(training-mode BN, and fast_normalization) against a no_grad eval forward over the same batches.

The three are interleaved in each repeat, so a repeat's ratios compare runs made under the same load
(this machine is shared: absolute times vary by tens of percent, ratios much less). Printed per
model: the median and the best (min) time of each, the median of the per-repeat ratios and the ratio
of the best times; then the geometric mean of the median ratios over the models.

    python scripts/bench_recalibrate_models.py [--repeats 5] [--models resnet18,efficientnet_b0]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import timm  # noqa: E402
import torch  # noqa: E402

import bnsurgeon  # noqa: E402

#: (name, what it stands for, timm keyword arguments, batch size, image side)
MODELS = [
    ("resnet18", "BatchNorm2d, wide layers", {}, 8, 128),
    ("resnet50", "BatchNorm2d, bottlenecks", {}, 8, 128),
    ("efficientnet_b0", "BatchNormAct2d, depthwise", {}, 8, 128),
    ("regnetx_002", "BatchNormAct2d, 44 thin layers", {}, 8, 128),
    ("cspdarknet53", "detector backbone (features_only)", {"features_only": True}, 4, 128),
]


def cpu_time(fn) -> float:
    started = time.process_time()
    fn()
    return time.process_time() - started


def bench(name, kwargs, batch, side, repeats, batches=4):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    data = [torch.randn(batch, 3, side, side) for _ in range(batches)]

    def forward():
        model.eval()
        with torch.no_grad():
            for x in data:
                model(x)

    def recalibrate():
        bnsurgeon.recalibrate(model, data)

    def fast():
        bnsurgeon.recalibrate(model, data, fast_normalization=True)

    forward(), recalibrate(), fast()  # warm-up
    times = {"forward": [], "recalibrate": [], "fast": []}
    for _ in range(repeats):
        for fn in (forward, recalibrate, fast):
            times[fn.__name__].append(cpu_time(fn))
    modules = sum(1 for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    return times, modules, f"{batches} x ({batch}, 3, {side}, {side})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(m[0] for m in MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = args.models.split(",")
    print(
        f"torch {torch.__version__}, timm {timm.__version__}, 1 thread, {args.repeats} repeats, CPU time (ms): "
        "median / best; ratio: median of the per-repeat ratios / ratio of the best times"
    )
    print()
    print("| model | kind | BN | batches | no_grad forward | recalibrate | ratio | fast_normalization | ratio |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    medians = {"recalibrate": [], "fast": []}
    for name, kind, kwargs, batch, side in MODELS:
        if name not in chosen:
            continue
        times, modules, shape = bench(name, kwargs, batch, side, args.repeats)
        cells = []
        for key in ("recalibrate", "fast"):
            ratios = [t / p for t, p in zip(times[key], times["forward"])]
            median = statistics.median(ratios)
            medians[key].append(median)
            cells.append(
                f"{statistics.median(times[key]) * 1e3:.0f} / {min(times[key]) * 1e3:.0f} | "
                f"{median:.2f}x / {min(times[key]) / min(times['forward']):.2f}x"
            )
        forward = times["forward"]
        print(
            f"| {name} | {kind} | {modules} | {shape} | {statistics.median(forward) * 1e3:.0f} / "
            f"{min(forward) * 1e3:.0f} | {cells[0]} | {cells[1]} |",
            flush=True,
        )
    geomean = {key: math.exp(sum(map(math.log, values)) / len(values)) for key, values in medians.items() if values}
    print(f"| geomean | | | | | | {geomean['recalibrate']:.2f}x | | {geomean['fast']:.2f}x |")


if __name__ == "__main__":
    main()
