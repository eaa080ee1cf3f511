"""The sync layer under ``torch.compile(fullgraph=True)``: traced math, two opaque collectives.

Dynamo cannot trace the eager ``SyncBatchNormFunction`` without breaking the graph: its
collectives are Python calls with timeouts, the CPU path reads the global count on the
host, and the checkpoint stash is Python state. Under ``torch.compile`` the layer runs
``sync_batch_norm`` below instead, where only what must be opaque is:

* traced (aten ops inductor fuses like its own batch norm: the statistics into one
  reduction over the input, the normalization into the activation after it): the local
  (mean, biased var) (``torch.var_mean``), the normalization, the running-stat update, and
  autograd through all of them;
* opaque, two ops registered with ``torch.library.custom_op`` (fake implementations give
  shapes only): ``sync_statistics``, which runs the eager layer's own step (``global_stats``
  in sync_function.py: header, ONE all_gather, header check, Chan merge, the one-value
  check, a checkpoint recompute's fallback), and ``sum_statistic_grads``, its backward's
  ONE sum over the ranks (with the forward's header on the CPU). The merge's derivative is
  written out in ``_statistics_backward`` in traced ops. Both ops are marked side-effectful,
  so no dead-code elimination drops a collective whose result a rank does not read.

An empty local batch does not come here: traced, it would leave only zero-element tensors,
which carry no data dependency, and inductor dropped and reordered that rank's collectives.
The layer runs eagerly for it instead (``SyncBatchNorm._normalize_eagerly``, a graph break).

So a compiled layer issues the same collectives as an eager one, one each way; nothing in
the traced graph reads a value on the host or branches on data (the global count travels as
a (1,) tensor, an all-empty global batch is exact through clamped weights). Gradients equal the
eager layer's to rounding: the chain rule through var_mean and the merge is the same
formula the eager backward evaluates in fused form.

The process group travels as its name (``""`` for the default group) and the layer as the
integer token of its ``LayerIdentity`` (identity.py): custom ops take no Python objects.
"""

# no ``from __future__ import annotations``: torch.library.custom_op reads the ops' annotations as objects, and
# torch 2.4's schema inference takes typing.List/Tuple (not list[int] or strings)
from typing import List, Optional, Tuple  # noqa: UP035

import torch
from torch import Tensor

from bnsurgeon.runtime.identity import COMPILED_BACKWARD, HEADER, identity_for
from bnsurgeon.runtime.kernels import channel_view, stats_dtype
from bnsurgeon.runtime.recompute import recomputing
from bnsurgeon.runtime.sync_function import (
    counts_on_host,
    global_stats,
    local_count,
    statistics_precision,
    sum_over_ranks,
    update_running_stats,
)


def _group(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]  # GroupName is a NewType of str


@torch.library.custom_op("bnsurgeon::sync_statistics", mutates_args=())
def sync_statistics(
    local_mean: Tensor,
    local_var: Tensor,
    shape: List[int],  # noqa: UP006
    input_dtype: torch.dtype,
    eps: float,
    group_name: str,
    world_size: int,
    layer: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # noqa: UP006
    """(mean, var, total, header, counted, share) of the global batch: the eager layer's own step.

    ``share`` is this rank's count over the global count (0 if that is 0), for the backward:
    computed here rather than traced, because under dynamic shapes the local count is a
    symbolic size that inductor cannot divide a float tensor by.

    ``counted`` is 1, or 0 for a checkpoint recompute, which must not count a batch or move
    the running statistics. Nothing is stashed for a recompute: the local statistics are
    traced, and a recompute in another compiled graph (inductor may generate the reduction
    differently) need not reproduce them bit for bit, which could leave one rank's recompute
    recognised and another's not. So a compiled recompute synchronizes again, on every rank
    alike: exact, one more collective, running statistics untouched (recompute.py).
    """
    identity = identity_for(layer)
    replay = recomputing()
    stats = global_stats(
        local_mean, local_var, shape, input_dtype, eps, _group(group_name), world_size, identity, False, replay
    )
    total = stats.total
    if not isinstance(total, Tensor):
        total = torch.tensor([float(total)], dtype=stats.mean.dtype, device=stats.mean.device)
    counted = torch.full((1,), 0.0 if replay else 1.0, dtype=stats.mean.dtype, device=stats.mean.device)
    share = torch.full((1,), float(local_count(shape)), dtype=total.dtype, device=total.device)
    share.div_(total.clamp(min=1))
    assert stats.var is not None and stats.header is not None  # global_stats always fills both
    return stats.mean.clone(), stats.var.clone(), total.clone(), stats.header.clone(), counted, share


@sync_statistics.register_fake
def _(local_mean, local_var, shape, input_dtype, eps, group_name, world_size, layer):
    scalar = torch.empty(1, dtype=local_mean.dtype, device=local_mean.device)
    return (
        torch.empty_like(local_mean),
        torch.empty_like(local_var),
        scalar,
        torch.empty(HEADER, dtype=local_mean.dtype, device=local_mean.device),
        torch.empty_like(scalar),
        torch.empty_like(scalar),
    )


@torch.library.custom_op("bnsurgeon::sum_statistic_grads", mutates_args=())
def sum_statistic_grads(packed: Tensor, header: Tensor, group_name: str, world_size: int) -> Tensor:
    """``packed`` summed over the ranks: ONE collective, headed on the CPU like the eager backward's."""
    # a copy: on devices the sum is an in-place all_reduce, and a custom op may not mutate its input
    return sum_over_ranks(
        header, packed.clone(), counts_on_host(packed), _group(group_name), world_size, phase=COMPILED_BACKWARD
    )


@sum_statistic_grads.register_fake
def _(packed, header, group_name, world_size):
    return torch.empty_like(packed)


def _setup_statistics(ctx, inputs, output) -> None:
    local_mean, _, _, _, _, group_name, world_size, _ = inputs
    mean, _, total, header, counted, share = output
    ctx.mark_non_differentiable(total, header, counted, share)
    ctx.save_for_backward(local_mean, mean, share, header)
    ctx.group_name, ctx.world_size = group_name, world_size


def _statistics_backward(ctx, grad_mean, grad_var, *_):
    """Gradient of the Chan merge for this rank's row, from the gradients summed over the ranks.

    mean = sum_r w_r m_r and var = sum_r w_r (v_r + (m_r - mean)^2) with w_r = n_r / n give
    d/dm_r = w_r (G_mean + 2 (m_r - mean) G_var) and d/dv_r = w_r G_var, where G is the
    gradient of every rank's loss with respect to the global statistics: one sum over ranks.
    """
    local_mean, mean, weight, header = ctx.saved_tensors
    grad_mean = torch.zeros_like(mean) if grad_mean is None else grad_mean
    grad_var = torch.zeros_like(mean) if grad_var is None else grad_var
    summed = sum_statistic_grads(torch.cat([grad_mean, grad_var]), header, ctx.group_name, ctx.world_size)
    global_grad_mean, global_grad_var = summed.chunk(2)
    grad_local_var = global_grad_var * weight
    grad_local_mean = (local_mean - mean).mul_(2 * grad_local_var).add_(global_grad_mean * weight)
    return grad_local_mean, grad_local_var, None, None, None, None, None, None


sync_statistics.register_autograd(_statistics_backward, setup_context=_setup_statistics)


def _local_statistics(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(mean, biased var) of this rank's (non-empty) batch per channel, as traced ops."""
    var, mean = torch.var_mean(x.to(dtype), [0, *range(2, x.dim())], correction=0)
    return mean, var


def sync_batch_norm(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    group_name: str,
    world_size: int,
    layer: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, mean, var, total, counted): the synchronized batch norm as the compiled graph runs it.

    The running statistics are updated by the caller (``update_compiled_stats``). ``x`` is
    not empty: an empty batch runs the eager layer (layers.py), because traced math on
    zero-element tensors carries no data dependency and inductor then dropped and reordered
    that rank's collectives.
    """
    dtype = stats_dtype(x)
    with statistics_precision(x):
        local_mean, local_var = _local_statistics(x, dtype)
        mean, var, total, _, counted, _ = sync_statistics(
            local_mean, local_var, list(x.shape), x.dtype, eps, group_name, world_size, layer
        )
        scale = torch.rsqrt(var + eps)
        if weight is not None:
            scale = scale * weight.to(dtype)
        ndim = x.dim()
        y = (x.to(dtype) - channel_view(mean, ndim)) * channel_view(scale, ndim)
        if bias is not None:
            y = y + channel_view(bias.to(dtype), ndim)
    return y.to(x.dtype), mean, var, total, counted


def update_compiled_stats(
    running_mean, running_var, num_batches_tracked, mean, var, total, counted, momentum: Optional[float]
) -> None:
    """The running-stat update of the compiled path, as traced tensor ops: no host read, no branch.

    ``total * counted`` is the count the update sees: 0 for an empty global batch or a
    recompute, which leaves the statistics exactly as they were (a lerp by 0).
    """
    if num_batches_tracked is not None:
        num_batches_tracked.add_(counted.to(num_batches_tracked.dtype).view(()))
    if momentum is None:
        factor = 1.0 / num_batches_tracked.to(mean.dtype).clamp(min=1) if num_batches_tracked is not None else 0.0
    else:
        factor = momentum
    update_running_stats(running_mean, running_var, mean.detach(), var.detach(), total * counted, factor)


def _never_dropped() -> None:
    """Mark both ops side-effectful: a collective must run on every rank even where nothing
    reads its result, so no dead-code elimination (FX's or inductor's, through
    ``torch._library.utils.is_impure``) may remove a call."""
    from torch.fx.node import _side_effectful_functions

    _side_effectful_functions.add(torch.ops.bnsurgeon.sync_statistics.default)
    _side_effectful_functions.add(torch.ops.bnsurgeon.sum_statistic_grads.default)


_never_dropped()
