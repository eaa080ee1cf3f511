"""GPU yardstick for the sync layer: bnsurgeon vs torch.nn.SyncBatchNorm vs plain BN on the same
CUDA tensors, per layer shape and for whole training steps. One process, an NCCL group of one,
and the sync paths forced (torch's own layer would fall back to plain BN at world size 1, so its
autograd Function is called directly, as bnsurgeon's is).

    python scripts/bench_cuda.py [--iters 200] [--dtype float32 bfloat16] [--skip-models]

Per shape and layout (contiguous, channels_last): plain, torch's Function, bnsurgeon (median ms of
forward + backward, CUDA events), bnsurgeon/torch and bnsurgeon/plain, the aten ops bnsurgeon
dispatches per forward + backward (a dispatch mode, each collective one op) and its collectives;
then geometric means. Goal: bnsurgeon/torch <= 0.8 on every shape.

Model level (resnet50, efficientnet_b0; batch 64, 224 px, bf16 autocast, channels_last, SGD):
plain BN; sync eager; sync captured in a CUDA graph (the whole step, replayed; replay compared
with eager, and the running statistics those of the replayed steps only); sync compiled
(inductor). Goal: graph step <= 1.2x the plain step. Needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys

SHAPES = [(32, 64, 112, 112), (32, 256, 28, 28), (64, 512, 7, 7), (50, 2048, 7, 7), (256, 1024)]


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


def _dispatch_count(fn) -> tuple[int, int]:
    """(aten ops, collectives) one call of ``fn`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        fn()
    collectives = sum(n for name, n in counter.ops.items() if name.startswith(("c10d", "_c10d")))
    return sum(counter.ops.values()), collectives


def _layer_table(args, dtype, group) -> None:
    import torch
    from bench_common import geometric_mean
    from torch import nn
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFunction

    from bnsurgeon.runtime.identity import LayerIdentity
    from bnsurgeon.runtime.sync_function import SyncBatchNormFunction

    device = torch.device("cuda", torch.cuda.current_device())
    print(f"\nper layer, {dtype}: median of {args.iters} forward+backward (ms)")
    print(
        f"{'shape':>20} {'layout':>14} {'plain':>8} {'torch sync':>11} {'bnsurgeon':>10} {'ours/torch':>11} "
        f"{'ours/plain':>11} {'ops':>5} {'colls':>6}"
    )
    ratios_torch, ratios_plain = [], []
    for shape in SHAPES:
        for layout in ["contiguous"] + (["channels_last"] if len(shape) == 4 else []):
            x = torch.randn(shape, device=device, dtype=dtype)
            if layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            grad = torch.randn_like(x)
            layer = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(shape[1]).to(device).train()
            identity = LayerIdentity(f"bench{shape}{layout}")

            def plain():
                layer(x).backward(grad)

            def torch_sync():
                TorchSyncFunction.apply(
                    x, layer.weight, layer.bias, layer.running_mean, layer.running_var, layer.eps, 0.1, group, 1
                ).backward(grad)

            def ours():
                SyncBatchNormFunction.apply(
                    x,
                    layer.weight,
                    layer.bias,
                    layer.running_mean,
                    layer.running_var,
                    layer.eps,
                    0.1,
                    group,
                    1,
                    identity,
                    False,
                ).backward(grad)

            row = {
                name: _time_ms(fn, args.iters) for name, fn in (("plain", plain), ("torch", torch_sync), ("ours", ours))
            }
            x.grad = layer.weight.grad = layer.bias.grad = None
            ops, collectives = _dispatch_count(ours)
            ratios_torch.append(row["ours"] / row["torch"])
            ratios_plain.append(row["ours"] / row["plain"])
            print(
                f"{str(shape):>20} {layout:>14} {row['plain']:8.3f} {row['torch']:11.3f} {row['ours']:10.3f} "
                f"{ratios_torch[-1]:11.3f} {ratios_plain[-1]:11.3f} {ops:5d} {collectives:6d}"
            )
    print(
        f"{'geometric mean':>20} {'':>14} {'':8} {'':11} {'':10} {geometric_mean(ratios_torch):11.3f} "
        f"{geometric_mean(ratios_plain):11.3f}"
    )


def _forced_sync(model, group):
    """Every sync layer of ``model`` takes the synchronized path at this world of one."""
    from bnsurgeon.runtime.layers import SyncBatchNorm

    for module in model.modules():
        if isinstance(module, SyncBatchNorm):
            module._sync_group = lambda group=group: (group, 1)
            module._sync_forward = _forced_forward.__get__(module)
    return model


def _forced_forward(self, x, running_mean, running_var, factor):
    from bnsurgeon.runtime.recompute import may_be_recomputed
    from bnsurgeon.runtime.sync_function import SyncBatchNormFunction

    group, world_size = self._sync_group()
    return SyncBatchNormFunction.apply(
        x,
        self.weight,
        self.bias,
        running_mean,
        running_var,
        self.eps,
        factor,
        group,
        world_size,
        self._identity,
        may_be_recomputed(),
    )


def _model_steps(args, group) -> None:
    import timm
    import torch

    import bnsurgeon

    device = torch.device("cuda", torch.cuda.current_device())
    print("\nper training step, batch 64, 224 px, bf16 autocast, channels_last, SGD (ms, median)")
    print(
        f"{'model':>16} {'plain':>8} {'sync':>8} {'graph':>8} {'compiled':>9} {'sync/plain':>11} "
        f"{'graph/plain':>12} {'replay=eager':>13}"
    )
    for name in ("resnet50", "efficientnet_b0"):

        def build(sync: bool):
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False).to(device).to(memory_format=torch.channels_last)
            if sync:
                model = _forced_sync(bnsurgeon.convert(model, "sync").model, group)
            return model.train()

        x = torch.randn(64, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
        target = torch.randint(0, 1000, (64,), device=device)

        def stepper(model):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # stateless: a graph replay restarts cleanly

            def step():
                optimizer.zero_grad(set_to_none=False)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(x), target)
                loss.backward()
                optimizer.step()
                return loss

            return step

        times = {}
        times["plain"] = _time_ms(stepper(build(False)), args.model_iters)
        times["sync"] = _time_ms(stepper(build(True)), args.model_iters)
        graph_ms, agrees = _graph_step(build, stepper, args.model_iters)
        times["graph"] = graph_ms
        try:
            compiled = torch.compile(build(True), backend="inductor")
            times["compiled"] = _time_ms(stepper(compiled), args.model_iters)
        except Exception as error:  # report, do not hide
            print(f"compile failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            times["compiled"] = float("nan")
        print(
            f"{name:>16} {times['plain']:8.2f} {times['sync']:8.2f} {times['graph']:8.2f} {times['compiled']:9.2f} "
            f"{times['sync'] / times['plain']:11.3f} {times['graph'] / times['plain']:12.3f} {agrees:>13}"
        )


def _graph_step(build, stepper, iters: int) -> tuple[float, str]:
    """The whole step captured once and replayed: its time, and whether replay equals eager
    (loss, and running statistics that count the replayed steps only)."""
    import torch

    model, reference = build(True), build(True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    step = stepper(model)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: allocations, lazy state, the headers' first fills
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    with torch.no_grad():  # the warm-up steps must not leak into the statistics or the weights
        for key, value in model.state_dict().items():
            value.copy_(saved[key])
    replays = 2
    for _ in range(replays):
        graph.replay()
    eager_step = stepper(reference)
    for _ in range(replays):
        eager_loss = eager_step()
    torch.cuda.synchronize()
    stats_equal = all(
        torch.allclose(model.state_dict()[k].float(), reference.state_dict()[k].float(), rtol=1e-3, atol=1e-3)
        for k in model.state_dict()
        if "running" in k or "num_batches" in k
    )
    agrees = f"{'yes' if stats_equal else 'NO'} (loss {abs(static_loss.item() - eager_loss.item()):.1e})"
    return _time_ms(graph.replay, iters), agrees


def _layer_graph_check(group) -> str:
    """Forward + backward of one forced sync layer captured in a CUDA graph and replayed."""
    import torch
    from torch import nn

    from bnsurgeon.runtime.identity import LayerIdentity
    from bnsurgeon.runtime.sync_function import SyncBatchNormFunction

    device = torch.device("cuda", torch.cuda.current_device())
    layer = nn.BatchNorm2d(256).to(device).train()
    x = torch.randn(32, 256, 28, 28, device=device)
    grad = torch.randn_like(x)
    static_x = x.detach().clone().requires_grad_()
    identity = LayerIdentity("graph check")

    def step():
        y = SyncBatchNormFunction.apply(
            static_x,
            layer.weight,
            layer.bias,
            layer.running_mean,
            layer.running_var,
            layer.eps,
            0.1,
            group,
            1,
            identity,
            False,
        )
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
    with torch.no_grad():
        static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    eager = x.detach().clone().requires_grad_()
    expected = SyncBatchNormFunction.apply(
        eager, layer.weight, layer.bias, None, None, layer.eps, 0.1, group, 1, None, False
    )
    difference = (static_y - expected).abs().max().item()
    return f"captured and replayed; max |graph - eager| = {difference:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--model-iters", type=int, default=30)
    parser.add_argument(
        "--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "float16", "bfloat16"]
    )
    parser.add_argument("--skip-models", action="store_true")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from bnsurgeon.checks.multiproc import free_port

    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA device (the CPU yardstick is scripts/bench_runtime.py)")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=device
    )
    group = dist.group.WORLD
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, NCCL world of 1 with the sync paths forced"
    )
    for name in args.dtype:
        _layer_table(args, getattr(torch, name), group)
    print(f"\nCUDA graph, one layer (32, 256, 28, 28): {_layer_graph_check(group)}")
    if not args.skip_models:
        _model_steps(args, group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
