"""What recalibrate's per-batch statistics can cost on CPU, per BN input shape, as a ratio to the eval
batch_norm call that a no_grad forward makes anyway (one thread, float32, best of 5 x 10 calls):

- training-mode batch_norm (what the default path runs: activations bit for bit those of training mode);
- one read of the input (``x.sum`` over N, H, W): the least any statistics can cost;
- bnsurgeon's eager statistics (``batch_sums``: mean, d = x - mean written out, sum d, sum d^2);
- the same (sum d, sum d^2) compiled by inductor into one loop (``torch.compile(dynamic=True)``), with its
  compile time (skipped with --no-compile).

    python scripts/recalibrate_kernel_floor.py [--no-compile]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bnsurgeon.calibration.statistics import batch_sums  # noqa: E402

#: large BN inputs of efficientnet_b0 and resnet at 8 x 3 x 128 x 128 and 256 x 256
SHAPES = [(8, 64, 64, 64), (8, 96, 64, 64), (8, 144, 32, 32), (8, 240, 16, 16), (8, 1152, 4, 4)]


def best_ms(fn, calls: int = 10) -> float:
    fn()
    times = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - started) / calls)
    return min(times) * 1e3


def shifted_sums(x: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x - shift.view(1, -1, 1, 1)
    return d.sum((0, 2, 3)), (d * d).sum((0, 2, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the inductor-compiled reduction")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    compiled = None
    if not args.no_compile:
        compiled = torch.compile(shifted_sums, dynamic=True, fullgraph=True)
        x = torch.randn(SHAPES[0]) * 2 + 3
        started = time.monotonic()
        compiled(x, x.mean((0, 2, 3)))
        print(f"inductor: first compile {time.monotonic() - started:.1f} s")
    print(f"torch {torch.__version__}, 1 thread; ms per call, and the ratio to eval batch_norm")
    print("| shape | eval BN (ms) | training BN | one read | bnsurgeon statistics | compiled one loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        x = torch.randn(shape) * 2 + 3
        channels = shape[1]
        mean, ones = x.mean((0, 2, 3)), torch.ones(channels)
        evaluated = best_ms(lambda: F.batch_norm(x, mean, ones, None, None, False, 0.1, 1e-5))
        cells = [
            best_ms(lambda: F.batch_norm(x, mean.clone(), ones.clone(), None, None, True, 1.0, 1e-5)),
            best_ms(lambda: x.sum((0, 2, 3))),
            best_ms(lambda: batch_sums(x)),
        ]
        if compiled is not None:
            compiled(x, mean)  # a new shape may compile again: not timed
            cells.append(best_ms(lambda: compiled(x, mean)))
        text = " | ".join(f"{c:.2f} ({c / evaluated:.1f}x)" for c in cells)
        print(f"| {shape} | {evaluated:.2f} | {text}{' | -' if compiled is None else ''} |", flush=True)


if __name__ == "__main__":
    main()
