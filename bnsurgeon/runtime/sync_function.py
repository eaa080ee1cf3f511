"""The autograd Function behind bnsurgeon's synchronized batch norm.

Forward: local (count, mean, biased var) behind the layer's header (identity.py) -> ONE
all_gather -> header check (ranks at different layers raise) -> Chan merge weighted by
counts -> running-stat update -> normalize. Backward: local sum(dy) and the kernel's
reduced term -> ONE sum over ranks of both packed together (an all_reduce on devices,
an all_gather of a headed row + local sum on CPU) -> input gradient. grad_weight
and grad_bias stay local (DDP averages parameter gradients itself). See DESIGN.md, "The
runtime layers". Autocast is off inside (statistics are float32 whatever the input).
Every op here is on (C,)-sized tensors except the kernels' passes, and
on CPU the global count is read on the host (there is no device to synchronize with).
On any other device nothing is ever read back: the count stays a device tensor, so the
layer can run inside CUDA graph capture (tests run this path on meta tensors, which
raise on any host read).
"""

from __future__ import annotations

import contextlib
import math

import torch

from bnsurgeon.runtime import debug, device_path, gaps
from bnsurgeon.runtime.collectives import all_gather_rows, all_reduce_sum
from bnsurgeon.runtime.device_checks import device_assert, short_name
from bnsurgeon.runtime.device_path import one_value_message
from bnsurgeon.runtime.identity import (
    BACKWARD,
    CALL_SLOT,
    COMPILED_BACKWARD,
    HEADER,
    backward_header,
    check_headers,
    describe_header,
    mismatch_error,
)
from bnsurgeon.runtime.kernels import GenericKernels, uses_device_path
from bnsurgeon.runtime.recompute import GlobalStats, may_be_recomputed, recomputing


def merge_stats(gathered: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan/Welford merge of per-rank (count, mean, biased var) rows.

    Never E[x^2] - E[x]^2: that cancels catastrophically when |mean| >> std. Ranks with
    zero count drop out through their weight, with no host synchronization.
    """
    counts, means, variances = gathered.split([1, channels, channels], dim=1)
    total = counts.sum(0)
    weights = counts.div(total.clamp(min=1)).t()  # (1, W)
    mean = weights.mm(means)
    deviation = means - mean
    spread = torch.addcmul(variances, deviation, deviation)
    var = weights.mm(spread)
    return total, mean.view(-1), var.view(-1)


def update_running_stats(running_mean, running_var, mean, var, total, momentum: "float | torch.Tensor") -> None:
    """Momentum update; running_var takes the unbiased var over the global count.

    ``total`` is a Python number when it lives on the host (CPU), else a tensor, so that
    the CUDA path never synchronizes; an empty global batch leaves the statistics alone.
    """
    if running_mean is None or running_var is None:
        return
    if isinstance(total, (int, float)):
        if total == 0:
            return
        factor = momentum
        unbiased = var * (total / max(total - 1, 1))
    else:
        factor = (total > 0).to(mean.dtype) * momentum
        unbiased = var * (total / (total - 1).clamp(min=1))
    _lerp_into(running_mean, mean, factor)
    _lerp_into(running_var, unbiased, factor)


def _lerp_into(buffer: torch.Tensor, value: torch.Tensor, factor) -> None:
    """buffer += factor * (value - buffer), computed in the statistics' precision."""
    if buffer.dtype == value.dtype:
        buffer.lerp_(value, factor)
    else:
        buffer.copy_(buffer.to(value.dtype).lerp_(value, factor))


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm over the union of all ranks' batches in ``group`` (the eager path).

    ``identity`` (a ``LayerIdentity`` or None) names the layer in the header of every
    row this layer sends (identity.py) and holds its checkpoint stash (recompute.py).
    Under ``torch.compile`` the layer runs ``sync_op.py`` instead, which shares this module's
    ``global_stats`` and ``sum_over_ranks`` (the collectives and checks) and traces the rest.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world_size, identity, remember=None
    ):
        # ``remember``: keep this forward's statistics for an activation-checkpointing recompute until
        # its backward runs (recompute.py). Inside a Function's forward grad mode is always off, so
        # this cannot tell a checkpointed forward from another: by default every synced forward is
        # kept (at most STASH_LIMIT per layer), which is what recognises every checkpoint mode. A device
        # layer keeps nothing (recompute.py), so the question is only asked on the host path.
        ctx.identity = identity
        if uses_device_path(x):
            x = x.contiguous(memory_format=_memory_format(x))
            replay = identity is not None and recomputing()
            y, stats = device_path.forward(
                x, weight, bias, running_mean, running_var, eps, momentum, group, world_size, identity, replay
            )
            ctx.save_for_backward(x, weight, stats.mean, stats.invstd, stats.total)
            ctx.stats, ctx.group, ctx.on_device = stats, group, True
            return y
        if remember is None:
            remember = may_be_recomputed()
        with statistics_precision(x):
            y, saved_x, stats = sync_forward(
                x, weight, bias, running_mean, running_var, eps, momentum, group, world_size, identity, remember
            )
        ctx.save_for_backward(saved_x, weight, stats.mean, stats.var, stats.invstd, stats.header)
        ctx.total = stats.total
        ctx.stats = stats
        ctx.eps = eps
        ctx.group = group
        ctx.world_size = world_size
        ctx.on_device = False
        return y

    @staticmethod
    def backward(ctx, grad_output):
        # the saved tensors first: under non-reentrant checkpointing, unpacking them runs the recompute,
        # which takes this forward's statistics from the stash; only then is the entry discarded
        saved = ctx.saved_tensors
        if ctx.identity is not None:
            ctx.identity.stash.discard(ctx.stats)
        if ctx.on_device:
            x, weight, mean, invstd, counts = saved
            grad_output = grad_output.contiguous(memory_format=_memory_format(x))
            grad_input, grad_weight, grad_bias = device_path.backward(
                grad_output, x, weight, mean, invstd, counts, ctx.group, ctx.needs_input_grad
            )
            return (grad_input, grad_weight, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 3)
        x, weight, mean, var, invstd, header = saved
        with statistics_precision(grad_output):
            grad_input, grad_weight, grad_bias = sync_backward(
                grad_output,
                x,
                weight,
                mean,
                var,
                invstd,
                header,
                ctx.total,
                ctx.eps,
                ctx.group,
                ctx.world_size,
                ctx.needs_input_grad[0],
            )
        grad_weight = grad_weight if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = grad_bias if ctx.needs_input_grad[2] else None
        return (grad_input, grad_weight, grad_bias) + (None,) * (len(ctx.needs_input_grad) - 3)


def sync_backward(
    grad_output, x, weight, mean, var, invstd, header, total, eps, group, world_size, input_grad: bool = True
):
    """(grad_input or None, grad_weight, grad_bias): ONE sum over ranks, grad_weight/bias stay local."""
    kernels = GenericKernels
    sum_dy, sum_term, sum_dy_xhat = kernels.backward_reduce(grad_output, x, weight, mean, invstd, eps)

    grad_input = None
    if input_grad:
        global_sum_dy, global_sum_term = sum_over_ranks(
            header, torch.cat([sum_dy, sum_term]), counts_on_host(x), group, world_size
        ).chunk(2)
        grad_input = kernels.grad_input(
            grad_output, x, weight, mean, var, invstd, eps, global_sum_dy, global_sum_term, total
        )
    param_dtype = weight.dtype if weight is not None else sum_dy.dtype
    return grad_input, sum_dy_xhat.to(param_dtype), sum_dy.to(param_dtype)


def sync_forward(
    x, weight, bias, running_mean, running_var, eps, momentum, group, world_size, identity, remember: bool = False
):
    """(y, x as the backward needs it, GlobalStats): ONE all_gather, or none for a recognised recompute.

    ``remember``: the engine will not keep this forward's input (it may be recomputed), so
    its statistics wait in the layer's stash for the recompute (recompute.py).
    """
    kernels = GenericKernels
    local_mean, local_var, centred = kernels.local_stats(x, eps)
    replay = identity is not None and recomputing()
    stats = global_stats(local_mean, local_var, x.shape, x.dtype, eps, group, world_size, identity, remember, replay)
    if not replay:  # a recompute (recognised or not) leaves the running statistics alone
        update_running_stats(running_mean, running_var, stats.mean, stats.var, stats.total, momentum)
    return kernels.normalize(x, weight, bias, stats.mean, stats.var, stats.invstd, eps, centred), x, stats


def local_count(shape) -> int:
    """Values per channel in an input of ``shape`` on this rank."""
    return math.prod(shape) // max(shape[1], 1)


def global_stats(
    local_mean, local_var, shape, input_dtype, eps, group, world_size, identity, remember: bool, replay: bool
) -> GlobalStats:
    """The statistics of the global batch from this rank's (mean, biased var) of an input of ``shape``.

    One all_gather of [header, count, mean, var]; the headers are checked and the rows merged.
    ``replay`` (a checkpoint recompute) on the host first looks for the original forward's
    statistics in the stash: found, no collective; not found (and always on devices, which
    stash nothing: recompute.py), synchronize again with the last call's header.
    Shared by the eager Function and the compiled path's custom op (sync_op.py).
    """
    channels = shape[1]
    count = torch.full((1,), local_count(shape), dtype=local_mean.dtype, device=local_mean.device)
    fingerprint = torch.cat([count, local_mean, local_var])
    on_host = counts_on_host(local_mean)
    name = identity.name if identity is not None else "<anonymous>"
    if replay and on_host:
        stats = identity.stash.take(fingerprint)
        if stats is not None:  # a recognised recompute: the original forward's statistics
            return stats
    if identity is not None:
        header = identity.header_for(
            local_mean.device, input_dtype, channels, local_mean.dtype, advance=not replay, group=group
        )
    else:
        header = torch.zeros(HEADER, dtype=local_mean.dtype, device=local_mean.device)
    local = torch.cat([header, fingerprint])

    def describe() -> str:
        return f"sync batch norm {describe_header(local[:HEADER])}"

    if debug.enabled():
        debug.check_same_layer(local[:HEADER], world_size, group, describe)
    gathered = all_gather_rows(local, world_size, group, describe)
    check_headers(gathered, group, on_host, name)
    counted, mean, var = merge_stats(gathered[:, HEADER:], channels)
    recorder = gaps.current()  # bnsurgeon run --stats: keeps the rows gathered here (no op, no host read)
    if recorder is not None and identity is not None and not replay:
        counts, means, variances = gathered[:, HEADER:].split([1, channels, channels], dim=1)
        recorder.record(identity, counts, means, variances, mean, var, eps, shape)
    total: "int | torch.Tensor" = counted
    if on_host:
        total = int(counted.item())  # a host read is free on CPU and saves ~10 small ops
        if total == 1:
            raise ValueError(one_value_message(shape, world_size, name))
    else:
        device_assert(counted.ne(1), one_value_message(shape, world_size, short_name(name)))
    stats = GlobalStats(mean, var, torch.rsqrt(var + eps), total, local[:HEADER], fingerprint)
    if identity is not None and remember and not replay and on_host:
        identity.stash.remember(stats)
    return stats


def sum_over_ranks(header, packed, on_host: bool, group, world_size: int, phase: int = BACKWARD):
    """A backward's per-channel sums (``packed``, 1-D) summed over the ranks, in one collective.

    On the CPU the row is an all_gather that starts with the forward's header (phase 2),
    so a rank in this backward that meets a rank in some other layer's collective is named
    (identity.py); on devices an all_reduce, in place on ``packed``. Shared by the eager
    backward and the compiled path's ``sum_statistic_grads`` (sync_op.py).
    """

    def describe() -> str:
        return f"sync batch norm {describe_header(torch.cat(backward_header(header, phase)))}"

    if on_host:
        row = torch.cat([*backward_header(header, phase), packed])
        if debug.enabled():
            debug.check_same_layer(row[:HEADER], world_size, group, describe)
        gathered = all_gather_rows(row, world_size, group, describe)
        check_backward_headers(gathered, group)
        return gathered[:, HEADER + 1 :].sum(0)
    if debug.enabled():
        debug.check_same_layer(torch.cat(backward_header(header, phase)), world_size, group, describe)
    return all_reduce_sum(packed, world_size, group, describe)


def check_backward_headers(gathered: torch.Tensor, group) -> None:
    """The backward rows' headers checked as the forward's, but for one case: a rank in the compiled path's backward
    (it sums the statistics' gradients) beside one in the eager backward (the kernel's sums) may meet where every
    eager row sums to zero, as an empty rank's does (under torch.compile an empty batch runs eagerly): zero is zero
    in either. Any other eager row summed with a compiled one would be wrong, and is refused by name."""
    phase = CALL_SLOT + 1
    phases = gathered[:, phase]
    if bool((phases == COMPILED_BACKWARD).any()) and bool((phases == BACKWARD).any()):
        eager = phases == BACKWARD
        if bool(gathered[eager, HEADER + 1 :].ne(0).any()):
            raise mismatch_error(gathered[:, :HEADER], group, name_ranks=True)
        gathered = gathered.clone()
        gathered[:, phase] = COMPILED_BACKWARD
    check_headers(gathered, group, True, "")


try:
    torch.is_autocast_enabled("cpu")

    def _autocast_on(device_type: str) -> bool:
        return torch.is_autocast_enabled(device_type)
except TypeError:  # torch < 2.4 style signature

    def _autocast_on(device_type: str) -> bool:
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def statistics_precision(x: torch.Tensor):
    """Autocast off around the per-channel math (merge, running stats, normalize): statistics stay fp32.

    Under autocast ``mm`` and friends would run in bf16/fp16; the kernels already take low
    precision inputs and weights with float32 statistics themselves.
    """
    device_type = x.device.type
    if device_type in ("cpu", "cuda") and _autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def cumulative_factor(num_batches_tracked: torch.Tensor, input_dtype: torch.dtype):
    """``momentum=None``'s factor, 1 / num_batches_tracked: a float where the counter lives on the host,
    else a device tensor in the statistics' dtype (no host read: the step stays capturable)."""
    if counts_on_host(num_batches_tracked):
        return 1.0 / float(num_batches_tracked)
    dtype = torch.float64 if input_dtype == torch.float64 else torch.float32
    return num_batches_tracked.to(dtype).reciprocal()


def counts_on_host(x: torch.Tensor) -> bool:
    """Whether the global count may be read on the host: only when ``x`` already lives there."""
    return x.device.type == "cpu"


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format
