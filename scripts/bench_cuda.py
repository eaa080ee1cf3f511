"""GPU yardstick for the sync layer: bnsurgeon vs torch.nn.SyncBatchNorm vs plain BN on the
same CUDA tensors, plus a CUDA-graph capture check. One process, an NCCL group of one,
and both sync paths forced (torch's own layer would fall back to plain BN at world size
1, so its autograd Function is called directly, as bnsurgeon's is).

    python scripts/bench_cuda.py [--iters 200] [--dtype float32|float16|bfloat16]

Prints per shape and layout: plain, torch sync, bnsurgeon sync (median ms of forward +
backward, CUDA events), bnsurgeon/torch and bnsurgeon/plain, then geometric means.
Goals (performance issue): bnsurgeon/torch < 1, bnsurgeon/plain <= 1.2. Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys

SHAPES = [(32, 64, 112, 112), (32, 256, 28, 28), (64, 512, 7, 7), (256, 1024)]


def _time_ms(fn, iters: int) -> float:
    import torch

    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_check(layer, x, grad) -> str:
    """Capture forward + backward of the forced sync path in a CUDA graph and replay it."""
    import torch

    from bnsurgeon.runtime.sync_function import SyncBatchNormFunction

    static_x = x.detach().clone().requires_grad_()

    def step():
        y = SyncBatchNormFunction.apply(static_x, layer.weight, layer.bias, layer.running_mean, layer.running_var,
                                        layer.eps, 0.1, None, 1, None)
        y.backward(grad)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    try:
        with torch.cuda.graph(graph):
            static_y = step()
    except Exception as error:  # report, do not hide: this is what the check is for
        return f"capture FAILED: {type(error).__name__}: {str(error).splitlines()[0]}"
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    eager = x.detach().clone().requires_grad_()
    expected = SyncBatchNormFunction.apply(eager, layer.weight, layer.bias, None, None, layer.eps, 0.1, None, 1, None)
    difference = (static_y - expected).abs().max().item()
    return f"captured and replayed; max |graph - eager| = {difference:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFunction

    from bench_common import geometric_mean
    from bnsurgeon.checks.multiproc import free_port
    from bnsurgeon.runtime.sync_function import SyncBatchNormFunction

    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA device (the CPU yardstick is scripts/bench_runtime.py)")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    dtype = getattr(torch, args.dtype)
    group = dist.group.WORLD
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, {args.dtype}, NCCL world of 1 "
          f"with the sync paths forced; median of {args.iters} forward+backward (ms)")
    print(f"{'shape':>20} {'layout':>14} {'plain':>8} {'torch sync':>11} {'bnsurgeon':>10} {'ours/torch':>11} "
          f"{'ours/plain':>11}")
    ratios_torch, ratios_plain = [], []
    for shape in SHAPES:
        layouts = ["contiguous"] + (["channels_last"] if len(shape) == 4 else [])
        for layout in layouts:
            x = torch.randn(shape, device=device, dtype=dtype)
            if layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            grad = torch.randn_like(x)
            layer = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(shape[1]).to(device).train()

            def plain():
                layer(x).backward(grad)

            def torch_sync():
                TorchSyncFunction.apply(x, layer.weight, layer.bias, layer.running_mean, layer.running_var,
                                        layer.eps, 0.1, group, 1).backward(grad)

            def ours():
                SyncBatchNormFunction.apply(x, layer.weight, layer.bias, layer.running_mean, layer.running_var,
                                            layer.eps, 0.1, group, 1, None).backward(grad)

            row = {name: _time_ms(fn, args.iters) for name, fn in (("plain", plain), ("torch", torch_sync),
                                                                   ("ours", ours))}
            ratios_torch.append(row["ours"] / row["torch"])
            ratios_plain.append(row["ours"] / row["plain"])
            print(f"{str(shape):>20} {layout:>14} {row['plain']:8.3f} {row['torch']:11.3f} {row['ours']:10.3f} "
                  f"{ratios_torch[-1]:11.3f} {ratios_plain[-1]:11.3f}")
    print(f"{'geometric mean':>20} {'':>14} {'':8} {'':11} {'':10} {geometric_mean(ratios_torch):11.3f} "
          f"{geometric_mean(ratios_plain):11.3f}")

    x = torch.randn(SHAPES[1], device=device, dtype=dtype)
    layer = nn.BatchNorm2d(SHAPES[1][1]).to(device).train()
    print(f"CUDA graph, {SHAPES[1]}: {_graph_check(layer, x, torch.randn_like(x))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
