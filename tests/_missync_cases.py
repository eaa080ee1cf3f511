"""Workers for the mis-sync, timeout and API tests on gloo ranks (importable by spawned ranks).

``scenarios_rank`` runs every scenario in one world (a spawn costs seconds), each in its
own try, and returns what each produced on this rank. Ranks that met different layers
must both raise a ``DistributedMismatchError`` naming each rank's layer and call, and the
group stays usable afterwards (the rows were exchanged, only their headers differed).
"""

from __future__ import annotations

import copy
import os
import pickle
import time
import warnings

import torch
from torch import nn

SCENARIOS = [
    "no_future_warning",
    "swapped_layers",
    "swapped_unnamed_layers",
    "dtype_mismatch",
    "one_value_per_channel",
    "debug_skip_last_layer",
    "subgroup_deepcopy_and_pickle",
    "ddp_wrapped_convert",
    "extra_forward",
]


def _outcome(fn) -> str:
    try:
        return f"ok: {fn()}"
    except Exception as error:  # the text is what the test checks
        return f"{type(error).__name__}: {error}"


def _two_same_width(named: bool) -> nn.Module:
    from bnsurgeon import convert
    from bnsurgeon.runtime import SyncBatchNorm

    if named:
        return convert(nn.ModuleDict({"first": nn.BatchNorm2d(4), "second": nn.BatchNorm2d(4)}), "sync").model.train()
    return nn.ModuleDict({"first": SyncBatchNorm(4), "second": SyncBatchNorm(4)}).train()


def _swapped(rank: int, named: bool) -> str:
    import torch.distributed as dist

    layers = _two_same_width(named)
    order = ["first", "second"] if rank == 0 else ["second", "first"]
    x = torch.randn(3, 4, 2, 2)
    for name in order:
        x = layers[name](x)
    dist.barrier()
    return f"running means {layers['first'].running_mean.tolist()}"


def _no_future_warning(rank: int) -> str:
    from bnsurgeon import convert

    model = convert(nn.Sequential(nn.BatchNorm2d(4)), "sync").model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 4, 3, 3, requires_grad=True)).sum().backward()
    future = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    if future:
        raise AssertionError(f"warnings from a synced step: {future}")
    return "no warnings"


def _dtype_mismatch(rank: int) -> str:
    from bnsurgeon import convert

    model = convert(nn.Sequential(nn.BatchNorm2d(4)), "sync").model.train()
    x = torch.randn(2, 4, 3, 3)
    return str(model(x if rank == 0 else x.bfloat16()).dtype)


def _one_value(rank: int) -> str:
    from bnsurgeon import convert

    model = convert(nn.Sequential(nn.BatchNorm1d(4)), "sync").model.train()
    before = model[0].running_var.clone()
    try:
        model(torch.randn(1 if rank == 0 else 0, 4))
    finally:
        if not torch.equal(before, model[0].running_var):
            raise AssertionError("running_var changed on a one-value batch")
    return "trained on one value per channel"


def _debug_skip_last(rank: int) -> str:
    from bnsurgeon import convert
    from bnsurgeon.runtime import set_sync_debug

    model = convert(nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6)), "sync").model.train()
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    set_sync_debug(True)
    try:
        out = model(x) if rank == 0 else model[1](model[0](x))  # rank 1 skips the last layer
        out.sum().backward()
    finally:
        set_sync_debug(False)
    return "no error"


def _subgroup_deepcopy_and_pickle(rank: int) -> str:
    import torch.distributed as dist

    from bnsurgeon import convert

    group = dist.new_group([0, 1])
    model = convert(nn.Sequential(nn.BatchNorm2d(4)), "sync", process_group=group).model.train()
    ema = copy.deepcopy(model)
    if ema[0].process_group is not group:
        raise AssertionError("the deepcopy does not share the process group")
    x = torch.randn(2 + rank, 4, 3, 3)
    ema(x)
    stats = [torch.zeros(4), torch.zeros(4)]
    dist.all_gather(stats, ema[0].running_mean.clone())
    if not torch.equal(stats[0], stats[1]):
        raise AssertionError("the deepcopy did not train synced")
    loaded = pickle.loads(pickle.dumps(model))
    if loaded[0].process_group is not None:
        raise AssertionError("pickling kept a process group")
    try:
        loaded(x)
    except Exception as error:
        refused = f"{type(error).__name__}: {error}"
    else:
        raise AssertionError("the unpickled layer trained without its group")
    convert(loaded, "sync", process_group=group, inplace=True)
    loaded(x)
    return f"deepcopy shares the group; unpickled refused with [{refused}]; regrouped trains"


def _ddp_wrapped_convert(rank: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    from bnsurgeon import convert

    ddp = DistributedDataParallel(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    try:
        convert(ddp, "sync")
    except Exception as error:
        refused = f"{type(error).__name__}: {error}"
    else:
        raise AssertionError("a copy-mode conversion of a DDP model was not refused")
    converted = convert(ddp, "sync", inplace=True).model
    if converted is not ddp or type(ddp.module[1]).__name__ != "SyncBatchNorm":
        raise AssertionError("in-place conversion of the DDP model did not happen")
    ddp.train()(torch.randn(2, 3, 4, 4)).sum().backward()
    return f"copy refused with [{refused}]; in place trains"


def _extra_forward(rank: int) -> str:
    from bnsurgeon import convert

    model = convert(nn.Sequential(nn.BatchNorm2d(4)), "sync").model.train()
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    if rank == 0:
        model(x)  # an extra train-mode forward, e.g. for logging, on one rank only
    model(x).sum().backward()
    return "no error"


def scenarios_rank(rank: int, world_size: int, names: list[str]) -> dict:
    run = {
        "no_future_warning": lambda: _no_future_warning(rank),
        "swapped_layers": lambda: _swapped(rank, named=True),
        "swapped_unnamed_layers": lambda: _swapped(rank, named=False),
        "dtype_mismatch": lambda: _dtype_mismatch(rank),
        "one_value_per_channel": lambda: _one_value(rank),
        "debug_skip_last_layer": lambda: _debug_skip_last(rank),
        "subgroup_deepcopy_and_pickle": lambda: _subgroup_deepcopy_and_pickle(rank),
        "ddp_wrapped_convert": lambda: _ddp_wrapped_convert(rank),
        "extra_forward": lambda: _extra_forward(rank),
    }
    return {name: _outcome(run[name]) for name in names}


def skipped_layer_timeout_rank(
    rank: int, world_size: int, seconds: str, done: str, group_s: float | None = None
) -> str:
    """The group was created with a longer timeout (as by a user's own init_process_group);
    BNSURGEON_DIST_TIMEOUT (``seconds``) must still bound the sync layer's collective, and the error names
    whichever of the two fired: ``group_s`` is the timeout of a group of the same ranks made once both are in
    the default one (set on the default group before, it would bound their meeting too, which a busy machine
    can make slow), which the layer syncs over. Rank 1 skips the layer
    and stays in the group until rank 0 has its error (the file ``done``), however long that takes: had it
    left, rank 0 would see a peer that left, not a timeout."""
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from bnsurgeon import convert

    os.environ["BNSURGEON_DIST_TIMEOUT"] = seconds
    group = None
    if group_s is not None:  # a group of the same ranks with its own timeout (public API; torch 2.4 has no set_timeout)
        dist.barrier()
        group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=group_s))
    model = convert(nn.Sequential(nn.BatchNorm2d(4)), "sync", process_group=group).model.train()
    started = time.monotonic()
    if rank == 1:  # skips the layer and stays away
        while not Path(done).exists() and time.monotonic() - started < 600:
            time.sleep(0.05)
        return "skipped"
    try:
        model(torch.randn(2, 4, 3, 3))
    except Exception as error:
        return f"{type(error).__name__} after {time.monotonic() - started:.1f} s: {error}"
    finally:
        Path(done).touch()
    return "no error"
