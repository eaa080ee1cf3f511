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


def stale_statistics_on_rank_1() -> nn.Module:
    """The conversion, one running_var of its second layer not what the other ranks hold on torchrun's rank 1 alone
    (a stale copy on another node, read by code, so that no file digest tells it): its outputs and gradients stay
    exact, its running statistics do not."""
    model = converted()
    if os.environ.get("RANK") == "1":
        with torch.no_grad():
            model[4].running_var[0] *= 1.5
    return model


def killed_on_rank_0_alone() -> nn.Module:
    """The conversion, SIGKILLed on torchrun's rank 0 as it runs the one-process checks alone (the process group
    closed), while the other ranks wait for its verdict."""
    import torch.distributed as dist

    model = converted()
    model.register_forward_pre_hook(
        lambda module, args: (
            os.kill(os.getpid(), signal.SIGKILL)
            if os.environ.get("RANK") == "0" and not dist.is_initialized()
            else None
        )
    )
    return model


def save_stale_copy(good: str, stale: str) -> None:
    """``stale``: the checkpoint ``good`` with one running_var changed (what a second node's old copy holds)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(good, "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    tensors["4.running_var"] = tensors["4.running_var"] * 1.5
    save_file(tensors, stale, metadata=metadata)


def _main() -> None:
    """``torchrun -m tvmodels verify ...``: bnsurgeon's command, the rank's own exit code left in its working
    directory as ``exit-RANK`` (torchrun reports only its own status)."""
    from pathlib import Path

    from bnsurgeon.cli.commands import main

    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        Path(f"exit-{os.environ['RANK']}").write_text(str(code))
        raise


def leave_rounds(rank: int, world_size: int, directory: str, rounds: int) -> None:
    """A rank of ``leave_in_rounds``: each round a process group (a file store, no port), the gather every N-rank
    check ends with, then ``leave_torchrun_world``; a round that hangs ends the rank (exit 1) with its stack."""
    import faulthandler
    from datetime import timedelta

    import torch.distributed as dist

    from bnsurgeon.checks.torchrun_ranks import TorchrunWorld, leave_torchrun_world, this_process

    torch.set_num_threads(1)
    for round_ in range(rounds):
        faulthandler.dump_traceback_later(30, exit=True)
        store = f"file://{directory}/round-{round_}"
        dist.init_process_group(
            "gloo", init_method=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        world = TorchrunWorld(rank, world_size, torch.device("cpu"), "gloo", None, 60.0, [this_process()] * world_size)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object({"outputs": torch.randn(64)}, gathered, dst=0)
        leave_torchrun_world(world)
        faulthandler.cancel_dump_traceback_later()


def leave_in_rounds(directory: str, rounds: int) -> None:
    """Two spawned ranks (fresh interpreters, as torchrun starts them) leave ``rounds`` groups in turn (torch 2.4's
    gloo deadlocked in the teardown about once in 40 when the barrier's work was dropped first)."""
    import torch.multiprocessing as mp

    mp.spawn(leave_rounds, args=(2, directory, rounds), nprocs=2)


if __name__ == "__main__":
    _main()
