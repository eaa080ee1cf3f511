"""Synchronized batch norm across the replicas of ``nn.DataParallel`` (one process, threads).

``nn.DataParallel`` has no process group: each forward it copies the model onto every
device (``torch.nn.parallel.replicate``, every copy marked ``_is_replica``) and runs the
copies in threads (``parallel_apply``) on slices of the batch. A sync layer that only
looked for a process group would run plain BN on each slice, silently. Here:

- **Which replicas meet**: ``SyncBatchNorm._replicate_for_data_parallel`` enrols every
  copy of a layer in a ``ReplicaGroup``: the copies of one layer made before any of them
  runs. The group closes at its first exchange with the copies still alive then, indexed
  in the order they were made (``replicate`` makes copy ``j`` for device ``j``). Nothing is
  read from torch's frames, so any replicate function works, and copies of a ``replicate``
  whose forward never ran (dropped by then) do not count.
- **Forward**: each replica puts its (count, mean, biased var) row in the group; when
  every replica has arrived each one merges all rows with the same Chan merge as across
  ranks (``merge_stats``: uneven and empty slices exact), updates its running statistics
  with the global count and normalizes. Replica 0's buffers are the original module's
  (DataParallel broadcasts onto the source device without a copy), so the model that
  DataParallel keeps holds exactly the statistics of one device on the whole batch.
- **Backward**: sum(dy) and the reduced term are summed over the replicas the same way;
  grad_weight and grad_bias stay per replica (DataParallel sums them into the original
  parameters). Autograd runs each device's part of the backward in its own thread, so
  the replicas' backwards meet like their forwards.
- **Bounded**: every meeting waits at most ``BNSURGEON_DIST_TIMEOUT`` (``collective_timeout``);
  a replica that never arrives is a ``DistributedTimeoutError`` naming the layer and the
  missing replicas. A replica that fails stops the others at once (``ReplicaFailedError``):
  inside the layer, or anywhere in its forward before it (an out-of-memory in the stem),
  which a module forward hook that torch calls on the way out of a raising forward
  (``always_call``) reports; it is registered only while replica copies are alive. A failed
  group stays failed: nothing waits on it again.
- **Checkpointing**: a recomputed forward (``recomputing()``) takes the statistics its
  original forward stashed on the replica: no meeting, no second running-stat update.
- **torch.compile**: the replica path runs outside the graph (a graph break); with
  ``fullgraph=True`` dynamo refuses, quoting the alternative (torchrun + DDP).
- **Inside a distributed job** (torchrun with several ranks, DataParallel in each) the
  layer refuses: it would synchronize the replicas of one process only.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from bnsurgeon.core.errors import (
    DistributedMismatchError,
    DistributedTimeoutError,
    ReplicaFailedError,
    UsageError,
    first_line,
)
from bnsurgeon.runtime.device_checks import device_assert, short_name
from bnsurgeon.runtime.kernels import GenericKernels
from bnsurgeon.runtime.outside_compile import outside_compile
from bnsurgeon.runtime.recompute import may_be_recomputed, recomputing
from bnsurgeon.runtime.sync_function import (
    cumulative_factor,
    merge_stats,
    statistics_precision,
    update_running_stats,
)
from bnsurgeon.runtime.timeout import collective_timeout

if TYPE_CHECKING:
    from bnsurgeon.runtime.layers import SyncBatchNorm

#: the replica's attribute holding its ``ReplicaSlot`` (set on the copy only, never on the original)
SLOT_ATTRIBUTE = "_bnsurgeon_replica"
#: forwards whose statistics wait for their checkpoint recompute, per replica
STASH_LIMIT = 4

_COMPILE_REASON = (
    "bnsurgeon: a sync batch norm layer inside nn.DataParallel synchronizes its replicas' threads "
    "eagerly, outside the graph; compile without fullgraph=True, or train with torchrun + "
    "DistributedDataParallel (one process per GPU), whose sync path compiles whole"
)


class _Meeting:
    """One exchange: a row from each replica, read by all of them."""

    __slots__ = ("rows", "arrived", "read")

    def __init__(self, size: int) -> None:
        self.rows: list = [None] * size
        self.arrived = 0
        self.read = 0


class ReplicaGroup:
    """The copies of one layer made by one ``replicate`` call: they exchange rows in threads.

    ``size`` is None until the group closes (the first exchange) when torch's ``replicate``
    did not say how many copies it makes.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.size: Optional[int] = None
        self._members: list = []  # weak references to the copies, in the order they were made
        self._indices: dict[int, int] = {}  # serial -> index among the copies alive at the close
        self._condition = threading.Condition()
        self._meetings: dict[Any, _Meeting] = {}
        self._failure: Optional[BaseException] = None
        self.closed = False  # set by the first exchange: no copy joins after a replica has run

    def enrol(self, replica: nn.Module) -> int:
        """A new copy's serial number in the group."""
        with self._condition:
            self._members.append(weakref.ref(replica))
            return len(self._members) - 1

    def index_of(self, serial: int) -> int:
        """The replica index of the copy enrolled as ``serial`` (its enrolment order, before the close)."""
        return self._indices.get(serial, serial)

    def _close(self) -> None:
        """No copy joins once one has run; the copies alive now are the replicas, in the order made."""
        self.closed = True
        live = [serial for serial, member in enumerate(self._members) if member() is not None]
        self._indices = {serial: index for index, serial in enumerate(live)}
        self.size = len(live)

    def fail(self, error: BaseException) -> None:
        """Stop every replica waiting in this group (and every later exchange) with ``error``."""
        with self._condition:
            if self._failure is None:
                self._failure = error
            self.closed = True  # no copy of a later replicate joins a failed group
            self._condition.notify_all()

    def exchange(self, key: Any, serial: int, row: torch.Tensor, what: str) -> list:
        """Every replica's ``row`` for meeting ``key``, in replica order; waits at most the collective timeout."""
        timeout = collective_timeout().total_seconds()
        deadline = time.monotonic() + timeout
        with self._condition:
            if not self.closed:
                self._close()
            index = self.index_of(serial)
            self._raise_if_failed(index)
            size = self.size
            assert size is not None  # set when the group closed, just above
            meeting = self._meetings.get(key)
            if meeting is None:
                meeting = self._meetings[key] = _Meeting(size)
            if meeting.rows[index] is not None:
                raise UsageError(
                    f"DataParallel replica {index} of sync batch norm '{self.name}' ran {what} twice",
                    "call each replica once per forward, as nn.DataParallel does",
                )
            meeting.rows[index] = row
            meeting.arrived += 1
            if meeting.arrived == size:
                self._condition.notify_all()
            while meeting.arrived < size and self._failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [i for i, r in enumerate(meeting.rows) if r is None]
                    self._failure = DistributedTimeoutError(
                        f"sync batch norm '{self.name}' {what}: DataParallel replica(s) {missing} of {self.size} did "
                        f"not arrive within {timeout:g} s (BNSURGEON_DIST_TIMEOUT): they raised before reaching "
                        "this layer, skipped it, or ran it a different number of times"
                    )
                    self._condition.notify_all()
                    break
                self._condition.wait(remaining)
            if meeting.arrived < size:
                self._raise_if_failed(index)
            rows = list(meeting.rows)
            meeting.read += 1
            if meeting.read == self.size:
                del self._meetings[key]
        shapes = {tuple(r.shape) for r in rows}
        if len(shapes) > 1:
            widths = ", ".join(f"replica {i}: {r.shape[0]}" for i, r in enumerate(rows))
            raise DistributedMismatchError(
                f"sync batch norm '{self.name}' {what}: DataParallel replicas sent rows of different sizes ({widths}); "
                "every replica must give this layer inputs with the same number of channels and the same dtype"
            )
        return rows

    def _raise_if_failed(self, index: int) -> None:
        failure = self._failure
        if failure is None:
            return
        if isinstance(failure, (DistributedTimeoutError, ReplicaFailedError)):
            raise type(failure)(str(failure))
        raise ReplicaFailedError(
            f"sync batch norm '{self.name}': another DataParallel replica failed in this layer, so replica {index} "
            f"stops instead of waiting for it: {type(failure).__name__}: {str(failure).splitlines()[0][:300]}"
        )


class _Stats(NamedTuple):
    mean: torch.Tensor
    var: torch.Tensor
    invstd: torch.Tensor
    total: Any  # int on the CPU, a (1,) tensor on devices
    call: int


class ReplicaSlot:
    """One replica's place in its group: its serial (the index once the group closes), forward count and
    checkpoint stash."""

    def __init__(self, group: ReplicaGroup, serial: int) -> None:
        self.group = group
        self.serial = serial
        self.calls = 0
        self.stash: deque = deque(maxlen=STASH_LIMIT)

    @property
    def index(self) -> int:
        return self.group.index_of(self.serial)


#: original layer -> the group its copies are joining during the current ``replicate`` call
_forming: "weakref.WeakKeyDictionary[nn.Module, ReplicaGroup]" = weakref.WeakKeyDictionary()
#: reentrant: a copy's finalizer (``_copy_gone``) takes it, and the cyclic collector may run one while it is held
_forming_lock = threading.RLock()


def enrol(original: nn.Module, replica: nn.Module, name: str) -> nn.Module:
    """Give ``replica`` (a fresh copy of ``original``) its place among the copies of this ``replicate`` call."""
    with _forming_lock:
        group = _forming.get(original)
        if group is None or group.closed:
            group = _forming[original] = ReplicaGroup(name)
        serial = group.enrol(replica)
        _watch_failures(replica)
    replica.__dict__[SLOT_ATTRIBUTE] = ReplicaSlot(group, serial)
    return replica


#: the forward hook that reports a replica raising before its sync layers, while any copy is alive
_failure_watch: dict = {"handle": None, "copies": 0}


def _watch_failures(replica: nn.Module) -> None:
    """Keep the failure hook registered while ``replica`` lives (called under ``_forming_lock``)."""
    if _failure_watch["handle"] is None:
        _failure_watch["handle"] = torch.nn.modules.module.register_module_forward_hook(
            _after_replica_forward, always_call=True
        )
    _failure_watch["copies"] += 1
    weakref.finalize(replica, _copy_gone)


def _copy_gone() -> None:
    with _forming_lock:
        _failure_watch["copies"] -= 1
        if _failure_watch["copies"] == 0 and _failure_watch["handle"] is not None:
            _failure_watch["handle"].remove()
            _failure_watch["handle"] = None


def _after_replica_forward(module: nn.Module, args: Any, output: Any) -> None:
    """On the way out of a replica's raising forward: the sync layers inside it stop their peers now."""
    if output is not None or not getattr(module, "_is_replica", False) or recomputing():
        return  # a checkpoint recompute exchanges nothing, and non-reentrant checkpointing stops it by raising
    error = sys.exc_info()[1]
    if error is None or isinstance(error, (DistributedTimeoutError, ReplicaFailedError, DistributedMismatchError)):
        return
    said = first_line(error, "")
    for inner in module.modules():
        slot = inner.__dict__.get(SLOT_ATTRIBUTE)
        if slot is not None:  # it may have passed this layer already: the others stop wherever they wait
            slot.group.fail(
                ReplicaFailedError(
                    f"sync batch norm '{slot.group.name}': DataParallel replica {slot.index} failed in its forward, "
                    f"so the others stop instead of waiting for it: {type(error).__name__}: {said}"
                )
            )


def _refuse_inside_distributed_job(module: nn.Module, name: str) -> None:
    """DataParallel in each of several ranks: syncing the replicas alone would be a silent half."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = getattr(module, "process_group", None)
    world_size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if world_size > 1:
        raise UsageError(
            f"sync batch norm '{name}' is a DataParallel replica inside a distributed job of {world_size} ranks: "
            "bnsurgeon synchronizes either the DataParallel replicas of one process or the ranks of a process "
            "group, not both, and syncing the replicas alone would leave the ranks unsynchronized",
            "run one process per GPU with torchrun and DistributedDataParallel instead of nn.DataParallel",
        )


def normalize_replica(module: "SyncBatchNorm", x: torch.Tensor) -> torch.Tensor:
    """Train-mode forward of a DataParallel replica of a sync layer: statistics of the whole batch."""
    name = module.layer_name
    slot = module.__dict__.get(SLOT_ATTRIBUTE)
    if slot is None:
        raise UsageError(
            f"sync batch norm '{name}' is marked as a DataParallel replica but was not made by torch's replicate, "
            "so bnsurgeon cannot tell which replicas run together",
            "wrap the model in nn.DataParallel (or use torch.nn.parallel.replicate), or train with torchrun + "
            "DistributedDataParallel",
        )
    _refuse_inside_distributed_job(module, name)
    counts = not recomputing()  # a checkpoint recompute counts no batch
    factor = 0.0 if module.momentum is None else module.momentum
    running_mean = running_var = None
    if module.track_running_stats:
        running_mean, running_var = module.running_mean, module.running_var
        if module.num_batches_tracked is not None:
            if counts:
                module.num_batches_tracked.add_(1)
            if module.momentum is None:  # a float on the CPU, a device tensor elsewhere (no host read)
                factor = cumulative_factor(module.num_batches_tracked, x.dtype)
    return ReplicaSyncFunction.apply(x, module.weight, module.bias, running_mean, running_var, module.eps, factor, slot)


def _gathered(rows: list, device: torch.device) -> torch.Tensor:
    return torch.stack([row.to(device) for row in rows])


def _replica_stats(x: torch.Tensor, slot: ReplicaSlot, eps: float, kernels, replay: bool, remember: bool):
    """(stats, centred): the whole batch's statistics from every replica's row, or the stash on a recompute."""
    local_mean, local_var, centred = kernels.local_stats(x, eps)
    channels = x.shape[1]
    count = math.prod(x.shape) // max(channels, 1)
    row = torch.cat([torch.full((1,), count, dtype=local_mean.dtype, device=local_mean.device), local_mean, local_var])
    group = slot.group
    if replay:
        for index, (fingerprint, stats) in enumerate(slot.stash):
            if fingerprint.shape == row.shape and torch.equal(fingerprint, row):
                del slot.stash[index]  # by position: ``remove`` would compare other entries' tensors with ==
                return stats, centred
        raise UsageError(
            f"sync batch norm '{group.name}': a recomputed forward (activation checkpointing) of DataParallel "
            f"replica {slot.index} matches none of its forwards, and replicas cannot meet again during the backward",
            "checkpoint whole segments with torch.utils.checkpoint, or train with torchrun + DistributedDataParallel",
        )
    call = slot.calls
    slot.calls += 1
    rows = group.exchange(("forward", call), slot.serial, row, f"forward call {call}")
    counted, mean, var = merge_stats(_gathered(rows, row.device), channels)
    total: "int | torch.Tensor" = counted
    if x.device.type == "cpu":
        total = int(counted.item())
        if total == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)} on "
                f"DataParallel replica {slot.index} and 1 value per channel over all {group.size} replicas of "
                f"sync batch norm '{group.name}'"
            )
    else:
        device_assert(
            counted.ne(1), f"sync batch norm '{short_name(group.name)}': 1 value per channel over all replicas"
        )
    stats = _Stats(mean, var, torch.rsqrt(var + eps), total, call)
    if remember:
        slot.stash.append((row, stats))
    return stats, centred


class ReplicaSyncFunction(torch.autograd.Function):
    """Batch norm over the union of the replicas' slices, exchanged between their threads."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, slot):
        kernels = GenericKernels  # valid on every device; the replicas exchange rows between threads
        replay = recomputing()
        try:
            with statistics_precision(x):
                stats, centred = _replica_stats(x, slot, eps, kernels, replay, may_be_recomputed())
                if not replay:
                    update_running_stats(running_mean, running_var, stats.mean, stats.var, stats.total, momentum)
                y = kernels.normalize(x, weight, bias, stats.mean, stats.var, stats.invstd, eps, centred)
        except (DistributedTimeoutError, ReplicaFailedError, DistributedMismatchError):
            raise
        except BaseException as error:
            slot.group.fail(error)  # the others stop now instead of at the timeout
            raise
        ctx.save_for_backward(x, weight, stats.mean, stats.var, stats.invstd)
        ctx.total = stats.total
        ctx.eps = eps
        ctx.slot = slot
        ctx.call = stats.call
        ctx.backwards = 0
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, var, invstd = ctx.saved_tensors
        slot = ctx.slot
        kernels = GenericKernels  # valid on every device; the replicas exchange rows between threads
        backward_call = ctx.backwards
        ctx.backwards += 1
        grad_input = None
        try:
            with statistics_precision(grad_output):
                sum_dy, sum_term, sum_dy_xhat = kernels.backward_reduce(grad_output, x, weight, mean, invstd, ctx.eps)
                if ctx.needs_input_grad[0]:
                    packed = torch.cat([sum_dy, sum_term])
                    rows = slot.group.exchange(
                        ("backward", ctx.call, backward_call),
                        slot.serial,
                        packed,
                        f"backward of forward call {ctx.call}",
                    )
                    global_sum_dy, global_sum_term = _gathered(rows, packed.device).sum(0).chunk(2)
                    grad_input = kernels.grad_input(
                        grad_output, x, weight, mean, var, invstd, ctx.eps, global_sum_dy, global_sum_term, ctx.total
                    )
        except (DistributedTimeoutError, ReplicaFailedError, DistributedMismatchError):
            raise
        except BaseException as error:
            slot.group.fail(error)  # the others' backwards stop now instead of at the timeout
            raise
        param_dtype = weight.dtype if weight is not None else sum_dy.dtype
        grad_weight = sum_dy_xhat.to(param_dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(param_dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


outside_compile(sys.modules[__name__], "normalize_replica", _COMPILE_REASON)
