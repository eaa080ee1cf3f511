"""The collective shapes the sync layers use, in one place, each bounded in time.

A collective on CPU tensors is issued with ``async_op=True`` and waited on with the
``BNSURGEON_DIST_TIMEOUT`` bound (``timeout.py``; gloo honours ``Work.wait(timeout)``),
so a rank that never arrives is an error naming the layer, whoever initialised the
process group. On a device backend (NCCL) a collective is issued synchronously: it is
ordered on the current stream and the host does not wait (an async call's ``wait()``
would be a second profiler record per collective, and ``wait(timeout)`` would block the
host, which the sync layer must never do: CUDA graphs, overlap). There the bound is the
process group's own timeout and its watchdog (``init_distributed`` sets it from the same
variable).

The gather uses the torch version's own name for the flat all_gather:
``all_gather_single`` where it exists (``all_gather_into_tensor`` is deprecated there
and warns on every call), else ``all_gather_into_tensor`` (torch 2.4 to 2.13).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from bnsurgeon.core.errors import DistributedTimeoutError
from bnsurgeon.runtime.timeout import collective_timeout

_flat_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _finish(work, local: torch.Tensor, describe: Callable[[], str] | None) -> None:
    """Wait for ``work`` (issued async on the CPU only) within the bound."""
    if work is None:  # a device collective: issued stream-ordered, nothing to wait for on the host
        return
    timeout = collective_timeout()
    try:
        work.wait(timeout)
    except RuntimeError as error:
        what = describe() if describe is not None else "a bnsurgeon collective"
        raise DistributedTimeoutError(
            f"{what} did not complete within {timeout.total_seconds():g} s (BNSURGEON_DIST_TIMEOUT): "
            "another rank of its group skipped this layer, ran a different number of train-mode "
            f"forwards, or died. Backend said: {str(error).splitlines()[0][:300]}"
        ) from error


def all_gather_rows(
    local: torch.Tensor, world_size: int, group, describe: Callable[[], str] | None = None
) -> torch.Tensor:
    """One all_gather of a 1-D tensor; row r of the result is rank r's tensor.

    The output is allocated flat because gloo's flat all_gather requires it.
    """
    gathered = local.new_empty(world_size * local.numel())
    on_cpu = local.device.type == "cpu"
    _finish(_flat_all_gather(gathered, local, group=group, async_op=on_cpu), local, describe)
    return gathered.view(world_size, local.numel())


def all_reduce_sum(
    local: torch.Tensor, world_size: int, group, describe: Callable[[], str] | None = None
) -> torch.Tensor:
    """Sum of a small 1-D tensor over the group, identical on every rank.

    Off the CPU (NCCL and other device backends) an all_reduce. On CPU an all_gather
    plus a local sum: gloo's ring all_reduce needs twice the message rounds of its
    all_gather, and for the few KB of batch-norm statistics the rounds are the whole cost
    (2 ranks: median 383 vs 465 us, 3 ranks: 1183 vs 1956 us on this project's 2-core
    machine). The sync layer itself sends its CPU backward row through
    ``all_gather_rows`` (the row carries the layer check); this helper is the plain sum.
    """
    if local.device.type != "cpu":
        _finish(dist.all_reduce(local, group=group), local, describe)
        return local
    return all_gather_rows(local, world_size, group, describe).sum(0)
