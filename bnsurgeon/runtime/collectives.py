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

import re
import time
from typing import Any, Callable, cast

import torch
import torch.distributed as dist

from bnsurgeon.core.errors import DistributedTimeoutError, first_line
from bnsurgeon.core.torch_versions import flat_all_gather
from bnsurgeon.runtime.timeout import collective_timeout

_flat_all_gather = flat_all_gather()


#: how gloo says a peer's end went away (it died or left the group): not a timeout
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset|Broken pipe", re.IGNORECASE)


def group_timeout_s(group) -> float | None:
    """The process group's own timeout (``init_process_group(timeout=...)``), where torch says it."""
    try:
        backend = cast(Any, group if group is not None else dist.group.WORLD)._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:  # not gloo, or a torch without these names
        return None


def _finish(work, local: torch.Tensor, describe: Callable[[], str] | None, group=None) -> None:
    """Wait for ``work`` (issued async on the CPU only) within the bound. The error names what ended the wait:
    BNSURGEON_DIST_TIMEOUT, the process group's own timeout where it is the shorter, or a peer that left."""
    if work is None:  # a device collective: issued stream-ordered, nothing to wait for on the host
        return
    timeout = collective_timeout()
    started = time.monotonic()
    try:
        work.wait(timeout)
    except RuntimeError as error:
        waited = time.monotonic() - started
        what = describe() if describe is not None else "a bnsurgeon collective"
        said = re.sub(r"^\[[^\]]*\]\s*", "", first_line(error, "no message"))[:300]  # gloo's [file:line] off
        bound = timeout.total_seconds()
        if _PEER_GONE.search(said):
            raise DistributedTimeoutError(
                f"{what} was cut off after {waited:.1f} s: another rank of its group closed its connection "
                f"(it died or left the group). Backend said: {said}"
            ) from error
        own = group_timeout_s(group)
        if own is not None and own < bound:
            fired = (
                f"{own:g} s, the process group's own timeout (init_process_group(timeout=...); "
                f"BNSURGEON_DIST_TIMEOUT is {bound:g} s)"
            )
        elif own is None and waited < 0.9 * bound:
            fired = (
                f"{waited:.1f} s, a timeout of the process group's shorter than BNSURGEON_DIST_TIMEOUT's {bound:g} s"
            )
        else:
            fired = f"{bound:g} s (BNSURGEON_DIST_TIMEOUT)"
        raise DistributedTimeoutError(
            f"{what} did not complete within {fired}: another rank of its group skipped this layer, ran a "
            f"different number of train-mode forwards, or died. Backend said: {said}"
        ) from error


def all_gather_rows(
    local: torch.Tensor, world_size: int, group, describe: Callable[[], str] | None = None
) -> torch.Tensor:
    """One all_gather of a 1-D tensor; row r of the result is rank r's tensor.

    The output is allocated flat because gloo's flat all_gather requires it, with ``torch.empty``: a tensor
    subclass's own ``new_empty`` may take narrower arguments (MONAI's MetaTensor takes no int size).
    """
    gathered = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
    on_cpu = local.device.type == "cpu"
    _finish(_flat_all_gather(gathered, local, group=group, async_op=on_cpu), local, describe, group)
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
        _finish(dist.all_reduce(local, group=group), local, describe, group)
        return local
    return all_gather_rows(local, world_size, group, describe).sum(0)
