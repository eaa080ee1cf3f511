"""Models, shards and rank functions for the recalibration tests (run inside spawned gloo ranks).

Rank r holds ``counts[r]`` batches (zero allowed) of images of its own size (``SIDES[r]``) and
batch sizes that vary by batch. Every tensor is a function of (rank, index) only, so the parent
process rebuilds exactly what each rank saw.
"""

from __future__ import annotations

import torch
from torch import nn

SIDES = (8, 11, 6)
CHANNELS = 3


def make_model(seed: int = 0) -> nn.Module:
    """Conv-BN-ReLU, dropout (must be off), conv + timm BatchNormAct2d, pool, linear + BatchNorm1d.
    Running statistics start away from anything the data gives (so a test sees them move)."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(CHANNELS, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(6, 5, 3, padding=1),
        BatchNormAct2d(5, act_layer=nn.ReLU, drop_layer=nn.Dropout),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
        nn.BatchNorm1d(4),
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "running_mean"):
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator))
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
                module.num_batches_tracked.fill_(17)
    return model


BN_PATHS = ("1", "5", "9")


def batch(rank: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + index)
    size = 2 + (index + rank) % 3
    return torch.randn(size, CHANNELS, SIDES[rank], SIDES[rank], generator=generator) * 2.0 + 3.0


def shard(rank: int, counts: tuple[int, ...]) -> list[torch.Tensor]:
    return [batch(rank, index) for index in range(counts[rank])]


def capture(model: nn.Module, paths=BN_PATHS) -> dict[str, list[torch.Tensor]]:
    """Forward pre-hooks that keep every input of the BN modules at ``paths``, in float64."""
    seen: dict[str, list[torch.Tensor]] = {path: [] for path in paths}

    def hook_for(path):
        def hook(module, args):
            seen[path].append(args[0].detach().to(torch.float64).clone())

        return hook

    for path in paths:
        model.get_submodule(path).register_forward_pre_hook(hook_for(path))
    return seen


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def rank_plain_and_sync(rank: int, world_size: int, counts: tuple[int, ...]) -> dict:
    """Recalibrate (a) the plain model under DDP and (b) the sync-converted model on this rank's shard."""
    from torch.nn.parallel import DistributedDataParallel

    import bnsurgeon

    torch.set_num_threads(1)
    out = {}
    plain = make_model()
    plain_seen = capture(plain)
    report = bnsurgeon.recalibrate(DistributedDataParallel(plain), shard(rank, counts))
    out["plain"] = {
        "buffers": buffers(plain),
        "statistics": report.statistics,
        "seen": plain_seen,
        "collectives": report.collectives,
        "batches": report.batches,
        "samples": report.samples,
        "rank_batches": report.rank_batches,
        "training": [m.training for m in plain.modules()],
    }
    synced = bnsurgeon.convert(make_model(), "sync").model
    sync_seen = capture(synced)
    report = bnsurgeon.recalibrate(synced, shard(rank, counts))
    out["sync"] = {
        "buffers": buffers(synced),
        "statistics": report.statistics,
        "seen": sync_seen,
        "collectives": report.collectives,
        "batches": report.batches,
        "samples": report.samples,
        "rank_batches": report.rank_batches,
    }
    return out


def global_batch_reference(counts: tuple[int, ...]) -> dict[str, list[torch.Tensor]]:
    """One process running the sync model's normalisation batches: at step t every BN normalises the
    union of the ranks' step-t batches (different image sizes, so layer by layer over the list of
    per-rank tensors, BN statistics over all of them). Returns every BN input, in float64."""
    with torch.no_grad():
        return _global_batch_reference(counts)


def _global_batch_reference(counts: tuple[int, ...]) -> dict[str, list[torch.Tensor]]:
    model = make_model().eval()
    seen: dict[str, list[torch.Tensor]] = {path: [] for path in BN_PATHS}
    for step in range(max(counts)):
        xs = [batch(rank, step) for rank in range(len(counts)) if step < counts[rank]]
        for name, layer in model.named_children():
            if name in BN_PATHS:
                seen[name] += [x.to(torch.float64) for x in xs]
                flat = torch.cat([x.to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1) for x in xs], 1)
                mean, var = flat.mean(1), flat.var(1, unbiased=False)
                shape = [1, -1] + [1] * (xs[0].dim() - 2)
                xs = [
                    (
                        (x.to(torch.float64) - mean.view(shape))
                        / (var.view(shape) + layer.eps).sqrt()
                        * layer.weight.view(shape)
                        + layer.bias.view(shape)
                    ).float()
                    for x in xs
                ]
                if hasattr(layer, "act"):
                    xs = [layer.act(x) for x in xs]
            else:
                xs = [layer(x) for x in xs]
    return seen


def rank_cli(rank: int, world_size: int, source: str, data: str, output: str, cwd: str) -> dict:
    """``bnsurgeon recalibrate`` as torchrun runs it: RANK/WORLD_SIZE set, each rank reads its shard of DATA."""
    import os
    import sys

    from bnsurgeon.pipeline import recalibrate_source

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    outcome = recalibrate_source(source, data, output, batch_size=3)
    return {
        "output": str(outcome.output) if outcome.output else None,
        "rank_batches": outcome.report.rank_batches,
        "samples": outcome.report.samples,
        "sha256": outcome.report.data["sha256"],
        "statistics": outcome.report.statistics,
    }
