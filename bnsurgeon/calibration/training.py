"""Recalibration in a training loop: the averaged weights (EMA, SWA) get statistics of their own.

An EMA or SWA copy averages the weights *and* the BN buffers of the steps it saw, so its
running statistics were never computed for its weights (timm#245: EMA top-1 53.05 against
77.86 for the raw model after ``distribute_bn``). Before evaluating or saving it, one pass of
training data through the averaged weights gives them their own exact statistics:

    ema = timm.utils.ModelEmaV3(model, decay=0.999)          # or torch AveragedModel
    ...
    for epoch in range(epochs):
        train_one_epoch(model, ema, loader)
        bnsurgeon.recalibrate_averaged(ema, loader, max_batches=50)   # every rank: its own shard
        validate(ema.module)

Under DDP every rank calls it with its own loader (a DistributedSampler shard); the statistics
are merged over every rank in one collective and are the same everywhere. This replaces
timm's ``--dist-bn reduce`` (an equal-weight mean of per-rank running buffers, also applied to
the EMA) and torch's ``swa_utils.update_bn`` (a mean of batch variances, one rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from bnsurgeon.calibration.recalibrate import RecalibrationReport, recalibrate

if TYPE_CHECKING:
    from torch import nn


def averaged_module(averaged: Any) -> "nn.Module":
    """The module holding the averaged weights: ``.module`` of timm's ModelEma/V2/V3 and torch's
    AveragedModel, else the object itself (an EMA kept as a plain module)."""
    from torch import nn

    inner = getattr(averaged, "module", None)
    if isinstance(inner, nn.Module) and (
        not isinstance(averaged, nn.Module)
        or hasattr(averaged, "n_averaged")
        or type(averaged).__name__.startswith("ModelEma")
    ):
        return inner
    if isinstance(averaged, nn.Module):
        return averaged
    raise TypeError(f"{type(averaged).__name__} holds no averaged module (.module)")


def recalibrate_averaged(averaged: Any, data: "Iterable[Any]", **options: Any) -> RecalibrationReport:
    """``recalibrate`` the averaged weights of an EMA/SWA wrapper, with the batches moved to where
    those weights live (timm's EMA may be kept on the CPU). ``options`` as for ``recalibrate``."""
    module = averaged_module(averaged)
    if "device" not in options:
        parameter = next(module.parameters(), None)
        options["device"] = parameter.device if parameter is not None else None
    return recalibrate(module, data, **options)
