"""The autograd Function behind bnsurgeon's synchronized batch norm.

Forward: local (count, mean, biased var) -> ONE all_gather -> Chan merge weighted by
counts -> running-stat update -> normalize. Backward: local sum(dy) and the kernel's
reduced term -> ONE sum over ranks of both packed together (an all_reduce on devices,
an all_gather + local sum on CPU, see collectives.py) -> input gradient. grad_weight
and grad_bias stay local (DDP averages parameter gradients itself). See DESIGN.md, "The
runtime layers". Every op here is on (C,)-sized tensors except the kernels' passes, and
on CPU the global count is read on the host (there is no device to synchronize with).
On any other device nothing is ever read back: the count stays a device tensor, so the
layer can run inside CUDA graph capture (tests run this path on meta tensors, which
raise on any host read).
"""

from __future__ import annotations

import torch

from . import debug
from .collectives import all_gather_rows, all_reduce_sum
from .kernels import kernels_for


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


def update_running_stats(running_mean, running_var, mean, var, total, momentum: float) -> None:
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
    """Batch norm over the union of all ranks' batches in ``group``."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world_size, layer):
        kernels = kernels_for(x)
        if x.is_cuda:
            x = x.contiguous(memory_format=_memory_format(x))
        channels = x.shape[1]
        local_mean, local_var, centred = kernels.local_stats(x, eps)
        count = local_mean.new_full((1,), x.numel() // max(channels, 1))
        local = torch.cat([count, local_mean, local_var])

        if debug.enabled():
            debug.check_same_layer(layer, world_size, group, x.device)
        gathered = all_gather_rows(local, world_size, group)
        total, mean, var = merge_stats(gathered, channels)
        if counts_on_host(x):
            total = int(total.item())  # a host read is free on CPU and saves ~10 small ops
        invstd = torch.rsqrt(var + eps)
        update_running_stats(running_mean, running_var, mean, var, total, momentum)

        y = kernels.normalize(x, weight, bias, mean, var, invstd, eps, centred)
        ctx.save_for_backward(x, weight, mean, var, invstd)
        ctx.total = total
        ctx.eps = eps
        ctx.group = group
        ctx.world_size = world_size
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, var, invstd = ctx.saved_tensors
        kernels = kernels_for(x)
        if x.is_cuda:
            grad_output = grad_output.contiguous(memory_format=_memory_format(x))
        sum_dy, sum_term, sum_dy_xhat = kernels.backward_reduce(grad_output, x, weight, mean, invstd, ctx.eps)

        grad_input = None
        if ctx.needs_input_grad[0]:
            packed = all_reduce_sum(torch.cat([sum_dy, sum_term]), ctx.world_size, ctx.group)
            global_sum_dy, global_sum_term = packed.chunk(2)
            grad_input = kernels.grad_input(
                grad_output, x, weight, mean, var, invstd, ctx.eps, global_sum_dy, global_sum_term, ctx.total
            )

        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else sum_dy.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def counts_on_host(x: torch.Tensor) -> bool:
    """Whether the global count may be read on the host: only when ``x`` already lives there."""
    return x.device.type == "cpu"


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format
