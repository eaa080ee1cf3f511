"""Recalibration cost on single timm models, one process, one thread: CPU time of bnsurgeon.recalibrate
(training-mode BN, and fast_normalization) against a no_grad eval forward over the same 4 batches (best of 3).

    python scripts/bench_recalibrate_models.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import time  # noqa: E402

import timm  # noqa: E402
import torch  # noqa: E402

import bnsurgeon  # noqa: E402

torch.set_num_threads(1)
print("| model | batches | no_grad forward CPU (ms) | recalibrate (ms) | ratio | fast_normalization (ms) | ratio |")
print("|---|---|---:|---:|---:|---:|---:|")
for name, side, bs in [("resnet18", 128, 8), ("resnet50", 128, 8), ("efficientnet_b0", 128, 8)]:
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, num_classes=10)
    data = [torch.randn(bs, 3, side, side) for _ in range(4)]
    def plain():
        m.eval()
        with torch.no_grad():
            for b in data: m(b)
    def recal(): bnsurgeon.recalibrate(m, data)
    def fast(): bnsurgeon.recalibrate(m, data, fast_normalization=True)
    recal(); plain(); fast()
    ts = {}
    for _ in range(3):
        for f in (plain, recal, fast):
            t = time.process_time(); f(); ts.setdefault(f.__name__, []).append(time.process_time() - t)
    p, r, q = min(ts['plain']), min(ts['recal']), min(ts['fast'])
    print(f"| {name} | 4 x ({bs}, 3, {side}, {side}) | {p*1e3:.0f} | {r*1e3:.0f} | {r/p:.2f}x | {q*1e3:.0f} | {q/p:.2f}x |", flush=True)
