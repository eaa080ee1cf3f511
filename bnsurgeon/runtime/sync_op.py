"""The sync layer as a custom op, for ``torch.compile(fullgraph=True)``.

Dynamo cannot trace the eager ``SyncBatchNormFunction`` without breaking the graph: its
collectives are Python calls with timeouts, the CPU path reads the global count on the
host, and the checkpoint stash is Python state. So under ``torch.compile`` the layer calls
two ops registered with ``torch.library.custom_op`` instead (forward and backward), each
with a fake implementation (shapes, dtypes and layout only) and the forward with autograd
registered. Dynamo and AOTAutograd see one opaque node per layer and direction; at run time
each node runs exactly the eager code (``sync_forward`` / ``sync_backward``): the same one
collective each way, the same layer header and timeout, the same exactness, the same
recompute handling. Nothing in the traced graph reads a value on the host or branches on
data: the global count travels as a (1,) tensor between the two ops, and an empty global
batch is handled inside the op exactly as in eager mode.

The process group travels as its name (``""`` for the default group) and the layer as the
integer token of its ``LayerIdentity`` (identity.py): custom ops take no Python objects.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .identity import HEADER, identity_for
from .kernels import stats_dtype
from .sync_function import _statistics_precision, counts_on_host, sync_backward, sync_forward, update_running_stats
from .recompute import recomputing


def _group(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _like(value: Tensor, reference: Tensor) -> Tensor:
    """``value`` in the layout the fake implementation promised (``empty_like(reference)``)."""
    if value.stride() == reference.stride() and value.dtype == reference.dtype:
        return value
    return torch.empty_like(reference).copy_(value)


@torch.library.custom_op("bnsurgeon::sync_batch_norm", mutates_args=())
def sync_batch_norm(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, remember: bool, group_name: str,
    world_size: int, layer: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, mean, var, invstd, total, header, counted): the synchronized normalization.

    The running statistics and ``num_batches_tracked`` are updated by the caller in traced
    torch ops (``update_compiled_stats``): an op with autograd must not mutate its inputs.
    ``counted`` is 1, or 0 for a checkpoint recompute, which must not count a batch or move
    the running statistics. ``remember`` is decided when tracing (grad mode off: the forward
    may be a reentrant checkpoint's original), because a compiled graph runs with grad off
    whatever the caller's mode.
    """
    identity = identity_for(layer)
    with _statistics_precision(x):
        y, _, stats = sync_forward(x, weight, bias, None, None, eps, 0.0, _group(group_name), world_size, identity,
                                   remember)
    total = stats.total
    if not isinstance(total, Tensor):
        total = torch.tensor([float(total)], dtype=stats.mean.dtype, device=stats.mean.device)
    counted = stats.mean.new_full((1,), 0.0 if recomputing() else 1.0)
    return _like(y, x), stats.mean.clone(), stats.var.clone(), stats.invstd.clone(), total.clone(), \
        stats.header.clone(), counted


@sync_batch_norm.register_fake
def _(x, weight, bias, eps, remember, group_name, world_size, layer):
    dtype = stats_dtype(x)
    channels = x.shape[1]
    stats = [x.new_empty((channels,), dtype=dtype) for _ in range(3)]
    return (torch.empty_like(x), *stats, x.new_empty((1,), dtype=dtype), x.new_empty((HEADER,), dtype=dtype),
            x.new_empty((1,), dtype=dtype))


def update_compiled_stats(running_mean, running_var, num_batches_tracked, mean, var, total, counted,
                          momentum: Optional[float]) -> None:
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
    update_running_stats(running_mean, running_var, mean, var, total * counted, factor)


@torch.library.custom_op("bnsurgeon::sync_batch_norm_backward", mutates_args=())
def sync_batch_norm_backward(
    grad_output: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, var: Tensor, invstd: Tensor,
    total: Tensor, header: Tensor, eps: float, group_name: str, world_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_input, grad_weight, grad_bias) with ONE sum over the ranks."""
    count = int(total.item()) if counts_on_host(x) else total  # on the host already there
    with _statistics_precision(grad_output):
        grad_input, grad_weight, grad_bias = sync_backward(grad_output, x, weight, mean, var, invstd, header, count,
                                                           eps, _group(group_name), world_size)
    return _like(grad_input, x), grad_weight, grad_bias


@sync_batch_norm_backward.register_fake
def _(grad_output, x, weight, mean, var, invstd, total, header, eps, group_name, world_size):
    dtype = weight.dtype if weight is not None else mean.dtype
    channels = x.shape[1]
    return torch.empty_like(x), x.new_empty((channels,), dtype=dtype), x.new_empty((channels,), dtype=dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, eps, remember, group_name, world_size, layer = inputs
    _, mean, var, invstd, total, header, counted = output
    ctx.mark_non_differentiable(mean, var, invstd, total, header, counted)
    ctx.save_for_backward(x, weight, mean, var, invstd, total, header)
    ctx.eps, ctx.group_name, ctx.world_size = eps, group_name, world_size
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None


def _backward(ctx, grad_y, *_):
    x, weight, mean, var, invstd, total, header = ctx.saved_tensors
    grad_input, grad_weight, grad_bias = sync_batch_norm_backward(
        grad_y, x, weight, mean, var, invstd, total, header, ctx.eps, ctx.group_name, ctx.world_size
    )
    return grad_input, grad_weight if ctx.has_weight else None, grad_bias if ctx.has_bias else None, \
        None, None, None, None, None


sync_batch_norm.register_autograd(_backward, setup_context=_setup_context)
