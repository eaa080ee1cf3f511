"""Precise BN on 2 gloo ranks: how far each tool's statistics are from the exact ones, and what it costs.

One run, one model (timm resnet18, seeded, no pretrained weights), one data set split into
non-identical shards the way detection loaders split them: rank 0 holds 6 batches of 2
images at 40x40 drawn from N(0, 1), rank 1 holds 3 batches of 3 images at 56x56 drawn from
N(0.5, 1.5^2). Every BN normalises its own rank's batch (a plain model under DDP).

The exact statistics: every BN input of every batch on every rank, captured with forward
pre-hooks in float64 and concatenated in the parent; mean and variance computed directly.
Each tool then writes its statistics (rank 0's copy: the one a training script saves):

- torch ``torch.optim.swa_utils.update_bn`` on each rank (no cross-rank step);
- the same, then timm ``timm.utils.distribute_bn(reduce=True)`` (``--dist-bn reduce``);
- fvcore ``fvcore.nn.precise_bn.update_bn_stats`` on each rank (if installed: the ``bench`` extra);
- ``bnsurgeon.recalibrate`` (one all_gather for the pass).

Errors: running_mean as max |error| / std, running_var as max relative error, over every BN
channel; eval output as max |y - y_exact| / max |y_exact| on a fixed eval batch, where
y_exact is the model holding the exact statistics. Time: ``bnsurgeon.recalibrate`` against a
plain ``no_grad`` eval forward over the same batches, per rank (one thread each), best of
``--repeats``, interleaved.

    python scripts/bench_recalibrate.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHARDS = {
    0: dict(batches=6, size=2, side=40, mean=0.0, std=1.0),
    1: dict(batches=3, size=3, side=56, mean=0.5, std=1.5),
}


def make_model():
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=10)


def shard(rank: int) -> list[torch.Tensor]:
    spec = SHARDS[rank]
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randn(spec["size"], 3, spec["side"], spec["side"], generator=generator) * spec["std"] + spec["mean"]
        for _ in range(spec["batches"])
    ]


def bn_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}


def stats_of(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        name: (m.running_mean.detach().clone(), m.running_var.detach().clone()) for name, m in bn_modules(model).items()
    }


def capture(model, data) -> dict[str, list[torch.Tensor]]:
    """Every BN input (float64) with BN normalising its batch and everything else in eval."""
    seen = {name: [] for name in bn_modules(model)}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(args[0].double().clone()))
        for name, m in bn_modules(model).items()
    ]
    model.eval()
    for m in bn_modules(model).values():
        m.training = True
    with torch.no_grad():
        for x in data:
            model(x)
    for handle in handles:
        handle.remove()
    model.eval()
    return seen


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): the CPU time ignores other processes' load and the
    wait in a collective (gloo blocks on its socket), the wall time includes both."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def rank_main(rank: int, world: int, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.optim.swa_utils import update_bn

    import bnsurgeon

    torch.set_num_threads(1)
    data = shard(rank)
    out: dict = {"seen": capture(make_model(), data)}
    # torch update_bn, per rank
    model = make_model()
    update_bn(data, model)
    out["torch update_bn"] = (stats_of(model), 0)
    # + timm distribute_bn(reduce): all_reduce of every running buffer, divided by the world size
    from timm.utils import distribute_bn

    calls = {"n": 0}
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        distribute_bn(model, world, reduce=True)
    finally:
        dist.all_reduce = original
    out["update_bn + timm distribute_bn(reduce)"] = (stats_of(model), calls["n"])
    try:
        from fvcore.nn.precise_bn import update_bn_stats

        model = make_model().eval()
        for m in bn_modules(model).values():
            m.training = True
        update_bn_stats(model, data, num_iters=len(data))
        out["fvcore update_bn_stats"] = (stats_of(model), 0)
    except ImportError:
        out["fvcore update_bn_stats"] = None
    model = make_model()
    report = bnsurgeon.recalibrate(model, data)
    out["bnsurgeon recalibrate"] = (stats_of(model), report.collectives)
    model = make_model()
    report = bnsurgeon.recalibrate(model, data, fast_normalization=True)
    out["bnsurgeon recalibrate(fast_normalization=True)"] = (stats_of(model), report.collectives)

    # time: recalibrate vs a plain no_grad eval forward over the same batches (interleaved, best of repeats)
    model = make_model()

    def forward():
        model.eval()
        with torch.no_grad():
            for x in data:
                model(x)

    def recalibrate():
        bnsurgeon.recalibrate(model, data)

    def recalibrate_fast():
        bnsurgeon.recalibrate(model, data, fast_normalization=True)

    forward(), recalibrate(), recalibrate_fast()  # warm-up (and the rule registry's imports)
    plain, recal, fast = [], [], []
    for _ in range(repeats):
        dist.barrier()
        plain.append(timed(forward))
        dist.barrier()
        recal.append(timed(recalibrate))
        dist.barrier()
        fast.append(timed(recalibrate_fast))
    out["time"] = (min(t[0] for t in plain), min(t[0] for t in recal), min(t[0] for t in fast))
    out["cpu"] = (min(t[1] for t in plain), min(t[1] for t in recal), min(t[1] for t in fast))
    return out


def exact_statistics(results) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    exact = {}
    for name in results[0]["seen"]:
        acts = [a for result in results for a in result["seen"][name]]
        flat = torch.cat([a.transpose(0, 1).reshape(a.shape[1], -1) for a in acts], 1)
        exact[name] = (flat.mean(1), flat.var(1, unbiased=False), flat.shape[1])
    return exact


def errors(stats, exact, eval_batch) -> tuple[float, float, float]:
    mean_err = var_err = 0.0
    for name, (mean, var, n) in exact.items():
        running_mean, running_var = stats[name]
        unbiased = var * n / (n - 1)
        mean_err = max(mean_err, float(((running_mean.double() - mean).abs() / var.sqrt()).max()))
        var_err = max(var_err, float(((running_var.double() - unbiased).abs() / unbiased).max()))
    return mean_err, var_err, output_error(stats, exact, eval_batch)


def with_stats(stats):
    model = make_model().eval()
    modules = bn_modules(model)
    with torch.no_grad():
        for name, (mean, var) in stats.items():
            modules[name].running_mean.copy_(mean)
            modules[name].running_var.copy_(var)
    return model


def output_error(stats, exact, eval_batch) -> float:
    exact_stats = {name: (mean.float(), (var * n / (n - 1)).float()) for name, (mean, var, n) in exact.items()}
    with torch.no_grad():
        reference = with_stats(exact_stats)(eval_batch)
        got = with_stats(stats)(eval_batch)
    return float((got - reference).abs().max() / reference.abs().max())


def main() -> None:
    from bnsurgeon.checks.multiproc import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run_world(2, rank_main, args.repeats, timeout=900)
    exact = exact_statistics(results)
    generator = torch.Generator().manual_seed(7)
    eval_batch = torch.cat(
        [torch.randn(4, 3, 48, 48, generator=generator), torch.randn(4, 3, 48, 48, generator=generator) * 1.5 + 0.5]
    )
    print(
        f"resnet18, 2 gloo ranks: rank 0 {SHARDS[0]}, rank 1 {SHARDS[1]}; "
        f"{len(exact)} BN modules, {sum(e[2] for e in exact.values()):,} elements per channel in all"
    )
    print()
    print(
        "| method | collectives per pass | running_mean max err / std | running_var max rel err | eval output max rel err |"
    )
    print("|---|---:|---:|---:|---:|")
    for method in (
        "torch update_bn",
        "update_bn + timm distribute_bn(reduce)",
        "fvcore update_bn_stats",
        "bnsurgeon recalibrate",
        "bnsurgeon recalibrate(fast_normalization=True)",
    ):
        if results[0][method] is None:
            print(f"| {method} | not installed (pip install .[bench]) | | | |")
            continue
        stats, collectives = results[0][method]
        mean_err, var_err, out_err = errors(stats, exact, eval_batch)
        agree = all(torch.equal(results[1][method][0][k][0], stats[k][0]) for k in stats)
        print(
            f"| {method}{'' if agree else ' (rank 0; rank 1 differs)'} | {collectives} | {mean_err:.2e} | "
            f"{var_err:.2e} | {out_err:.2e} |"
        )
    print()
    print(
        "| rank | batches | time | no_grad forward (ms) | recalibrate (ms) | ratio | fast_normalization (ms) | ratio |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for rank, result in enumerate(results):
        for kind in ("cpu", "time"):
            plain, recal, fast = result[kind]
            print(
                f"| {rank} | {SHARDS[rank]['batches']} | {'CPU' if kind == 'cpu' else 'wall'} | {plain * 1e3:.1f} | "
                f"{recal * 1e3:.1f} | {recal / plain:.2f}x | {fast * 1e3:.1f} | {fast / plain:.2f}x |"
            )
    plain, recal, fast = (max(result["time"][i] for result in results) for i in range(3))
    print(
        f"| the job (slowest rank) | {sum(s['batches'] for s in SHARDS.values())} | wall | {plain * 1e3:.1f} | "
        f"{recal * 1e3:.1f} | {recal / plain:.2f}x | {fast * 1e3:.1f} | {fast / plain:.2f}x |"
    )
    print()
    print(
        "(wall: best of the repeats; a rank's recalibrate wall time includes waiting in the one all_gather for the "
        "slower rank. CPU: this rank's own CPU time, insensitive to other load on the machine)"
    )


if __name__ == "__main__":
    main()
