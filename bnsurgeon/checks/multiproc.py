"""Run a function on W gloo ranks on 127.0.0.1 with a free port and a hard timeout.

``run_world`` starts W fresh processes for one call (the tests, the benchmarks).
``RankPool`` starts its processes once and runs many calls on them, each call in a new
process group of any size up to the pool's: ``bnsurgeon verify`` pays process start-up
once instead of once per check.

Ranks are forked from a fork server that imported torch and timm once (seconds of CPU per
process when each rank imports them itself, as spawned ranks do); each rank takes the
parent's environment as it is when the rank starts (a pool's, when the pool starts), not
the server's.

A hang becomes an error: the parent waits at most ``timeout`` seconds, then kills every
rank and raises. Results travel as ``torch.save`` bytes, not shared-memory handles that
die with a rank.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, cast

import torch.multiprocessing as mp

from bnsurgeon.core.interrupts import signals_deferred


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_in_group(rank, world_size, port, collective_timeout, fn, args) -> tuple[str, object]:
    """``fn(rank, world_size, *args)`` in a gloo group made for it: ("ok", the value as torch.save bytes,
    not shared-memory handles that die with the child) or ("error", the traceback), the group torn down."""
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return "ok", buffer.getvalue()
    except BaseException as error:  # report every failure to the parent
        return "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


#: imported once by the fork server, so that each rank starts from them instead of importing them again
#: (torch and timm cost seconds of CPU per process; a forked rank costs milliseconds)
PRELOAD = ("torch", "torch.distributed", "timm", "bnsurgeon.checks.multiproc")


def forked_context():
    """Processes forked from one fork server per parent process (started on first use, with ``PRELOAD``
    imported and nothing else run): as safe as spawn for CUDA and gloo, since the server never touches
    either, without each rank paying the imports. Where there is no fork server (Windows), spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    _start_fork_server()
    return context


_server_started = False


def _start_fork_server() -> None:
    """Start the fork server once, on our terms. It runs as ``python -c``, so the working directory would
    come first on its path, and it imports ``PRELOAD`` with its own path, not the parent's: a ``timm.py``
    in the directory where the user runs verify would be the ranks' timm. It starts with no such entry
    (``PYTHONSAFEPATH``, and in an installed directory for Pythons before 3.11) and ignoring Ctrl-C from
    its first instant, which every rank forked from it inherits; the parent stops the ranks."""
    global _server_started
    if _server_started:
        return
    import multiprocessing.forkserver as forkserver

    import torch

    installed = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    try:
        working = os.getcwd()
    except OSError:  # the working directory was removed: nothing there to shadow a module
        working = None
    main_thread = threading.current_thread() is threading.main_thread()
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    safe_path = os.environ.get("PYTHONSAFEPATH")
    try:
        os.environ["PYTHONSAFEPATH"] = "1"
        if working is not None:
            os.chdir(installed)
        forkserver.ensure_running()
        _server_started = True
    finally:
        if safe_path is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = safe_path
        if working is not None:
            os.chdir(working)
        if main_thread:
            signal.signal(signal.SIGINT, interrupt)


def adopt_environment(environment: dict[str, str]) -> None:
    """The parent's environment as it is now: a forked rank inherits the fork server's, from when the
    server started."""
    os.environ.clear()
    os.environ.update(environment)


def _become_rank(environment: dict[str, str]) -> None:
    """What every rank does first. Ctrl-C reaches every process of the terminal's group: the parent stops
    the ranks (at once when interrupted), so a rank ignores it rather than print its own traceback. Then
    the parent's environment, and one thread (the ranks share the machine's cores)."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    adopt_environment(environment)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _start_all(processes: list) -> None:
    """Start every process with Ctrl-C (and SIGTERM/SIGHUP) held until all have started: a start cut short
    leaves a half-made rank that prints a traceback. If starting fails or is interrupted, the ones that
    started are killed (no rank may wait for work forever) and the error is raised."""
    try:
        with signals_deferred():
            for process in processes:
                process.start()
    except BaseException:
        for process in (p for p in processes if p.pid is not None):
            process.kill()
            process.join()
        raise


def _entry(rank, world_size, port, collective_timeout, task: bytes, results, environment):
    """A rank of ``run_world``. The function and its arguments arrive pickled and are unpickled only after
    the parent's environment is adopted (an import they trigger may read it), and as plain pickle bytes
    (tensors among the arguments would otherwise each take a file descriptor of the fork server's few)."""
    import pickle

    _become_rank(environment)
    try:
        fn, args = pickle.loads(task)
    except BaseException as error:
        results.put((rank, "error", f"the task could not be unpickled in the rank: {type(error).__name__}: {error}"))
        return
    results.put((rank, *_run_in_group(rank, world_size, port, collective_timeout, fn, args)))


def run_world(
    world_size: int, fn, *args, timeout: float = 180.0, collective_timeout: float = 60.0, allow_errors: bool = False
) -> list:
    """Results of ``fn(rank, world_size, *args)`` by rank; raises on error, hang or timeout."""
    import pickle

    context = forked_context()
    results = context.Queue()
    port = free_port()
    environment = dict(os.environ)
    task = pickle.dumps((fn, args))
    processes = [
        context.Process(target=_entry, args=(rank, world_size, port, collective_timeout, task, results, environment))
        for rank in range(world_size)
    ]
    collected: dict[int, tuple[str, Any]] = {}
    finished = False
    try:
        _start_all(processes)
        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(
                    f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish in {timeout}s"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = {
                    r: p.exitcode for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in collected
                }
                if dead and len(collected) + len(dead) >= world_size:
                    if not allow_errors:
                        raise RankFailure(
                            f"{'rank' if len(dead) == 1 else 'ranks'} died with exit {'code' if len(dead) == 1 else 'codes'} {dead}"
                        ) from None
                    collected.update({r: ("died", f"exit code {code}") for r, code in dead.items()})
                continue
            if status == "ok":
                import torch

                value = torch.load(io.BytesIO(value), weights_only=False)
            collected[rank] = (status, value)
        finished = True
    finally:
        for process in (p for p in processes if p.pid is not None):  # the started ones
            process.join(timeout=10 if finished else 0)  # interrupted, failed or timed out: kill at once
            if process.is_alive():
                process.kill()
                process.join()
    errors = {rank: value for rank, (status, value) in collected.items() if status != "ok"}
    if errors and not allow_errors:
        raise RankFailure("\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))
    return [collected[rank] if allow_errors else collected[rank][1] for rank in range(world_size)]


def _pool_entry(rank, inbox, results, environment):
    """A pool process: run each task it is sent, in a process group made for that task."""
    _become_rank(environment)
    while True:
        task = inbox.get()
        if task is None:
            return
        task_id, world_size, port, collective_timeout, fn, args = task
        _run_task(task_id, rank, world_size, port, collective_timeout, fn, args, results)


def _run_task(task_id, rank, world_size, port, collective_timeout, fn, args, results):
    started = time.monotonic()
    status, payload = _run_in_group(rank, world_size, port, collective_timeout, fn, args)
    results.put((task_id, rank, status, payload, time.monotonic() - started))


class RankPool:
    """``size`` processes that run ``fn(rank, world_size, *args)`` on the first W of them.

    Use as a context manager; the processes start at once (the fork server's first start, which
    imports torch and timm, is waited for: overlapping it with the parent's checks was slower on
    2 cores) and are stopped, or killed, on exit. After a failure
    the pool is broken and every later ``run`` raises.
    """

    def __init__(self, size: int, *, collective_timeout: float = 60.0) -> None:
        context = forked_context()
        self.size = size
        self.collective_timeout = collective_timeout
        self._results = context.Queue()
        self._inboxes = [context.Queue() for _ in range(size)]
        self._processes = [
            context.Process(target=_pool_entry, args=(rank, self._inboxes[rank], self._results, dict(os.environ)))
            for rank in range(size)
        ]
        self._next_task = 0
        self._broken: str | None = None
        self.task_seconds: list[float] = []  # per run: the slowest rank's time inside the task
        _start_all(self._processes)

    def run(self, world_size: int, fn, *args, timeout: float = 180.0) -> list:
        """Results of ``fn(rank, world_size, *args)`` on ranks 0..W-1, by rank; raises RankFailure."""
        if self._broken:
            raise RankFailure(f"the rank pool failed earlier: {self._broken}")
        if not 1 <= world_size <= self.size:
            raise ValueError(f"world size {world_size} does not fit a pool of {self.size}")
        task_id, self._next_task = self._next_task, self._next_task + 1
        port = free_port()
        for rank in range(world_size):
            self._inboxes[rank].put((task_id, world_size, port, self.collective_timeout, fn, args))
        collected: dict[int, tuple[str, object]] = {}
        seconds = 0.0
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RankFailure(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish in {timeout}s"
                    )
                try:
                    got_id, rank, status, value, spent = self._results.get(timeout=min(remaining, 5.0))
                except queue.Empty:
                    dead = {r: p.exitcode for r, p in enumerate(self._processes[:world_size]) if p.exitcode is not None}
                    if dead:
                        raise RankFailure(
                            f"{'rank' if len(dead) == 1 else 'ranks'} died with exit {'code' if len(dead) == 1 else 'codes'} {dead}"
                        ) from None
                    continue
                if got_id != task_id:  # a late answer to an earlier, failed task
                    continue
                seconds = max(seconds, spent)
                collected[rank] = (status, value)
        except RankFailure as error:
            self._broken = str(error).splitlines()[0]
            raise
        except BaseException as error:  # interrupted while the ranks work: they cannot be waited for
            self._broken = type(error).__name__
            raise
        errors = {rank: value for rank, (status, value) in collected.items() if status != "ok"}
        if errors:
            self._broken = "a rank raised"
            raise RankFailure("\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))
        import torch

        self.task_seconds.append(seconds)
        return [
            torch.load(io.BytesIO(cast(bytes, collected[rank][1])), weights_only=False) for rank in range(world_size)
        ]

    def close(self) -> None:
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except Exception:
                pass
        for process in self._processes:
            process.join(timeout=0 if self._broken else 10)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self._broken is None:  # interrupted or failed: stop the ranks at once
            self._broken = exc_type.__name__
        self.close()
