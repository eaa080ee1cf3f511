"""The N-rank check under torchrun: each torchrun process is one rank, on the device it trains on.

``torchrun --nproc-per-node N -m bnsurgeon verify SOURCE CONVERTED`` starts no process of its own. Every rank
loads SOURCE and CONVERTED itself (a read of the same files, as every rank of a training job reads its
checkpoint), and the ranks prove they read the same bytes (``agree_on_files``: a sha256 of each file). Per variant, rank 0 computes the reference (the source on the whole batch, on its device) and sends
the batch's input and output gradient to the others; every rank runs the converted model on its slice; rank 0
gathers what they computed and judges it with ``-w N``'s comparison (``ranks.judge_ranks``: every rank's running
statistics too). The coordination runs over a gloo group of CPU objects whatever the backend, and every wait is
bounded by the run's timeout but one: rank 0's verdict on the checks it runs alone, after the group is closed,
which the others read from torchrun's store while rank 0 runs (``rank_0_alone``), so every rank ends alike.

Precision: ``float64`` on the device is judged as ``-w N`` judges it (1e-6 relative); ``float32`` and
``bf16-autocast`` run the ranks in the model's working precision and judge each quantity against plain BN's
own error in that precision, on the same device, measured in the same run (``within_measured``).

A rank the machine stops is named (``HostFailureError``, exit 16): one that died (its process gone; on this
node, its exit status where the kernel still holds it) or one stopped (SIGSTOP) or not answering within the
run's timeout.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from bnsurgeon.checks.check_input import CheckInput
from bnsurgeon.checks.compare import SEED, CheckOutcome, Tolerance, only_bn_trains, within
from bnsurgeon.checks.ranks import (
    DIST_RTOL,
    RankReference,
    judge_ranks,
    rank_batch,
    run_share,
    source_reference,
    uneven_splits,
)
from bnsurgeon.core.errors import BnSurgeonError, HostFailureError, RankEndedError, UsageError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

PRECISIONS = ("float64", "float32", "bf16-autocast")
DEVICES = ("auto", "cpu", "cuda")
#: below float64, a rank's error may be this many times plain BN's own (the merge sums in another order)
MEASURED_FACTOR = 2.0


def launched_by_torchrun() -> bool:
    """torchrun (its elastic agent: TORCHELASTIC_RUN_ID) started this process with its world's variables; another
    launcher's WORLD_SIZE (a Kubernetes job's pod, say) leaves verify's own -w N ranks as they are."""
    return all(name in os.environ for name in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID"))


def this_process() -> tuple:
    """(host, pid, machine, start time): ``machine`` is the kernel's boot id and this pid namespace, so that a
    peer is looked at by its pid only where that pid means the same process (containers share host names, pids
    are reused)."""
    host, pid = socket.gethostname(), os.getpid()
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        machine = f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
        start = _stat_fields(pid)[19]
    except (OSError, IndexError):
        return host, pid, None, None
    return host, pid, machine, start


def _stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat after the command name: field 3 (state) is index 0, so field N is index N - 3."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()


@dataclass
class TorchrunWorld:
    """This process's place in the check: its rank, the world, its device, and the gloo group that coordinates."""

    rank: int
    world_size: int
    device: "torch.device"
    backend: str
    group: Any  # gloo, CPU objects: the reference's batch out, the ranks' results in
    timeout_s: float
    peers: list  # this_process() of every rank
    #: torchrun's store, through a connection of this process's own: it outlives the process group, so rank 0 can
    #: tell the others the verdict of the checks it runs alone once the group is closed (``rank_0_alone``)
    store: Any = None

    @property
    def where(self) -> str:
        return f"{self.device} ({self.backend})"

    def rank_name(self, rank: int) -> str:
        host, pid = self.peers[rank][:2]
        return f"rank {rank} (pid {pid}" + ("" if host == socket.gethostname() else f" on {host}") + ")"


def said_by(error, rank: int):
    """``error`` as one that every rank reaches alike: only ``rank`` says it (the CLI's ``speaks``)."""
    error.speaker = rank
    return error


def _refusal(message: str, hint: str) -> UsageError:
    """A refusal every rank reaches alike: rank 0 says it, once (not again on torchrun's restarts)."""
    return said_by(UsageError(message, hint), 0)


def speaks(rank: int = 0) -> bool:
    """Whether this process is the one that tells: always outside torchrun; under it, rank ``rank`` of torchrun's
    first start (not a restart)."""
    if not launched_by_torchrun():
        return True
    return os.environ.get("RANK", "0").strip() == str(rank) and os.environ.get(
        "TORCHELASTIC_RESTART_COUNT", "0"
    ).strip() in ("", "0")


def check_torchrun_options(world_sizes: tuple[int, ...], explicit: bool) -> int:
    """The world torchrun started (WORLD_SIZE); refuses restarts, a world of one and a -w that says otherwise."""
    from bnsurgeon.core.environment import whole_number

    restarts = whole_number("TORCHELASTIC_MAX_RESTARTS", 0, low=0, high=1 << 20)
    if restarts > 0:
        raise _refusal(
            f"torchrun --max-restarts {restarts}: a check is not retried (a rank that failed would be run "
            "again and its verdict lost)",
            "run torchrun without --max-restarts (its default is 0)",
        )
    world = whole_number("WORLD_SIZE", 1, low=1, high=1 << 20, unit="processes")
    if world < 2:
        raise _refusal(
            "verify under torchrun checks N ranks against one process, and torchrun started 1",
            "start 2 or more: torchrun --nproc-per-node 2 -m bnsurgeon verify ...",
        )
    whole_number("RANK", 0, low=0, high=world - 1)
    whole_number("LOCAL_RANK", 0, low=0, high=world - 1)
    if explicit and tuple(world_sizes) != (world,):
        asked = " ".join(f"-w {w}" for w in world_sizes)
        raise _refusal(
            f"{asked} under torchrun, which started {world} ranks: the check runs on torchrun's ranks",
            f"drop -w (or pass -w {world}), or start torchrun with --nproc-per-node {max(world_sizes)}",
        )
    return world


def check_device(device: str) -> None:
    """``--device`` names one this rank has (before anything is read)."""
    import torch

    if device not in DEVICES:
        raise _refusal(f"--device {device!r} is not one of {', '.join(DEVICES)}", "pass --device auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda, and torch sees no CUDA device on this rank", "drop --device (auto) or pass --device cpu"
        )


def join_torchrun_world(device: str = "auto", timeout_s: float = 120.0) -> TorchrunWorld:
    """Start the process group from torchrun's variables: NCCL on ``cuda:LOCAL_RANK`` where every local rank has a GPU
    (``device`` auto), else gloo on the CPU; ``device`` cuda with fewer GPUs than local ranks shares them over gloo."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from bnsurgeon.runtime.distributed import default_backend, init_distributed

    check_device(device)
    cuda = torch.cuda.is_available()
    backend = "gloo" if device == "cpu" else default_backend(cuda, torch.cuda.device_count() if cuda else 0)
    if dist.is_initialized():  # a script's own group: its world and backend are the script's, not the check's
        raise UsageError(
            "verify as a torchrun rank inside a process that already has a process group",
            "call verify without as_torchrun_rank (its own -w N ranks), or run the command under torchrun",
        )
    try:
        info = init_distributed(backend=backend, timeout_s=timeout_s)
    except ValueError as error:  # env:// without its variables: started by hand, not by torchrun
        raise UsageError(
            f"torchrun's variables are incomplete ({first_line(error)[:160]})",
            "start verify with torchrun (torchrun --nproc-per-node 2 -m bnsurgeon verify ...)",
        ) from None
    except RuntimeError as error:  # DistStoreError, DistNetworkError: the others never came
        raise HostFailureError(
            f"not every rank of the check joined within {timeout_s:g} s ({type(error).__name__}: "
            f"{first_line(error)[:160]})",
            "start every rank (torchrun does), check that each reaches MASTER_ADDR:MASTER_PORT, and run again",
        ) from None
    placed: torch.device = info.device  # type: ignore[assignment]  # DistributedInfo keeps torch out of its import
    if device == "cuda" and placed.type != "cuda":  # more local ranks than GPUs: they share them, over gloo
        placed = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(placed)
    group: Any = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if backend != "gloo" else None
    peers: list = [None] * info.world_size
    dist.all_gather_object(peers, this_process(), group=group)
    return TorchrunWorld(info.rank, info.world_size, placed, backend, group, timeout_s, peers, _store(timeout_s))


def _store(timeout_s: float) -> Any:
    """A connection of this process's own to the store torchrun's ranks met through (torch's env:// rendezvous:
    torchrun's agent serves it, or rank 0 does, shared with the process group's), under a prefix of bnsurgeon's."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store, _rank, _world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    except RuntimeError as error:  # DistStoreError, DistNetworkError: the store went away since the ranks met
        raise HostFailureError(
            f"the store the ranks met through cannot be reached again ({type(error).__name__}: "
            f"{first_line(error)[:160]})",
            "check that every rank reaches MASTER_ADDR:MASTER_PORT, and run again; nothing was written",
        ) from None
    return dist.PrefixStore("bnsurgeon/verify/", store)


@contextmanager
def ranks_agree(world: "TorchrunWorld | None") -> Iterator[None]:
    """Run the block on every rank, then agree: where it raised on any rank, every rank stops, and a failure
    every rank had alike is said once (by the lowest failing rank); a rank that did not fail stops with the
    failing rank's exit code, silently (that rank said why). No torchrun world: the block as it is."""
    if world is None:
        yield
        return
    import torch.distributed as dist

    mine: "BaseException | None" = None
    try:
        yield
    except BaseException as error:  # every rank reaches the exchange below, whatever happened here
        mine = error
    summary = None
    if mine is not None:
        summary = _ending(mine)
    statuses: list = [None] * world.world_size
    try:
        dist.all_gather_object(statuses, summary, group=world.group)
    except BaseException as error:
        culprit = stopped_peer(world, error, wait=isinstance(error, KeyboardInterrupt))
        if culprit is not None:
            raise culprit from None
        if mine is not None:
            raise (said_by(mine, 0) if isinstance(mine, KeyboardInterrupt) else mine) from None
        raise
    failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
    if not failed:
        return
    # every rank stops here. The group is let go at exit, after the rank has said why (a teardown can block while
    # a peer exits: torch 2.4's gloo did), bounded; never held into exit, where gloo aborts the process
    import atexit

    atexit.register(_let_go, world, True)
    first_rank, (text, hint, code) = failed[0]
    if mine is not None:
        if isinstance(mine, BnSurgeonError) and all(status[0] == text for _, status in failed):
            said_by(mine, first_rank)
        raise mine
    ended = RankEndedError(f"rank {first_rank} stopped before the check: {text}", hint, exit_code=code)
    raise said_by(ended, first_rank)


def _ending(error: BaseException) -> tuple[str, str, int]:
    """(message, fix, exit code) of how a rank ended, as its own line says them: a bnsurgeon error's own words; an
    interruption's code; anything else is the internal error (exit 70) the CLI names with its class."""
    if isinstance(error, BnSurgeonError):
        return error.message, error.hint, error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted ({str(error) or 'SIGINT'})", "run the command again", getattr(error, "exit_code", 130)
    return (
        f"internal error: {type(error).__name__}: {first_line(error)}",
        "this is a bug in bnsurgeon: please report it",
        70,
    )


#: how long a rank that stops on a failure waits for its group's teardown before it says why and exits anyway
TEARDOWN_S = 5.0


def _let_go(world: TorchrunWorld, bounded: bool = False) -> None:
    """Destroy the check's groups. ``bounded``: on a failure, in a thread waited for ``TEARDOWN_S`` at most, so a
    teardown that blocks (torch 2.4's gloo once did while a peer exited) cannot keep the rank from saying why."""
    import threading

    import torch.distributed as dist

    def destroy() -> None:
        if dist.is_initialized():
            if world.group is not None:
                dist.destroy_process_group(world.group)
            dist.destroy_process_group()

    if not bounded:
        destroy()
        return
    worker = threading.Thread(target=destroy, name="bnsurgeon-teardown", daemon=True)
    worker.start()
    worker.join(TEARDOWN_S)


def leave_torchrun_world(world: TorchrunWorld) -> None:
    """Every rank meets, then all let go of the group together: rank 0's one-process checks then run without one
    (a gloo rank whose peers tore the group down first can abort at its own teardown)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        met = dist.barrier(group=world.group, async_op=True)
        met.wait()
    except BaseException as error:
        culprit = stopped_peer(world, error, wait=isinstance(error, KeyboardInterrupt))
        if culprit is not None:
            raise culprit from None
        raise
    # the barrier's work (which holds the collectives before it, their tensors Python's) is let go only once the
    # group is gone, here, by this thread: torch 2.4's gloo worker that dropped it last would need the GIL while it
    # holds the lock the group's destructor takes with the GIL held, and both would wait for good (seen in about 1
    # of 20 two-node checks, the last rank stuck in destroy_process_group)
    _let_go(world)
    del met


#: how much of a file a rank reads at a time while it hashes it
DIGEST_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRead:
    """A file this rank reads for the check: for whom (SOURCE, CONVERTED, --example-input), its name as given, where
    that name led this rank, its sha256 (None where this rank cannot read it: its load says why) and its identity
    when hashed (so that the load is known to read the bytes that were hashed)."""

    role: str
    name: str
    where: str
    sha256: str | None
    identity: tuple | None = None


def files_read(named: "list[tuple[str, str | os.PathLike]]") -> list[FileRead]:
    """Each (role, path) hashed (sha256, streamed) before it is loaded: what the ranks compare (``agree_on_files``).
    A file named twice (SOURCE and CONVERTED alike) is read once."""
    hashed: dict[str, FileRead] = {}
    files = []
    for role, path in named:
        known = hashed.get(os.fspath(path))
        read = _hashed(role, path) if known is None else FileRead(role, known.name, known.where, known.sha256)
        hashed.setdefault(read.name, read)
        files.append(read)
    return files


def _hashed(role: str, path: "str | os.PathLike") -> FileRead:
    import hashlib
    import stat

    from bnsurgeon.core.errors import InputChangedError
    from bnsurgeon.files.reading import file_identity

    name, where, file = os.fspath(path), os.path.realpath(path), Path(path)
    try:
        before = file_identity(file)
        handle = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO: no wait for a writer
    except OSError:
        return FileRead(role, name, where, None)
    digest = hashlib.sha256()
    with open(handle, "rb") as stream:
        if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):  # a FIFO or a device: the load refuses it
            return FileRead(role, name, where, None)
        while chunk := stream.read(DIGEST_CHUNK):
            digest.update(chunk)
    if file_identity(file) != before:
        raise InputChangedError(f"{name} changed while bnsurgeon was reading it (size, mtime or inode differ)")
    return FileRead(role, name, where, digest.hexdigest(), before)


def unchanged_since_hashed(files: list[FileRead]) -> None:
    """Refuse a file replaced or rewritten between its hash and its load: the load read bytes no rank compared."""
    from bnsurgeon.core.errors import InputChangedError
    from bnsurgeon.files.reading import file_identity

    for read in files:
        if read.identity is None:
            continue
        try:
            now = file_identity(Path(read.name))
        except OSError:
            now = None
        if now != read.identity:
            raise InputChangedError(
                f"{read.name} ({read.role}) changed while bnsurgeon was reading it (size, mtime or inode differ)"
            )


def agree_on_files(world: TorchrunWorld, mine: list[FileRead]) -> None:
    """Every rank read the same bytes for every file, or every rank stops here with the same error (exit 4), said
    once: the ranks that read other bytes than the first rank, and the file. A file a rank cannot read is left to
    its load, which says why."""
    import torch.distributed as dist

    shared = [(read.role, read.name, read.where, read.sha256) for read in mine]
    gathered: list = [None] * world.world_size
    try:
        dist.all_gather_object(gathered, shared, group=world.group)
    except BaseException as error:
        culprit = stopped_peer(world, error, wait=isinstance(error, KeyboardInterrupt))
        if culprit is not None:
            raise culprit from None
        raise
    mismatch = files_mismatch(world, gathered)
    if mismatch is not None:
        import atexit

        atexit.register(_let_go, world, True)  # as ranks_agree's failures: the group let go after the line, bounded
        raise said_by(mismatch, 0)


def files_mismatch(world: TorchrunWorld, gathered: list) -> "BnSurgeonError | None":
    """The error for the first file that some rank read with other bytes than the first rank that read it."""
    from bnsurgeon.core.errors import CheckpointError

    digests: dict[tuple[str, str], dict[int, tuple[str, str]]] = {}
    for rank, files in enumerate(gathered):
        for role, name, where, sha256 in files:
            if sha256 is not None:
                digests.setdefault((role, name), {})[rank] = (where, sha256)
    for (role, name), by_rank in digests.items():
        first, (first_where, first_sha256) = next(iter(by_rank.items()))
        others = [rank for rank, (_, sha256) in by_rank.items() if sha256 != first_sha256]
        if not others:
            continue
        other_where, other_sha256 = by_rank[others[0]]
        who = world.rank_name(others[0]) if len(others) == 1 else "ranks " + ", ".join(map(str, others))
        where = (
            f"{first_where} on each"
            if other_where == first_where
            else f"rank {first} read {first_where}, rank {others[0]} {other_where}"
        )
        return CheckpointError(
            f"{who} read other bytes than rank {first} for {role} {name} (sha256 {other_sha256[:12]} against "
            f"{first_sha256[:12]}; {where}): the ranks would check different models",
            "give every rank the same file (one path on a shared file system, or copies that sha256sum shows "
            "identical), start every rank in the same directory, and let nothing write the file meanwhile; "
            "nothing was checked or written",
        )
    return None


def rank_0_alone(world: TorchrunWorld, run: "Callable[[], Any]") -> Any:
    """Rank 0 runs ``run`` (checks of one process: the group is closed by now, so the layers run as plain BN) and
    tells the others how it ended, through the store; they wait for it and end the same way: with its result (so a
    failed check is exit 1 on every rank and node), or with its error's exit code, silently."""
    import pickle

    if world.rank != 0:
        ending, value = pickle.loads(_rank_0s_word(world))
        if ending == "result":
            return value
        text, hint, code = value
        raise said_by(RankEndedError(f"rank 0 stopped: {text}", hint, exit_code=code), 0)
    try:
        result = run()
    except BaseException as error:  # interrupted: every rank was (torchrun forwards the signal), none waits to read
        _tell(world, pickle.dumps(("error", _ending(error))), wait=not isinstance(error, KeyboardInterrupt))
        raise
    _tell(world, pickle.dumps(("result", result)))
    return result


VERDICT_KEY, READ_KEY = "verdict", "read"


def _tell(world: TorchrunWorld, word: bytes, wait: bool = True) -> None:
    """Rank 0's verdict, kept where every rank reads it; then, with ``wait``, it waits (the run's timeout at most)
    until each has read it: the store may be rank 0's own, gone when it exits."""
    try:
        world.store.set(VERDICT_KEY, word)
        deadline = time.monotonic() + (world.timeout_s if wait else 0.0)
        while world.store.add(READ_KEY, 0) < world.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone: the others are told by losing it; rank 0 still speaks
        pass


def _rank_0s_word(world: TorchrunWorld) -> bytes:
    """Rank 0's verdict, waited for as long as rank 0 runs: its checks take what the model takes. Rank 0 dead, or
    stopped (SIGSTOP) for the run's timeout, on this node, or its store lost, ends the wait naming it (exit 16)."""
    stopped_since = None
    try:
        while True:
            word = _told(world)
            if word is not None:
                return word
            _host, pid, _machine, start = world.peers[0]
            state = _process_state(pid, start) if 0 in _peers_here(world) else None
            if state is not None and state[0] == "was stopped":
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since < world.timeout_s:
                    state = None
            else:
                stopped_since = None
            if state is not None and _told(world) is None:  # it ended untold, or has been stopped for long
                culprit = _stopped_peer_now(world)
                if culprit is not None:
                    raise culprit
            time.sleep(0.05)
    except KeyboardInterrupt as interrupt:  # torchrun's agent stops the ranks when rank 0 failed (or Ctrl-C)
        word = _told(world, reachable=False)
        if word is not None:  # told before this rank was stopped: ends as rank 0 does
            return word
        culprit = _rank_0_gone_untold(world) or stopped_peer(world, wait=True)
        if culprit is not None:
            raise culprit from None
        raise said_by(interrupt, 0) from None
    except BnSurgeonError:
        raise
    except Exception as error:  # the store is gone: rank 0 (or its node's agent) with it
        culprit = _rank_0_gone_untold(world) or stopped_peer(world, error)
        if culprit is not None:
            raise culprit from None
        raise


def _told(world: TorchrunWorld, reachable: bool = True) -> "bytes | None":
    """Rank 0's verdict where it has told it (this rank's reading counted), else None. ``reachable``: a store that
    cannot be reached raises; otherwise it reads as nothing told."""
    try:
        if not world.store.check([VERDICT_KEY]):
            return None
        word = world.store.get(VERDICT_KEY)
        world.store.add(READ_KEY, 1)
        return word
    except Exception:
        if reachable:
            raise
        return None


def _rank_0_gone_untold(world: TorchrunWorld) -> "BnSurgeonError | None":
    """Rank 0, on this node, gone without telling its verdict (it tells before it exits, whatever ends it, so it
    died), named: looked for up to ``EXIT_GRACE_S`` while its exit settles. None where it runs or is elsewhere."""
    from bnsurgeon.core.interrupts import signals_collected

    if 0 not in _peers_here(world):
        return None
    _host, pid, _machine, start = world.peers[0]
    deadline = time.monotonic() + EXIT_GRACE_S
    with signals_collected():  # torchrun's agent may signal again meanwhile: this rank finishes saying why
        while True:
            state = _process_state(pid, start)
            if state is not None and state[0] not in ("was stopped", "was interrupted"):
                return _stopped_peer_now(world)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def quantity(name: str) -> str:
    """The kind of a compared quantity (judge_ranks' names): each kind gets its own measured bound."""
    if name.startswith("output of sample"):
        return "outputs"
    if name.startswith("input gradient"):
        return "input gradients"
    if name.startswith("grad "):
        return "parameter gradients"
    return "running statistics"


def largest_difference(expected: list, actual: list) -> float:
    """The largest |actual - expected| over the tensors (inf where the shapes differ)."""
    if len(expected) != len(actual) or any(a.shape != e.shape for a, e in zip(actual, expected, strict=True)):
        return float("inf")
    return max(
        ((a.double() - e.double()).abs().max().item() for a, e in zip(actual, expected, strict=True) if e.numel()),
        default=0.0,
    )


@dataclass
class MeasuredBounds:
    """Per kind of quantity: its scale (the largest |value| of that kind in the float64 reference) and the largest
    difference a rank may show, relative to that scale: ``MEASURED_FACTOR`` times plain BN's own (one process, the
    whole batch, the ranks' precision and device), plus one unit of the precision's rounding. Relative to the kind's
    scale, not each tensor's: a gradient that sums to nearly 0 has a large relative error in plain BN too."""

    scales: dict[str, float]
    bounds: dict[str, float]

    def judge(self, name: str, expected: list, actual: list) -> tuple[bool, float]:
        kind = quantity(name)
        diff = largest_difference(expected, actual)
        return diff / (self.scales.get(kind) or 1.0) <= self.bounds[kind], diff

    def describe(self) -> str:
        return ", ".join(f"{kind} {bound:.2g}" for kind, bound in self.bounds.items())


def measured_bounds(reference: RankReference, plain: dict, rounding: "torch.dtype") -> MeasuredBounds:
    import torch

    scales: dict[str, float] = {}
    errors: dict[str, float] = {}

    def measure(name, expected, actual):
        kind = quantity(name)
        scale = max((e.double().abs().max().item() for e in expected if e.numel()), default=0.0)
        scales[kind] = max(scales.get(kind, 0.0), scale)
        errors[kind] = max(errors.get(kind, 0.0), largest_difference(expected, actual))
        return True, 0.0

    judge_ranks(reference, [plain], [reference.batch], measure)
    eps = torch.finfo(rounding).eps
    bounds = {kind: MEASURED_FACTOR * error / (scales[kind] or 1.0) + eps for kind, error in errors.items()}
    return MeasuredBounds(scales, bounds)


def _dtypes(precision: str) -> "tuple[torch.dtype, torch.dtype, bool]":
    """(the ranks' parameters and inputs, the dtype their rounding is judged in, autocast)."""
    import torch

    if precision == "float64":
        return torch.float64, torch.float64, False
    if precision == "float32":
        return torch.float32, torch.float32, False
    return torch.float32, torch.bfloat16, True


def _plain_run(source, reference: RankReference, world: TorchrunWorld, precision: str, compare_at) -> dict:
    """Plain BN in the ranks' precision on the same device, one process on the whole batch (a rank's result): its own
    error against the float64 reference is the measure the ranks are judged by."""
    dtype, _, autocast = _dtypes(precision)
    model = only_bn_trains(copy.deepcopy(source).to(device=world.device, dtype=dtype))
    assert reference.check_input is not None
    return run_share(
        model,
        reference.check_input,
        reference.x,
        reference.grad,
        [reference.batch],
        0,
        compare_at,
        device=world.device,
        dtype=dtype,
        autocast=autocast,
    )


def check_torchrun_ranks(
    world: TorchrunWorld,
    source: "nn.Module",
    converted: "nn.Module",
    shape,
    *,
    label: str,
    precision: str = "float64",
    compare_at: str | None = None,
    seed: int = SEED,
) -> CheckOutcome | None:
    """This process's part of one N-rank check under torchrun; rank 0 returns the outcome, the others None."""
    if precision not in PRECISIONS:
        raise UsageError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", "pass one of them")
    try:
        return _check(world, source, converted, shape, label, precision, compare_at, seed)
    except HostFailureError:
        raise
    except KeyboardInterrupt as interrupt:  # SIGTERM: torchrun's agent stops the ranks when one failed (or Ctrl-C)
        culprit = stopped_peer(world, wait=True)
        if culprit is not None:
            raise culprit from None
        raise said_by(interrupt, 0) from None  # every rank was interrupted: one says it
    except BaseException as error:  # a collective that failed or timed out
        culprit = stopped_peer(world, error)
        if culprit is not None:
            raise culprit from None
        raise


def _check(world, source, converted, shape, label, precision, compare_at, seed) -> CheckOutcome | None:
    """Every rank computes the same reference, plain run and batch (one seed, the same model: no rank waits on
    another's computation, so every wait is the ranks' skew, bounded by the run's timeout); each runs its slice;
    rank 0 gathers the slices and judges them."""
    import torch.distributed as dist

    from bnsurgeon.checks.compare import within_norm
    from bnsurgeon.checks.ranks import FLOAT32_NORM_RTOL

    batch = rank_batch([world.world_size])
    splits = uneven_splits(batch, world.world_size)
    started = time.monotonic()
    reference, plain, why_float32 = _references(source, shape, batch, seed, compare_at, world, precision)
    if reference.problem is not None:  # the same on every rank: the model's outputs cannot be lined up
        return CheckOutcome(label, False, *reference.problem) if world.rank == 0 else None
    ranks_precision = "float32" if why_float32 and precision == "float64" else precision
    dtype, rounding, autocast = _dtypes(ranks_precision)
    check_input = CheckInput.of_shape(shape).with_batch(batch, uniform=True)
    model = only_bn_trains(copy.deepcopy(converted).to(device=world.device, dtype=dtype))
    try:
        mine: dict = run_share(
            model,
            check_input,
            reference.x,
            reference.grad,
            splits,
            world.rank,
            compare_at,
            device=world.device,
            dtype=dtype,
            autocast=autocast,
        )
    except Exception as error:  # the model's own failure on this rank: a failed check, sent like a result
        culprit = stopped_peer(world, error)
        if culprit is not None:  # no: a collective of the layers failed because another rank died or stopped
            raise culprit from None
        mine = {"error": f"{type(error).__name__}: {first_line(error)}"}
    gathered: list = [None] * world.world_size if world.rank == 0 else []
    dist.gather_object(mine, gathered if world.rank == 0 else None, dst=0, group=world.group)
    if world.rank != 0:
        return None
    failed = [(rank, r["error"]) for rank, r in enumerate(gathered) if "error" in r]
    if failed:
        rank, text = failed[0]
        return CheckOutcome(label, False, float("inf"), f"ranks failed: rank {rank}: {text}")
    tolerance = Tolerance(rtol=DIST_RTOL)
    # a float32 reference against float32 ranks (the model does not run in float64): -w N's rule, since plain BN
    # against a float32 reference measures no error at all
    norm_rule = bool(why_float32) and ranks_precision == "float32"
    bounds = measured_bounds(reference, plain, rounding) if plain is not None and not norm_rule else None

    def compare(name, expected, actual):
        actual = [a.double() if a.is_floating_point() else a for a in actual]
        if norm_rule:
            return within_norm(expected, actual, FLOAT32_NORM_RTOL)
        if bounds is None:
            return within(expected, actual, tolerance)
        if not all(e.is_floating_point() for e in expected):  # num_batches_tracked: exactly
            return within(expected, actual)
        return bounds.judge(name, expected, actual)

    problems, worst, values = judge_ranks(reference, gathered, splits, compare)
    judged_in = ranks_precision
    if norm_rule:
        how = f"each tensor within {FLOAT32_NORM_RTOL:g} of its norm or 1, as -w N judges such a model"
    elif bounds is None:
        how = f"within {DIST_RTOL:g} relative"
    else:
        how = (
            f"each kind within {MEASURED_FACTOR:g}x plain BN's own error in {judged_in} on this device + rounding, "
            f"relative to its scale ({bounds.describe()})"
        )
    if why_float32:
        how += f" (the model does not run in float64: {why_float32})"
    if bounds is not None and judged_in == "float32" and _tf32(world.device):
        how += "; convolutions in TF32 (torch's default for cuDNN: torch.backends.cudnn.allow_tf32)"
    detail = f"splits {splits}, {judged_in} on {world.where}, per sample, {how}" + (
        f"; differs: {', '.join(problems[:4])}" if problems else ""
    )
    outcome = CheckOutcome(label, not problems, worst, detail, values=values)
    outcome.seconds = time.monotonic() - started
    return outcome


def _tf32(device) -> bool:
    """Whether float32 convolutions run in TF32 here (cuDNN on an Ampere or newer GPU, torch's default): plain BN's
    measured error, and so the bound, is TF32's then."""
    import torch

    if device.type != "cuda" or not torch.backends.cudnn.allow_tf32:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def _references(source, shape, batch, seed, compare_at, world, precision):
    """(float64 reference on this rank's device, plain BN in the ranks' precision or None, why not float64)."""
    import re

    import torch

    drawn_in = None if precision == "float64" else torch.float32
    why_float32 = ""
    try:
        reference = rank_reference_on(source, shape, batch, seed, compare_at, world, torch.float64, drawn_in)
    except RuntimeError as error:
        if not re.search(r"dtype|Double|double|Float\b|float\b", str(error)):
            raise
        why_float32 = f"{type(error).__name__}: {first_line(error)[:160]}"
        reference = rank_reference_on(source, shape, batch, seed, compare_at, world, torch.float32, torch.float32)
    if reference.problem is not None or precision == "float64":
        return reference, None, why_float32
    return reference, _plain_run(source, reference, world, precision, compare_at), why_float32


def rank_reference_on(source, shape, batch, seed, compare_at, world, dtype, drawn_in) -> RankReference:
    """The source on the whole batch in ``dtype`` on this rank's device (nothing shipped: the ranks hold the model)."""
    return source_reference(
        source, shape, batch, seed=seed, compare_at=compare_at, dtype=dtype, device=world.device, drawn_in=drawn_in
    )


#: how long a rank whose connection closed may take to become a zombie: its sockets close while it exits
EXIT_GRACE_S = 5.0


def stopped_peer(
    world: TorchrunWorld, error: BaseException | None = None, *, wait: bool = False
) -> "BnSurgeonError | None":
    """The first other rank whose process is gone or stopped (on this node, by its process; on another node, by the
    collective's failure), as the error that names it; None when every rank runs and ``error`` is no collective's.
    A peer killed this instant closes its sockets before the kernel shows it dead: it is looked for again for up
    to ``EXIT_GRACE_S`` after a failed collective (or with ``wait``)."""
    from bnsurgeon.core.errors import Interrupted
    from bnsurgeon.core.interrupts import signals_collected

    lost = error is not None and _collective_failure(error)
    deadline = time.monotonic() + (EXIT_GRACE_S if lost or wait else 0.0)
    with signals_collected() as arrived:  # torchrun's agent sends SIGTERM the moment the peer is gone: finish first
        while True:
            culprit = _stopped_peer_now(world, interrupted=wait)
            if culprit is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    if culprit is None and arrived and not lost:
        raise Interrupted(arrived[0])
    if culprit is None and lost:
        assert error is not None
        said = f"{type(error).__name__}: {first_line(error)[:200]}"
        running = [rank for rank in _peers_here(world) if _process_state(world.peers[rank][1]) is None]
        if running and len(running) == len(world.peers) - 1:  # all on this node, all running: one hangs
            names = ", ".join(world.rank_name(rank) for rank in running)
            return RankEndedError(
                f"{names} did not answer within the run's timeout ({world.timeout_s:g} s) though running: a hang "
                f"in the model, its data or a debugger's breakpoint ({said})",
                "find where that rank waits (py-spy dump --pid PID), or raise BNSURGEON_DIST_TIMEOUT for a slow "
                "model; nothing was written",
                exit_code=1,
            )
        return HostFailureError(
            f"rank {world.rank} lost another rank of the check ({said}); no rank of this node stopped, so it was "
            "one on another node, or its network",
            "look at the other nodes' logs (torchrun names the rank that failed), and run again; nothing was written",
        )
    return culprit


def _peers_here(world: TorchrunWorld) -> list[int]:
    """The other ranks whose pids mean something here (the same boot and pid namespace)."""
    machine = world.peers[world.rank][2]
    return [
        rank
        for rank, peer in enumerate(world.peers)
        if rank != world.rank and machine is not None and peer[2] == machine
    ]


def _collective_failure(error: BaseException) -> bool:
    """A collective that failed: the transport lost a peer or timed out (gloo, NCCL), not the model's own error."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        mark in text
        for mark in ("gloo", "nccl", "connection", "timed out", "timeout", "pair closure", "socket", "broken pipe")
    )


def _stopped_peer_now(world: TorchrunWorld, interrupted: bool = False) -> "BnSurgeonError | None":
    for rank in _peers_here(world):
        _host, pid, _machine, start = world.peers[rank]
        state = _process_state(pid, start)
        if state is None or state[0] == "was interrupted":  # running, or Ctrl-C / preemption: not the machine
            continue
        if state[0] == "ended" or (state[0] == "gone" and interrupted):
            # it stopped on an error of its own and said it (or, reaped before this rank looked, torchrun's agent
            # stops this one now and names how it ended): this rank stops, silently
            code = int(state[1]) if state[1] else 1
            ended = RankEndedError(f"rank {rank} ended with exit status {code}", exit_code=code or 1)
            return said_by(ended, rank)
        if state[0] == "gone":
            state = ("died", " (its process is gone)")
        what, cause = state
        if what == "was stopped":  # as -w N does: the check is over, and a stopped rank would outlive it
            _kill(pid)
            cause += f" and did not answer within the run's timeout ({world.timeout_s:g} s); it was killed"
        failure = HostFailureError(
            f"{world.rank_name(rank)} {what}{cause}: the check stopped (this is the machine, not the model)",
            "free the resource named (memory: the out-of-memory killer sends SIGKILL), resume or do not stop the "
            "rank (SIGSTOP), and run again; nothing was written",
        )
        return said_by(failure, 0 if rank != 0 else 1)  # every surviving rank of the node sees it: one says it
    return None


def _kill(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


#: what Ctrl-C, a scheduler's preemption or a closed terminal ends a rank with: torchrun forwards them to every rank
_INTERRUPTS = (2, 15, 1)  # SIGINT, SIGTERM, SIGHUP


def _process_state(pid: int, start: "bytes | None" = None) -> "tuple[str, str] | None":
    """("died", how) for a zombie a signal killed, ("ended", its exit status) for one that exited, ("gone", "") for
    a process reaped already, ("was stopped", how) for one stopped, ("was interrupted", "") for one that a signal
    of Ctrl-C or preemption ended; None if it runs. ``start`` (its start time when it joined): another process
    that took the pid since is the rank gone."""
    import signal

    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return "gone", ""
    except OSError:
        return None
    if start is not None and (len(fields) <= 19 or fields[19] != start):
        return "gone", ""
    state = fields[0].decode(errors="replace")
    if state in ("Z", "X"):
        status = int(fields[49]) if len(fields) > 49 and fields[49].isdigit() else None  # exit_code, Linux >= 3.5
        if status is not None and (status & 0x7F in _INTERRUPTS or (status >> 8) - 128 in _INTERRUPTS):
            return "was interrupted", ""
        if status is not None and status & 0x7F:
            name = signal.Signals(status & 0x7F).name if status & 0x7F in signal.Signals._value2member_map_ else "?"
            hint = " (out of memory?)" if status & 0x7F == signal.SIGKILL else ""
            return "died", f": killed by {name}{hint}"
        if status is not None:
            return "ended", str(status >> 8)
        return "died", ""
    if state in ("T", "t"):
        return "was stopped", " (SIGSTOP: a debugger, job control or a cgroup freezer)"
    return None


__all__ = [
    "DEVICES",
    "PRECISIONS",
    "TorchrunWorld",
    "check_torchrun_options",
    "check_torchrun_ranks",
    "join_torchrun_world",
    "launched_by_torchrun",
    "said_by",
    "speaks",
    "leave_torchrun_world",
    "measured_bounds",
]
