"""Models for ``torchrun -m bnsurgeon verify`` (importable by the torchrun ranks) and the rank function of the
measured-precision check run in a gloo world of the library's own harness."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

SHAPE = (2, 3, 16, 16)


def source() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def unsynced() -> nn.Module:
    """bnsurgeon's conversion with its second layer kept from synchronizing (plain BN on each rank's slice): eval
    and one process stay exact, N ranks do not."""
    model = converted()
    model[4]._sync_group = lambda: (None, 1)
    return model


def _on_rank_1_training(module: nn.Module) -> bool:
    return os.environ.get("RANK") == "1" and torch.is_grad_enabled() and any(m.training for m in module.modules())


def converted() -> nn.Module:
    import bnsurgeon

    return bnsurgeon.convert(source(), "sync").model


def killed_on_rank_1() -> nn.Module:
    """The conversion, SIGKILLed on torchrun's rank 1 as it runs its share (training, with gradients)."""
    model = converted()
    model.register_forward_pre_hook(
        lambda module, args: os.kill(os.getpid(), signal.SIGKILL) if _on_rank_1_training(module) else None
    )
    return model


def stopped_on_rank_1() -> nn.Module:
    """The conversion, stopped (SIGSTOP) on torchrun's rank 1 as it runs its share."""
    model = converted()
    model.register_forward_pre_hook(
        lambda module, args: os.kill(os.getpid(), signal.SIGSTOP) if _on_rank_1_training(module) else None
    )
    return model


def measured_rank(rank: int, world_size: int, cases: list[str]) -> dict:
    """check_torchrun_ranks per case ("PRECISION good|unsynced[ standin]") in this gloo world: rank 0's outcomes."""
    import torch.distributed as dist

    from bnsurgeon.checks.torchrun_ranks import TorchrunWorld, check_torchrun_ranks, this_process

    peers: list = [None] * world_size
    dist.all_gather_object(peers, this_process())
    world = TorchrunWorld(rank, world_size, torch.device("cpu"), "gloo", None, 60.0, peers)
    results = {}
    for case in cases:
        precision, kind, *device = case.split()
        model = unsynced() if kind == "unsynced" else converted()
        if device:  # the CUDA branch's glue on the strict CPU stand-ins of its kernels
            import _cuda_standin

            with _cuda_standin.installed():
                outcome = check_torchrun_ranks(world, source(), model, SHAPE, label=case, precision=precision)
        else:
            outcome = check_torchrun_ranks(world, source(), model, SHAPE, label=case, precision=precision)
        if outcome is not None:
            results[case] = {"passed": outcome.passed, "diff": outcome.max_abs_diff, "detail": outcome.detail}
    return results


def raises_on_rank_1() -> nn.Module:
    """A factory that fails on torchrun's rank 1 alone (a file missing on one node, say)."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("boom on rank 1")
    return converted()


def always_raises() -> nn.Module:
    raise RuntimeError("boom everywhere")


def hangs_on_rank_1() -> nn.Module:
    """The conversion, hanging on torchrun's rank 1 as it runs its share (a deadlock in the model or its data)."""
    import time

    model = converted()
    model.register_forward_pre_hook(lambda module, args: time.sleep(600) if _on_rank_1_training(module) else None)
    return model
