"""Where recalibrate's time goes on one timm model: CPU time of the whole pass, of torch's batch_norm
calls inside it, and of bnsurgeon's own per-batch statistics (batch_sums), for training-mode BN and
fast_normalization, against a no_grad eval forward (and its own batch_norm calls). One thread.

    python scripts/recalibrate_where_time_goes.py efficientnet_b0 [--batches 4] [--repeats 2]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import time  # noqa: E402

import timm  # noqa: E402
import timm.layers.norm_act as norm_act  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bnsurgeon  # noqa: E402
import bnsurgeon.calibration.recalibrate as recalibration  # noqa: E402

spent = {"statistics": 0.0, "batch_norm": 0.0}


def timed(key, fn):
    def wrapper(*args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.thread_time() - started

    return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recalibration.batch_sums = timed("statistics", recalibration.batch_sums)
    F.batch_norm = norm_act.F.batch_norm = timed("batch_norm", F.batch_norm)
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, num_classes=10)
    data = [torch.randn(8, 3, 128, 128) for _ in range(args.batches)]

    def forward():
        model.eval()
        with torch.no_grad():
            for x in data:
                model(x)

    runs = [
        ("no_grad forward", forward),
        ("recalibrate", lambda: bnsurgeon.recalibrate(model, data)),
        ("fast_normalization", lambda: bnsurgeon.recalibrate(model, data, fast_normalization=True)),
    ]
    for _, fn in runs:
        fn()
    for _ in range(args.repeats):
        for name, fn in runs:
            spent.update(statistics=0.0, batch_norm=0.0)
            started = time.thread_time()
            fn()
            total = time.thread_time() - started
            print(
                f"{args.model} {name}: {total * 1e3:.0f} ms, batch_norm {spent['batch_norm'] * 1e3:.0f} ms, "
                f"bnsurgeon statistics {spent['statistics'] * 1e3:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
