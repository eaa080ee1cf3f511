"""Precise BN (Wu & Johnson, 2021): one pass over data computes, for every BN-family module,
the population mean and variance of its input over every element of every batch on every
rank, and writes them into its running statistics.

The pass: non-BN modules run in eval (no dropout), BN modules normalise as in training
(batch statistics; bnsurgeon's sync layers under a process group normalise over the global
batch, as in training). Each batch's per-channel moments are taken in the activation's own dtype
and merged in float64 (``statistics.py``): torch's BN classes in training mode hand over the
statistics their kernel computed for the normalisation (scratch running buffers, momentum 1), so
the activation is read once; every other call gets them from a forward pre-hook (the corrected
two-pass sums). The forward's own running-stat updates are undone (every BN buffer is restored
from a snapshot), then each module that was reached gets the population statistics: a float64
model exact to float64 round-off, a float32 one within what one more float32 rounding of each
activation can do (README, "Recalibrate BN statistics"). Across ranks the moments are merged ONCE
per pass: one all_gather of every tracked module's [calls, n, first call, mean, M2] row packed
into one tensor (every rank sends a row for every tracked module, reached or not), merged in rank
order on every rank, so every rank ends with the same bits.

``num_batches_tracked`` is left as it was: it counts the training steps the statistics were
averaged over (a schedule, or ``momentum=None``'s cumulative average, reads it), and a
recalibration is not a training step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from bnsurgeon.calibration.report import ModuleRecalibration, RecalibrationReport, batches_counted
from bnsurgeon.calibration.statistics import Moments, batch_sums, merge_rows, settle_all
from bnsurgeon.core.anatomy import is_uninitialized_lazy, qualname
from bnsurgeon.core.errors import (
    BnSurgeonError,
    DataError,
    ModelCannotRunError,
    NoBatchNormReachedError,
    NonFiniteActivationsError,
    NothingToConvertError,
    StatisticsOverflowError,
    UsageError,
    first_line,
    statistics_overflow,
)
from bnsurgeon.core.layout import counted
from bnsurgeon.surgery.walk import plan

if TYPE_CHECKING:
    from torch import nn

#: buffers a recalibration may change; everything else of every module is left byte-identical
STAT_BUFFERS = ("running_mean", "running_var")


@dataclass
class _Tracked:
    path: str
    aliases: list[str]
    module: "nn.Module"
    channels: int
    moments: Moments
    calls: int = 0
    first_call: int = -1
    batch_stats_in_eval: bool = False  # normalised in eval mode with the batch's exact statistics in its buffers
    #: (mean, var) buffers that its training-mode forward fills with each batch's statistics (momentum 1)
    captured: "tuple[torch.Tensor, torch.Tensor] | None" = None
    momentum: Any = None  # its own, restored after the pass
    no_correction: "torch.Tensor | None" = None
    waiting: int = 0  # elements per channel of the call whose statistics the forward is computing


def _normalises_with_buffers(module: "nn.Module") -> bool:
    """Classes whose forward is F.batch_norm with the running buffers and ``momentum`` as torch's
    BatchNorm runs it (then drop and act for the norm-act ones). In eval mode, with the batch's own
    statistics put in those buffers by the hook, they normalise exactly as training mode does (with
    the exact statistics rounded once to the buffers' dtype, where training mode rounds its own). In
    training mode with momentum 1, their running buffers end each call holding the batch's mean and
    unbiased variance, as the kernel computed them for the normalisation. Any other class (a user's
    subclass, a rule's library class) runs its own training mode and the hook computes its statistics."""
    from torch import nn

    exact = {nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm}
    from bnsurgeon.runtime import SyncBatchNorm, SyncBatchNormAct

    exact |= {SyncBatchNorm, SyncBatchNormAct}
    try:
        from timm.layers import BatchNormAct2d

        exact.add(BatchNormAct2d)
    except ImportError:  # pragma: no cover - timm is a dependency
        pass
    return type(module) in exact and getattr(module, "track_running_stats", True)


def _unwrap(model: "nn.Module") -> "nn.Module":
    """The module a DDP wrapper or a torch.compile wrapper runs (their own forwards add nothing here)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = getattr(model, "_orig_mod")  # noqa: B009  (typed: Module.__getattr__ is Tensor | Module)
        else:
            return model


def _is_frozen(module: "nn.Module") -> bool:
    """Frozen BN normalises with its buffers in every mode: not a ``_BatchNorm`` (torchvision/timm
    FrozenBatchNorm2d, timm FrozenBatchNormAct2d, bnsurgeon FrozenBatchNorm*)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return not isinstance(module, _BatchNorm)


def _resolve_group(group: Any) -> tuple[Any, int, int]:
    """(group, world size, rank): the default group when one is initialised, else one process."""
    import torch.distributed as dist

    if group is False or not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def _first_tensor(value: Any) -> "torch.Tensor | None":
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return next((v for v in (_first_tensor(item) for item in value) if v is not None), None)
    if isinstance(value, dict):
        return next((v for v in (_first_tensor(item) for item in value.values()) if v is not None), None)
    return None


def batch_input(batch: Any) -> Any:
    """What the model is called with: a tensor; the first element of a (input, target) tuple or list,
    as a DataLoader yields them (torch's ``update_bn`` does the same); a dict as keyword arguments."""
    if isinstance(batch, (list, tuple)):
        if not batch:
            raise DataError("a batch is an empty list")
        return batch[0]
    return batch


def batch_size(value: Any) -> int:
    """Samples in a model input: the leading size of its (first) tensor."""
    tensor = _first_tensor(value)
    if tensor is None:
        raise DataError(f"a batch holds no tensor ({type(value).__name__})")
    if tensor.dim() == 0:
        raise DataError("a batch is a 0-dimensional tensor, not a batch of samples")
    return int(tensor.shape[0])


def _take(value: Any, count: int) -> Any:
    """The first ``count`` samples of a model input (tensors cut along their leading dimension)."""
    if isinstance(value, torch.Tensor):
        return value[:count]
    if isinstance(value, (list, tuple)):
        return type(value)(_take(item, count) for item in value)
    if isinstance(value, dict):
        return {key: _take(item, count) for key, item in value.items()}
    return value


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _moved(item, device) for key, item in value.items()}
    return value


def _on_device(forward, device: torch.device):
    def call(model, value):
        value = _moved(value, device)
        return forward(model, value) if forward is not None else _call(model, value)

    return call


def _call(model: "nn.Module", value: Any) -> Any:
    if isinstance(value, dict):
        return model(**value)
    return model(value)


def recalibrate(
    model: "nn.Module",
    data: "Iterable[Any] | torch.Tensor",
    *,
    max_batches: int | None = None,
    max_samples: int | None = None,
    include_frozen: bool = False,
    group: Any = None,
    progress: "Callable[[int, int], None] | None" = None,
    forward: "Callable[[nn.Module, Any], Any] | None" = None,
    device: "torch.device | str | None" = None,
    fast_normalization: bool = False,
) -> RecalibrationReport:
    """Write the exact population statistics of ``data`` into every BN-family module of ``model``.

    ``data``: an iterable of batches (a tensor; an ``(input, target)`` tuple/list, whose first
    element is used; a dict passed as keyword arguments), or a single tensor (one batch).
    ``forward(model, batch)`` replaces the call for anything else. ``max_batches`` and
    ``max_samples`` cap what this rank reads from ``data`` (the last batch is cut to
    ``max_samples``). Under an initialised process group (or ``group``) every rank passes its
    own data; all ranks get the same statistics, those of every element on every rank. Pass
    ``group=False`` to recalibrate this process alone. ``progress(batches, samples)`` is
    called after each batch of this rank. ``device``: move every batch's tensors there first
    (e.g. an EMA copy kept on another device than the loader's batches).

    By default each BN module runs its own training-mode forward (the pass's activations are
    bit for bit those of training mode with non-BN modules in eval). ``fast_normalization``:
    torch's BatchNorm1d/2d/3d, timm's BatchNormAct2d and the sync classes outside a
    synchronising group normalise in eval mode with the batch's exact statistics, which the
    pre-hook computes, put in their buffers: eval-mode BN plus those statistics costs less than
    torch's CPU training-mode BN kernel (about 2x less on BN-heavy models), and the activations
    equal training mode's to float32 rounding (the statistics are those of these activations).
    Inputs under ``SMALL_FOR_TRAINING_KERNEL`` elements still run training mode, whose kernel's
    statistics are taken as they are: there that is the cheaper of the two.

    Frozen BN (normalises with its buffers in every mode) is left alone unless
    ``include_frozen``. Modules the forward never reached are listed and left unchanged;
    ``num_batches_tracked`` is left as it was. On any error every BN buffer is restored.
    """
    started = time.perf_counter()
    if max_batches is not None and max_batches < 1:
        raise UsageError(f"max_batches must be at least 1 (got {max_batches})", "pass --batches 1 or more")
    if max_samples is not None and max_samples < 1:
        raise UsageError(f"max_samples must be at least 1 (got {max_samples})", "pass --samples 1 or more")
    if isinstance(data, torch.Tensor):
        data = [data]
    if group is None:  # a DDP wrapper names the group its ranks train in
        group = getattr(model, "process_group", None) if type(model).__name__ == "DistributedDataParallel" else None
    model = _unwrap(model)
    group, world, rank = _resolve_group(group)
    report = RecalibrationReport(ranks=world)
    entries = plan(model)  # walked once: the tracked modules and the snapshot both read it
    tracked = _tracked_modules(entries, include_frozen, report)
    snapshot = _snapshot(entries)
    hooks = []
    grad_enabled = torch.is_grad_enabled()
    saved_modes = [(module, module.training) for module in model.modules()]
    lockstep = world > 1 and _has_collective_layers(model, tracked)
    counters = {"collectives": 0}
    try:
        model.eval()
        for item in tracked:
            item.batch_stats_in_eval = fast_normalization and not lockstep and _normalises_with_buffers(item.module)
            if not _is_frozen(item.module) and not item.batch_stats_in_eval:
                item.module.training = True  # the BN module alone: its act/drop children stay in eval
            if not lockstep and _normalises_with_buffers(item.module) and not _is_frozen(item.module):
                _capture_batch_statistics(item)
        call_order = [0]
        for item in tracked:
            hooks.append(item.module.register_forward_pre_hook(_make_hook(item, call_order)))
            if item.captured is not None:
                hooks.append(item.module.register_forward_hook(_make_capture_hook(item)))
        torch.set_grad_enabled(False)
        if device is not None:
            forward = _on_device(forward, torch.device(device))
        failure = _run_pass(
            model, data, max_batches, max_samples, progress, forward, report, lockstep, group, world, counters
        )
        merged, totals = _merge(tracked, report, failure, group, world, counters)
        if totals["failed"]:
            if failure is not None:
                raise failure
            raise ModelCannotRunError(
                "another rank could not run the model on its data during recalibration (its own error says why)",
                "fix the data of the rank that failed",
            )
        report.collectives = counters["collectives"]
        _check_outcome(tracked, merged, report)
        _restore_buffers(snapshot)
        _write(tracked, merged, report)
    except BaseException:
        _restore_buffers(snapshot)
        raise
    finally:
        for handle in hooks:
            handle.remove()
        for item in tracked:
            if item.captured is not None:  # its buffers are back (the snapshot's own tensors): its momentum too
                item.module.momentum = item.momentum
        for module, training in saved_modes:
            module.training = training
        torch.set_grad_enabled(grad_enabled)
    report.seconds = time.perf_counter() - started
    return report


def _tracked_modules(entries: list, include_frozen: bool, report: RecalibrationReport) -> list[_Tracked]:
    tracked = []
    for entry in entries:
        module, reason = entry.module, None
        if entry.rule is None:
            reason = "no rule claims this class (bnsurgeon.rules.register one to recalibrate it)"
        elif is_uninitialized_lazy(module):
            reason = "uninitialized lazy batch norm (run one forward first)"
        elif any(module._buffers.get(name) is None for name in STAT_BUFFERS):
            reason = "keeps no running statistics (track_running_stats=False)"
        elif _is_frozen(module) and not include_frozen:
            reason = "frozen batch norm, left alone (include_frozen=True / --include-frozen to recalibrate it)"
        if reason:
            report.skipped.append({"path": entry.path, "cls": entry.cls_name, "reason": reason})
            continue
        channels = int(module._buffers["running_mean"].numel())
        tracked.append(
            _Tracked(
                entry.path,
                entry.paths[1:],
                module,
                channels,
                Moments.empty(channels, module._buffers["running_mean"].device),
            )
        )
    if not tracked:
        reasons = "; ".join(f"{s['path']}: {s['reason']}" for s in report.skipped[:4])
        raise NothingToConvertError(
            "the model has no BatchNorm-family module to recalibrate" + (f" ({reasons})" if reasons else ""),
            "nothing was written; recalibrate a model with BatchNorm layers"
            + ("" if include_frozen or not report.skipped else " (frozen ones: --include-frozen)"),
        )
    return tracked


def _has_collective_layers(model: "nn.Module", tracked: list[_Tracked]) -> bool:
    """Modules whose training-mode forward is a collective (sync BN): every rank must call them in step."""
    from torch.nn import SyncBatchNorm

    return any(isinstance(item.module, SyncBatchNorm) for item in tracked)


#: with fast_normalization, inputs smaller than this (elements) still run torch's training-mode BN and
#: hand over its statistics: on this project's CPUs that costs less than eval BN plus bnsurgeon's own
#: statistics (a few small operations each) for small activations, more for large ones
SMALL_FOR_TRAINING_KERNEL = 65536


def _capture_batch_statistics(item: _Tracked) -> None:
    """Let a training-mode module's own kernel compute each batch's statistics (it does for its
    normalisation anyway): its running buffers are swapped for scratch ones and its momentum set to 1,
    so after each call they hold that batch's mean and unbiased variance (its output does not depend
    on either). The snapshot puts the module's own buffers back; the momentum is restored with the
    training flags."""
    buffers = item.module._buffers
    mean, var = buffers["running_mean"], buffers["running_var"]
    assert mean is not None and var is not None  # only modules that track running statistics are captured
    item.captured = (torch.zeros_like(mean), torch.ones_like(var))
    item.no_correction = torch.zeros_like(mean)  # the kernel's mean is the mean: no sum(d) to add
    buffers["running_mean"], buffers["running_var"] = item.captured
    item.momentum = item.module.momentum
    setattr(item.module, "momentum", 1.0)  # noqa: B010  (a float attribute; Module.__setattr__ is typed for tensors)


def _kernel_statistics_exact(x: torch.Tensor, captured: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether the training kernel's statistics of ``x`` are as good as ``batch_sums``: CUDA (Welford),
    or a contiguous (N, C, H, ...) CPU input with spatial extent (two passes, double accumulators). CPU
    (N, C) and channels-last inputs are summed in the input's dtype, one element after another, which
    loses digits over large batches: those get ``batch_sums``. Dtypes must match the buffers."""
    if x.dtype != captured[0].dtype or x.dtype not in (torch.float32, torch.float64):
        return False
    if x.is_cuda:
        return True
    return x.dim() > 2 and x.is_contiguous() and x.numel() > x.shape[0] * x.shape[1]


def _make_hook(item: _Tracked, call_order: list[int]):
    def hook(module, args):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            raise DataError(f"{item.path} was called with {type(x).__name__}, not a tensor")
        item.calls += 1
        if item.first_call < 0:
            item.first_call = call_order[0]
            call_order[0] += 1
        if item.captured is not None and x.dim() > 1:
            count = x.numel() // x.shape[1] if x.shape[1] else 0
            if (
                count > 1
                and _kernel_statistics_exact(x, item.captured)
                and not (item.batch_stats_in_eval and x.numel() >= SMALL_FOR_TRAINING_KERNEL)
            ):
                item.waiting = count  # the forward hook takes them from the kernel
                module.training = True
                return None
            module.training = not item.batch_stats_in_eval
        item.waiting = 0
        count, shift, total, squares = batch_sums(x)
        item.moments.push_sums(count, shift, total, squares)
        if item.batch_stats_in_eval and count:
            _put_batch_statistics(module._buffers, count, shift, total, squares)
        return None

    return hook


def _put_batch_statistics(
    buffers: dict, count: int, shift: torch.Tensor, total: torch.Tensor, squares: torch.Tensor
) -> None:
    """The batch's mean and biased variance (what training mode normalises with) into the running buffers,
    written in place where the dtypes agree (three operations a call instead of six)."""
    mean, var = buffers["running_mean"], buffers["running_var"]
    if mean.dtype == shift.dtype and var.dtype == squares.dtype:
        torch.add(shift, total, alpha=1.0 / count, out=mean)
        torch.addcmul(squares, total, total, value=-1.0 / count, out=var).div_(count)
    else:
        mean.copy_(torch.add(shift, total, alpha=1.0 / count))
        var.copy_(torch.addcmul(squares, total, total, value=-1.0 / count).div_(count))


def _make_capture_hook(item: _Tracked):
    def hook(module, args, output):
        count = item.waiting
        if count:
            item.waiting = 0
            mean, var = item.captured
            # M2 = unbiased variance * (n - 1): the kernel's variance rounded once to the buffer's dtype
            item.moments.push_sums(count, mean.clone(), item.no_correction, var.clone(), scale=count - 1)
        return None

    return hook


def _snapshot(entries: list) -> list[tuple[dict, str, torch.Tensor, torch.Tensor]]:
    """A copy of every BN-family buffer of the plan's ``entries``, to undo the forward's own running-stat updates."""
    saved = []
    for entry in entries:
        for name in (*STAT_BUFFERS, "num_batches_tracked"):
            buffer = entry.module._buffers.get(name)
            if buffer is not None and not buffer.is_meta:
                saved.append((entry.module._buffers, name, buffer, buffer.detach().clone()))
    return saved


def _restore_buffers(snapshot) -> None:
    with torch.no_grad():
        for buffers, name, buffer, copy in snapshot:
            buffers[name] = buffer  # the same tensor object: references to it stay valid
            buffer.copy_(copy)


def _run_pass(
    model, data, max_batches, max_samples, progress, forward, report, lockstep, group, world, counters
) -> "BnSurgeonError | None":
    """This rank's forwards. Returns the error that stopped it (raised after the merge, so that
    no other rank waits for this one), or None."""
    batches = samples = 0
    template = None
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    empty_like = (parameter.dtype, parameter.device) if parameter is not None else (torch.float32, torch.device("cpu"))
    iterator = iter(data)
    failure = None
    while True:
        batch = None
        if (
            failure is None
            and (max_batches is None or batches < max_batches)
            and (max_samples is None or samples < max_samples)
        ):
            try:
                batch = next(iterator)
            except StopIteration:
                batch = None
            except BnSurgeonError as error:
                failure = error
        value = None
        if batch is not None:
            try:
                value = batch_input(batch)
                size = batch_size(value)
                if max_samples is not None and samples + size > max_samples:
                    value = _take(value, max_samples - samples)
                    size = max_samples - samples
            except BnSurgeonError as error:
                failure, value = error, None
        if lockstep:
            value = _agree_step(value, template, group, world, counters, failure, empty_like)
            if value is None:
                break
            if batch is None:  # this rank is out of data: it joins the step with an empty batch
                _forward(model, value, forward, batches, empty=True)
                continue
        elif value is None:
            break
        try:
            _forward(model, value, forward, batches)
        except BnSurgeonError as error:
            failure = error
            if not lockstep:
                break
            continue
        template = value
        batches += 1
        samples += size
        if progress is not None:
            progress(batches, samples)
    report.rank_batches, report.rank_samples = [batches], [samples]
    return failure


def _forward(model, value, forward, index: int, empty: bool = False) -> None:
    try:
        forward(model, value) if forward is not None else _call(model, value)
    except BnSurgeonError:
        raise
    except Exception as error:
        tensor = _first_tensor(value)
        shape = tuple(tensor.shape) if tensor is not None else type(value).__name__
        what = "an empty batch (this rank's data ran out)" if empty else f"batch {index} of shape {shape}"
        raise ModelCannotRunError(
            f"the model cannot run on {what}: {type(error).__name__}: {first_line(error)}",
            "pass batches the model takes (N, C, H, W in its input size and dtype; in training "
            "mode a BN needs more than one value per channel, so no batch of one sample after "
            "a pooling layer)",
        ) from None


#: the step header of a lockstep pass: [has a batch, failed, dims, shape...] (shapes of up to this many dims)
MAX_DIMS = 8


def _agree_step(value, template, group, world, counters, failure, empty_like):
    """Sync BN layers are collectives: every rank must run every step. One small all_gather per step
    says which ranks still have a batch; a rank without one runs an empty batch shaped like its last
    one (or, with none yet, like the first rank's, with zero samples). None: every rank is done."""
    from bnsurgeon.runtime.collectives import all_gather_rows

    tensor = _first_tensor(value) if value is not None else None
    header = torch.zeros(3 + MAX_DIMS, dtype=torch.int64)
    if tensor is not None and isinstance(value, torch.Tensor) and tensor.dim() <= MAX_DIMS:
        header[0], header[2] = 1, tensor.dim()
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape)
    elif value is not None:
        header[0] = 1
    header[1] = int(failure is not None)
    rows = all_gather_rows(
        header.to(_collective_device(group)), world, group, lambda: "bnsurgeon recalibrate's step header"
    ).cpu()
    counters["collectives"] += 1
    if bool(rows[:, 1].any()):  # a rank failed: every rank stops here, and the merge says so
        return None
    if not bool(rows[:, 0].any()):
        return None
    if value is not None:
        return value
    if template is not None:
        return _take(template, 0)
    for row in rows:
        dims = int(row[2])
        if row[0] and dims:
            shape = [0, *[int(s) for s in row[4 : 3 + dims]]]
            return torch.zeros(shape, dtype=empty_like[0], device=empty_like[1])
    raise DataError(
        "a rank with no data cannot join a step of a model with sync BN layers whose batches are not single tensors",
        "give every rank at least one batch, or pass tensor batches",
    )


def _merge(tracked: list[_Tracked], report: RecalibrationReport, failure, group, world, counters):
    """Every tracked module's moments over every rank, merged in rank order: ONE all_gather.
    One process: its own moments as they are (no packing)."""
    if world == 1:
        report.batches, report.samples = report.rank_batches[0], report.rank_samples[0]
        settle_all([item.moments for item in tracked])
        return ([(item.calls, item.first_call, item.moments) for item in tracked], {"failed": failure is not None})
    settle_all([item.moments for item in tracked])
    width = [3 + 2 * item.channels for item in tracked]
    local = torch.cat(
        [
            torch.tensor(
                [float(report.rank_batches[0]), float(report.rank_samples[0]), float(failure is not None)],
                dtype=torch.float64,
            )
        ]
        + [
            torch.cat(
                [
                    torch.tensor([float(item.calls), float(item.first_call)], dtype=torch.float64),
                    item.moments.row().cpu(),
                ]
            )
            for item in tracked
        ]
    )
    if world > 1:
        from bnsurgeon.runtime.collectives import all_gather_rows

        device = _collective_device(group)
        rows = all_gather_rows(local.to(device), world, group, lambda: "bnsurgeon recalibrate's statistics merge").cpu()
        counters["collectives"] += 1
    else:
        rows = local.view(1, -1)
    report.rank_batches = [int(v) for v in rows[:, 0].tolist()]
    report.rank_samples = [int(v) for v in rows[:, 1].tolist()]
    report.batches, report.samples = sum(report.rank_batches), sum(report.rank_samples)
    merged = []
    offset = 3
    for item, size in zip(tracked, width, strict=True):
        block = rows[:, offset : offset + size]
        offset += size
        calls = int(block[:, 0].sum().item())
        firsts = [int(v) for v in block[:, 1].tolist() if v >= 0]
        moments = merge_rows(block[:, 2:], item.channels)
        merged.append((calls, min(firsts) if firsts else -1, moments))
    return merged, {"failed": bool(rows[:, 2].any())}


def _collective_device(group) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_outcome(tracked, merged, report: RecalibrationReport) -> None:
    if report.batches == 0:
        raise DataError(
            "the data holds no batch (on any rank): nothing to compute statistics from",
            "nothing was written; pass data with at least one batch",
        )
    if report.samples == 0:
        raise DataError("the data's batches hold no sample", "nothing was written; pass batches with samples in them")
    reached = [
        (item, calls, first, moments)
        for item, (calls, first, moments) in zip(tracked, merged, strict=True)
        if moments.count
    ]
    if reached and not _all_finite([m.mean for *_, m in reached] + [m.m2 for *_, m in reached]):
        non_finite = [
            (first, item.path)
            for item, _, first, moments in reached
            if not bool(torch.isfinite(moments.mean).all() & torch.isfinite(moments.m2).all())
        ]
        first, path = min(non_finite)
        others = len(non_finite) - 1
        overflow = _overflowed_variance(reached, path)
        if overflow is not None:
            raise overflow
        raise NonFiniteActivationsError(
            f"the input of {path} held NaN or Inf during recalibration"
            + (f" (and {counted(others, 'module')} after it)" if others else "")
            + ": its statistics would be meaningless"
        )
    by_dtype: dict[torch.dtype, list] = {}
    for item, _, _, moments in reached:
        by_dtype.setdefault(item.module._buffers["running_mean"].dtype, []).append((item, moments))
    for dtype, group in by_dtype.items():  # Inf in a buffer is no statistic: refused, naming it
        if _all_finite([torch.cat([m.mean for _, m in group] + [m.unbiased_var for _, m in group]).to(dtype)]):
            continue
        for item, moments in group:
            buffers = item.module._buffers
            overflow = statistics_overflow(
                item.path, {"running_mean": moments.mean.cpu()}, buffers["running_mean"].dtype
            ) or statistics_overflow(
                item.path, {"running_var": moments.unbiased_var.cpu()}, buffers["running_var"].dtype
            )
            if overflow is not None:
                raise overflow
    if not any(moments.count for _, _, moments in merged):
        raise NoBatchNormReachedError(
            f"the forward over {batches_counted(report.batches)} never called any of the model's "
            f"{counted(len(tracked), 'tracked BN module')}"
        )


def _overflowed_variance(reached, path: str) -> StatisticsOverflowError | None:
    """A finite input whose squared deviations overflow the activations' dtype (float32 past 1.8e19 in
    std: the per-batch sums are taken in that dtype) has a finite mean and an infinite M2: that is a
    statistic the dtype cannot hold, not an input holding NaN or Inf."""
    for item, _, _, moments in reached:
        if item.path != path:
            continue
        mean_finite = bool(torch.isfinite(moments.mean).all())
        m2_nan = bool(torch.isnan(moments.m2).any())
        if mean_finite and not m2_nan:
            dtype = item.module._buffers["running_var"].dtype
            kind = str(dtype).replace("torch.", "")
            return StatisticsOverflowError(
                f"the recalibrated running_var of {path} overflows: its input's squared deviations exceed what "
                f"{kind} holds ({torch.finfo(dtype).max:.3g}), so it would be written as Inf"
            )
    return None


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """One check (one host read) for many tensors of one device."""
    return bool(torch.isfinite(torch.cat([t.reshape(-1) for t in tensors])).all())


def _write(tracked, merged, report: RecalibrationReport) -> None:
    """Each reached module's buffers get its statistics; the report's changes are computed for every
    module at once (channels end to end, one max per module segment), not a dozen operations each."""
    written = []
    with torch.no_grad():
        for item, (calls, _, moments) in zip(tracked, merged, strict=True):
            if moments.count == 0:
                report.unreached.append(item.path)
                continue
            buffers = item.module._buffers
            new_mean, new_var = moments.mean, moments.unbiased_var
            written.append(
                (
                    item,
                    calls,
                    moments,
                    buffers["running_mean"].detach().clone(),
                    buffers["running_var"].detach().clone(),
                    new_mean,
                    new_var,
                )
            )
            buffers["running_mean"].copy_(new_mean)
            buffers["running_var"].copy_(new_var)
            report.statistics[item.path] = (moments.count, new_mean.clone(), moments.population_var)
    if written:
        old_mean, old_var, new_mean, new_var = (
            torch.cat([row[i].to(torch.float64).cpu() for row in written]) for i in (3, 4, 5, 6)
        )
        mean_diff, var_diff = (new_mean - old_mean).abs(), (new_var - old_var).abs()
        changes = torch.stack(
            [
                mean_diff,
                mean_diff / new_var.clamp(min=1e-12).sqrt(),
                var_diff,
                var_diff / old_var.abs().clamp(min=1e-12),
            ],
            1,
        )
        lengths = torch.tensor([row[0].channels for row in written])
        maxima = torch.segment_reduce(changes.nan_to_num(nan=float("inf")), "max", lengths=lengths)
        for (item, calls, moments, *_), values in zip(written, maxima.tolist(), strict=True):
            report.modules.append(
                ModuleRecalibration(
                    path=item.path,
                    cls=qualname(type(item.module)),
                    channels=item.channels,
                    elements=moments.count,
                    calls=calls,
                    calls_per_batch=calls / max(report.batches, 1),
                    mean_change_max=_finite_number(values[0]),
                    mean_change_rel=_finite_number(values[1]),
                    var_change_max=_finite_number(values[2]),
                    var_change_rel=_finite_number(values[3]),
                    aliases=list(item.aliases),
                )
            )
    several = report.called_several_times
    if several:
        report.notes.append(
            f"called several times per batch, statistics over all their calls: {', '.join(several[:8])}"
            + (f" (+{len(several) - 8} more)" if len(several) > 8 else "")
        )
    if report.unreached:
        report.notes.append(f"{counted(len(report.unreached), 'module')} never reached by the forward, left unchanged")


def _finite_number(number: float) -> float:
    return number if math.isfinite(number) else float("inf")
