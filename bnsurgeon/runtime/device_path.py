"""The eager sync layer on CUDA: torch's fused sync-BN kernels, few launches, no host sync.

On a GPU the layer is host-bound (DESIGN.md, "The runtime layers"): every op dispatched
costs more host time than its kernel costs the GPU. So this path is written for the
count of ops it dispatches (``tests/test_device_path.py`` counts them on CPU, with
strict stand-ins for the CUDA kernels, against a bound), and it reads nothing back:

forward   ``batch_norm_stats`` -> header advance -> ONE row ``[header, mean, invstd, count]``
          -> ONE all_gather -> header check (a device assert) -> rows ordered by count,
          largest first -> ``batch_norm_gather_stats_with_counts`` (merge, invstd and
          running statistics in one kernel) -> ``batch_norm_elemt``
backward  ``batch_norm_backward_reduce`` -> ONE all_reduce of ``[sum_dy, sum_dy_xmu]``
          -> ``batch_norm_backward_elemt``

Why the rows are ordered: the merge kernel divides by the count merged so far, so a
leading row of count 0 (an empty rank) makes every statistic NaN. torch's own layer drops
empty rows with a boolean mask, a host sync that breaks CUDA graphs (pytorch#78549). In
decreasing count order an empty row can only follow a non-empty one, where its weight is
exactly 0; every rank sorts the same rows, so every rank computes the same bits.

The kernels' dtype rules (the stand-ins enforce them): statistics in float32 (float64
for float64 inputs); ``batch_norm_elemt`` and ``batch_norm_backward_reduce`` take the
affine parameters in the input's dtype or the statistics'; ``batch_norm_backward_elemt``
only in the statistics' dtype (a half model's weight is cast, as torch's layer does); the
merge kernel reads counts and running statistics in one dtype. A model cast to half
keeps half running statistics, and half counts are not exact past 2048, so the merge then
runs on copies in the statistics' dtype, written back once (float math, half storage, as
plain BN's kernel does). A rank whose own batch is empty cannot know whether the global
batch is empty too (plain BN then leaves the running statistics alone): it merges into
copies and keeps them only where the global count is positive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bnsurgeon.core.torch_versions import has
from bnsurgeon.runtime import gaps
from bnsurgeon.runtime.device_checks import device_assert, short_name
from bnsurgeon.runtime.identity import HEADER, header_mismatch_message
from bnsurgeon.runtime.recompute import GlobalStats


def stats_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype the CUDA kernels accumulate and return statistics in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _count_tensor(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (1,) tensor of this rank's count: one fill kernel whose value is a launch argument.

    Not cached: a captured CUDA graph reads the very tensor it recorded, so a cache that
    evicted one (multi-scale training, ragged last batches) left a graph reading freed memory,
    and a cache miss during capture recorded the fill instead of running it.
    """
    return torch.full((1,), count, dtype=dtype, device=device)


#: torch >= 2.13 deprecates all_gather_into_tensor (a warning per call) for all_gather_single (torch_versions.py)
_GATHER = "all_gather_single" if has("all_gather_single") else "all_gather_into_tensor"


def all_gather_into(gathered: torch.Tensor, row: torch.Tensor, group) -> None:
    """ONE all_gather, stream-ordered: no host wait (a separate ``wait()`` is a second profiler record)."""
    getattr(dist, _GATHER)(gathered, row, group=group)


def all_reduce_into(packed: torch.Tensor, group) -> None:
    """ONE in-place sum over the ranks, stream-ordered."""
    dist.all_reduce(packed, group=group)


def _affine_for(x: torch.Tensor, weight, bias, stats_dtype: torch.dtype):
    """Weight and bias as the forward kernels take them: both in the input's dtype or both in the statistics'."""
    allowed = (x.dtype, stats_dtype)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        return weight.to(stats_dtype), bias.to(stats_dtype)
    if weight is not None and weight.dtype not in allowed:
        weight = weight.to(stats_dtype)
    if bias is not None and bias.dtype not in allowed:
        bias = bias.to(stats_dtype)
    return weight, bias


def forward(
    x,
    weight,
    bias,
    running_mean,
    running_var,
    eps: float,
    momentum,
    group,
    world_size: int,
    identity,
    replay: bool,
):
    """(y, GlobalStats) of the synchronized batch norm of ``x`` (a CUDA tensor in its memory format).

    ``momentum``: a float, or a device tensor holding the factor (``momentum=None``: the cumulative
    average, 1 / num_batches_tracked, never read on the host). ``replay`` (a checkpoint recompute)
    synchronizes again with the last call's header and leaves the running statistics alone: a device
    layer stashes nothing for a recompute (recompute.py).
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    stats_dtype = stats_dtype_of(x.dtype)
    device = x.device  # read once: each read builds a torch.device on the host
    if count:
        local_mean, local_invstd = torch.batch_norm_stats(x, eps)
    else:  # an empty rank still joins: count 0, and a finite invstd so that its weight 0 is exact
        local_mean = torch.zeros(channels, dtype=stats_dtype, device=device)
        local_invstd = torch.ones(channels, dtype=stats_dtype, device=device)
    name = identity.name if identity is not None else "<anonymous>"
    if identity is not None:
        header = identity.header_for(device, x.dtype, channels, stats_dtype, advance=not replay, group=group)
    else:
        header = torch.zeros(HEADER, dtype=stats_dtype, device=device)
    row = torch.cat([header, local_mean, local_invstd, _count_tensor(count, stats_dtype, device)])
    # flat: gloo's all_gather requires it; torch.Tensor's own new_empty, never a subclass's (MONAI's takes no int
    # size), at new_empty's host cost (torch.empty's dtype and device keywords cost more)
    flat = torch.Tensor.new_empty(row, world_size * row.numel())
    all_gather_into(flat, row, group)
    gathered = flat.view(world_size, -1)

    counts, order = gathered.select(1, -1).sort(descending=True, stable=True)
    headers, means, invstds, _ = gathered.index_select(0, order).split([HEADER, channels, channels, 1], dim=1)
    device_assert((headers == header).all(), header_mismatch_message(name))
    if count <= 1:  # only a rank holding at most one value can be part of a global batch of one
        device_assert(counts.sum() != 1, one_value_message(x.shape, world_size, short_name(name)))

    mean, invstd = _merge(
        means,
        invstds,
        counts,
        running_mean,
        running_var,
        eps,
        momentum,
        stats_dtype,
        empty_here=count == 0,
        update=not replay,
    )
    recorder = gaps.current()  # bnsurgeon run --stats: keeps the rows gathered here (no op, no host read)
    if recorder is not None and identity is not None and not replay:
        _, rank_means, rank_invstds, rank_counts = gathered.split([HEADER, channels, channels, 1], dim=1)
        recorder.record(identity, rank_counts, rank_means, rank_invstds, mean, invstd, eps, x.shape, invstd=True)
    stats = GlobalStats(mean, None, invstd, counts.to(torch.int32), None)
    return _normalize(x, weight, bias, stats, eps), stats


def _merge(
    means, invstds, counts, running_mean, running_var, eps, momentum, stats_dtype, empty_here: bool, update: bool
):
    """Global (mean, invstd) from the ordered rows; the running statistics updated as plain BN's would be."""
    if not update or running_mean is None or running_var is None:
        return torch.batch_norm_gather_stats_with_counts(means, means, invstds, None, None, 0.0, eps, counts)
    if isinstance(momentum, torch.Tensor):
        return _merge_cumulative(means, invstds, counts, running_mean, running_var, eps, momentum, stats_dtype)
    direct = running_mean.dtype == stats_dtype and running_var.dtype == stats_dtype and not empty_here
    if direct:
        return torch.batch_norm_gather_stats_with_counts(
            means, means, invstds, running_mean, running_var, momentum, eps, counts
        )
    new_mean, new_var = running_mean.to(stats_dtype, copy=True), running_var.to(stats_dtype, copy=True)
    mean, invstd = torch.batch_norm_gather_stats_with_counts(
        means, means, invstds, new_mean, new_var, momentum, eps, counts
    )
    if empty_here:  # the global batch may be empty too: then the statistics stay as they were
        anything = counts.sum() > 0
        new_mean = torch.where(anything, new_mean, running_mean.to(stats_dtype))
        new_var = torch.where(anything, new_var, running_var.to(stats_dtype))
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return mean, invstd


def _merge_cumulative(means, invstds, counts, running_mean, running_var, eps, factor, stats_dtype):
    """The merge with a device-held momentum factor (``momentum=None``): the kernel writes the batch's
    mean and unbiased variance into zeroed copies (momentum 1: exactly the values), then one
    interpolation each, kept only where the global batch is not empty."""
    batch_mean = torch.zeros_like(means[0])
    batch_var = torch.zeros_like(means[0])
    mean, invstd = torch.batch_norm_gather_stats_with_counts(
        means, means, invstds, batch_mean, batch_var, 1.0, eps, counts
    )
    weight = torch.where(counts.sum() > 0, factor.to(stats_dtype), 0.0)
    for buffer, value in ((running_mean, batch_mean), (running_var, batch_var)):
        value = torch.where(weight > 0, value, 0.0)  # an empty global batch: NaN must not reach lerp
        buffer.copy_(buffer.to(stats_dtype).lerp(value, weight))
    return mean, invstd


def _normalize(x, weight, bias, stats: GlobalStats, eps: float) -> torch.Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    weight, bias = _affine_for(x, weight, bias, stats.mean.dtype)
    return torch.batch_norm_elemt(x, weight, bias, stats.mean, stats.invstd, eps)


def backward(grad_output, x, weight, stats_mean, stats_invstd, counts, group, needs_input_grad):
    """(grad_input or None, grad_weight, grad_bias): ONE all_reduce; grad_weight/bias stay local."""
    if x.numel() == 0:
        if needs_input_grad[0]:  # join the sum so that the other ranks are not left waiting
            packed = torch.zeros(2 * x.shape[1], dtype=stats_mean.dtype, device=x.device)
            all_reduce_into(packed, group)
        # parameter gradients of zeros, not None: DDP waits for a gradient of every parameter on every rank
        zeros = torch.zeros(x.shape[1], dtype=weight.dtype, device=x.device) if weight is not None else None
        return (
            torch.zeros_like(x) if needs_input_grad[0] else None,
            zeros if needs_input_grad[1] else None,
            zeros if needs_input_grad[2] else None,
        )
    param_dtype = weight.dtype if weight is not None else None
    weight_for_reduce = weight
    if weight is not None and weight.dtype not in (x.dtype, stats_mean.dtype):
        weight_for_reduce = weight.to(stats_mean.dtype)
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
        grad_output,
        x,
        stats_mean,
        stats_invstd,
        weight_for_reduce,
        needs_input_grad[0],
        weight is not None and needs_input_grad[1],
        weight is not None and needs_input_grad[2],
    )
    grad_input = None
    if needs_input_grad[0]:
        packed = torch.cat([sum_dy, sum_dy_xmu])
        all_reduce_into(packed, group)
        global_sum_dy, global_sum_dy_xmu = packed.split(x.shape[1])
        if weight is not None and weight.dtype != stats_mean.dtype:
            weight = weight.to(stats_mean.dtype)
        grad_input = torch.batch_norm_backward_elemt(
            grad_output, x, stats_mean, stats_invstd, weight, global_sum_dy, global_sum_dy_xmu, counts
        )
    return grad_input, _as_param(grad_weight, param_dtype), _as_param(grad_bias, param_dtype)


def _as_param(grad, dtype):
    """A parameter's gradient in the parameter's dtype (None where the kernel computed none)."""
    if grad is None or dtype is None or grad.numel() == 0:
        return None
    return grad if grad.dtype == dtype else grad.to(dtype)


def one_value_message(shape, world_size: int, name: str) -> str:
    """torch's words for a batch with one value per channel, for the global batch."""
    return (
        f"Expected more than 1 value per channel when training, got input size {tuple(shape)} on this rank "
        f"and 1 value per channel over all {world_size} ranks of sync batch norm '{name}'"
    )
