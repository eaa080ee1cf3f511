"""Run a function on W gloo ranks on 127.0.0.1 with a free port and a hard timeout.

``run_world`` starts W fresh processes for one call (the tests, the benchmarks).
``RankPool`` starts its processes once and runs many calls on them, each call in a new
process group of any size up to the pool's: ``bnsurgeon verify`` pays process start-up
once instead of once per check.

Ranks are forked from a fork server that imported torch and timm once (seconds of CPU per
process when each rank imports them itself, as spawned ranks do); each rank takes the
parent's environment as it is when the rank starts (a pool's, when the pool starts), not
the server's.

A hang becomes an error, however a rank ends. The parent never waits on anything a rank can
stop answering: each rank has two one-way pipes of its own (tasks in, results out) whose other
ends only the rank holds, so a rank that dies breaks them instead of leaving them full; tasks
are written by a daemon thread per send and results read by a daemon thread per rank, and
the parent waits only on their events and on the ranks' sentinels (a death is seen the moment
it happens, before, while or after a rank reads its task), each wait bounded by ``timeout``.
Nothing is joined at exit that could wait for a dead rank. Results travel as ``torch.save``
bytes, not shared-memory handles that die with a rank.

A rank the machine stopped (killed by SIGKILL, as the out-of-memory killer does; out of
memory, of open files or of disk in the rank) is a ``HostFailureError``, one line naming the
rank and the cause; the other ranks are stopped before the failed one lets go of the process
group, so they print no stack of their own while waiting for it. A rank that raises, crashes
or does not finish is a ``RankFailure``.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import queue
import re
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, cast

import torch.multiprocessing as mp

from bnsurgeon.core.errors import HostFailureError, Interrupted, first_line
from bnsurgeon.core.interrupts import signals_collected


class RankFailure(RuntimeError):
    """A rank raised, crashed, or did not finish in time (a check failed, not the machine)."""


MEMORY_HINT = (
    "nothing was written; the machine, not the model, stopped the check: free memory, or check fewer ranks "
    "at once (--world-size N with a smaller N), then run again"
)
KILLED_HINT = (
    "nothing was written; the machine, not the model, stopped the check. If it ran out of memory (dmesg names "
    "what the kernel killed), free memory or check fewer ranks at once (--world-size N with a smaller N)"
)
FILES_HINT = "nothing was written; raise the open-file limit (ulimit -n 4096) and run again"
DISK_HINT = "nothing was written; free disk space (the temporary directory too) and run again"
START_HINT = "nothing was written; the machine refused new processes or pipes: free resources and run again"
STOPPED_HINT = "nothing was written; something on this machine stopped a rank: run again once it lets the ranks run"
SERVER_STOPPED_HINT = (
    "nothing was written; something on this machine stopped the process that starts the ranks: run again once it "
    "lets it run"
)
LIMIT_HINT = "nothing was written; raise the limit named (ulimit) and run again"
#: signals by which the machine, or someone on it, stops a process (not a failure of the code it ran): why, the fix
MACHINE_SIGNALS = {
    "SIGKILL": ("out of memory?", KILLED_HINT),  # the kernel's out-of-memory killer sends SIGKILL, as does kill -9
    "SIGTERM": ("stopped from outside", STOPPED_HINT),
    "SIGHUP": ("its terminal closed", STOPPED_HINT),
    "SIGBUS": ("shared memory (/dev/shm) full?", "nothing was written; free space in /dev/shm and run again"),
    "SIGXCPU": ("CPU time limit, ulimit -t", LIMIT_HINT),
    "SIGXFSZ": ("file size limit, ulimit -f", LIMIT_HINT),
}
_OUT_OF_MEMORY = re.compile(r"can't allocate memory|out of memory|not enough memory|Cannot allocate memory", re.I)


def exit_cause(rank: int, exitcode: int | None) -> tuple[str, str | None]:
    """One line on how a rank ended without reporting, and the fix where the machine ended it (else None)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        if name in MACHINE_SIGNALS:
            why, fix = MACHINE_SIGNALS[name]
            return f"rank {rank} was killed by {name} ({why})", fix
        return f"rank {rank} crashed with {name}", None
    return f"rank {rank} exited (code {exitcode}) without reporting a result", None


def open_file_limit() -> int | None:
    """This process's open-file limit (``ulimit -n``), which the ranks inherit; None where there is none."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _open_file_limit() -> str:
    limit = open_file_limit()
    return "" if limit is None else f" (ulimit -n {limit})"


def files_needed(world_size: int) -> int:
    """Open files a rank cannot do with fewer of: rank 0 holds the group's store and a socket per peer
    (measured with torch 2.14: 24 + 2 W while a collective runs; the fork server about 11 + 1 per rank)."""
    return 20 + 2 * world_size


#: below this open-file limit, a rank that aborts (gloo aborts the process when a socket or pipe cannot be
#: made, from a thread Python cannot catch it in) is taken to have run out of open files; 1024 is the usual
FEW_FILES = 64


def _quoted(error: BaseException) -> str:
    """The error's first line; of a C++ message (``[enforce fail at loop.cc:48] rv != -1. -1 vs -1. pipe: Too
    many open files``) only the clause that names the problem."""
    line = first_line(error)
    if not line.startswith("[") or line.startswith("[Errno"):
        return line
    clauses = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")
    named = [c for c in clauses if re.search(r"open files|memory|space left", c, re.I)]
    return (named or clauses)[-1]


#: how gloo says a peer went while the group connected (a peer out of sockets closes or aborts)
_PEER_LOST = re.compile(r"connectFullMesh|Connection closed by peer|Connection reset by peer", re.IGNORECASE)


def machine_cause(error: BaseException, *, connecting: bool = False) -> tuple[str, str] | None:
    """(what happened, the fix) when ``error`` is the machine's limit (memory, open files, disk), else None.

    Python says it with an errno or MemoryError; torch's C++ (gloo, the allocator) only in its message.
    ``connecting``: the error came while the group connected (a peer lost then, under a low open-file limit, ran
    out of sockets; a peer lost later is a peer that failed, and says so itself)."""
    number = error.errno if isinstance(error, OSError) else None
    text = str(error) if isinstance(error, (OSError, RuntimeError, MemoryError)) else ""
    said = f"{type(error).__name__}: {_quoted(error)}"
    if number in (errno.EMFILE, errno.ENFILE) or "Too many open files" in text:
        return f"hit the limit on open files{_open_file_limit()}: {said}", FILES_HINT
    limit = open_file_limit()
    if connecting and limit is not None and limit < FEW_FILES and _PEER_LOST.search(text):
        # the peer that ran out of sockets said nothing (gloo closes or aborts it): this rank only sees it go
        return f"lost its peers while connecting (out of open files? ulimit -n is {limit}): {said}", FILES_HINT
    if isinstance(error, MemoryError) or number == errno.ENOMEM or _OUT_OF_MEMORY.search(text):
        return f"ran out of memory: {said}", MEMORY_HINT
    if number == errno.ENOSPC or "No space left on device" in text:
        return f"ran out of disk space: {said}", DISK_HINT
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_in_group(
    rank, world_size, port, collective_timeout, work: bytes, send: Callable[[str, object], None], hold
) -> None:
    """``fn(rank, world_size, *args)`` (``work``: their plain pickle) in a gloo group made for it, and
    ``send`` what came of it: ("ok", the value as torch.save bytes, not shared-memory handles that die
    with the child) or ("error", the traceback), before the group is torn down (torch 2.4's gloo joins a
    collective left pending when its group is destroyed, for up to the group's timeout: a rank whose peer
    failed would otherwise hold its error that long); or ("machine", (line, fix))
    for a limit of the machine, sent at once, then ``hold()`` with the group and the error's frames
    (which may hold the rendezvous store) still alive, so that no other rank sees them go before the
    parent stops it."""
    import torch
    import torch.distributed as dist

    unpickled = connected = False
    try:
        try:
            fn, args = pickle.loads(work)  # after the environment is adopted: an import it triggers may read it
            unpickled = True
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=collective_timeout),
            )
            connected = True
            value = fn(rank, world_size, *args)
            buffer = io.BytesIO()
            torch.save(value, buffer)
            outcome: tuple[str, object] = ("ok", buffer.getvalue())
        except BaseException as error:  # report every failure to the parent
            cause = machine_cause(error, connecting=unpickled and not connected)
            if cause is not None:
                send("machine", (f"rank {rank} {cause[0]}", cause[1]))
                hold()
                return
            if not unpickled:
                outcome = ("error", f"the task could not be unpickled in the rank: {type(error).__name__}: {error}")
            else:
                outcome = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        send(*outcome)
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
#: the exit code multiprocessing gives a forked rank whose fork server it can no longer ask (the server died)
LOST_SERVER = 255


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and (where /proc tells) is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger's trace stop, a job-control stop; a cgroup freezer
    reads the same way where /proc tells): it runs no code, and answers no collective, until it is continued."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def fork_server_lost() -> bool:
    """Whether the ranks come from a fork server that is no longer running (killed under them)."""
    if "forkserver" not in mp.get_all_start_methods():  # spawned ranks (Windows): no server to lose
        return False
    return not _server_alive()


def _server_alive() -> bool:
    """Whether the fork server we started still runs, asked without reaping it (multiprocessing's own
    check reaps it, and starts another one, without our terms, where it died)."""
    pid = fork_server_pid()
    if pid is None or not hasattr(os, "waitid"):
        return True  # nothing to ask, or no way to ask without reaping: as before
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return True


def _start_fork_server() -> None:
    """Start the fork server on our terms: once, and again if it died (its 400 MB make it a likely victim of
    the out-of-memory killer in a long session). It runs as ``python -c``, so the working directory would
    come first on its path, and it imports ``PRELOAD`` with its own path, not the parent's: a ``timm.py``
    in the directory where the user runs verify would be the ranks' timm. It starts with no such entry
    (``PYTHONSAFEPATH``, and in an installed directory for Pythons before 3.11) and ignoring Ctrl-C from
    its first instant, which every rank forked from it inherits; the parent stops the ranks."""
    global _server_started
    import multiprocessing.forkserver as forkserver

    if _server_started and _server_alive():
        return

    import torch

    installed = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    try:
        working = os.getcwd()
    except OSError:  # the working directory was removed: nothing there to shadow a module
        working = None
    main_thread = threading.current_thread() is threading.main_thread()
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    safe_path = os.environ.get("PYTHONSAFEPATH")
    # c10's log level is read when torch loads: a rank waiting for a peer (the store's retries) printed a C++
    # stack per retry at WARNING; the ranks' own errors come back to the parent as Python exceptions
    quiet_cpp = "TORCH_CPP_LOG_LEVEL" not in os.environ
    try:
        os.environ["PYTHONSAFEPATH"] = "1"
        if quiet_cpp:
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        if working is not None:
            os.chdir(installed)
        forkserver.ensure_running()
        _server_started = True
    finally:
        if quiet_cpp:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
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


def start_ranks(processes: list, stopped_bound: float) -> None:
    """Start every process, from a thread of its own: a start waits on the fork server, which may never answer
    (stopped by SIGSTOP, a debugger, a cgroup freezer), and Python cannot cut that wait short. Meanwhile Ctrl-C
    (and SIGTERM/SIGHUP) is held, so that no start is cut in half (a half-made rank prints a traceback), and
    answered as soon as the starts end, or at once where the server answers nothing; a server stopped for
    ``stopped_bound`` seconds is the machine's doing (``HostFailureError``), and is killed. If starting fails or
    is interrupted, the ones that started are killed (no rank may wait for work forever) and the error is
    raised; an interruption first, as it is what the user asked for."""
    failures: list[BaseException] = []
    done = threading.Event()

    def start() -> None:
        try:
            for process in processes:
                process.start()
        except BaseException as error:  # noqa: B036 - raised in the caller's thread
            failures.append(error)
        finally:
            done.set()

    starter = threading.Thread(target=start, name="bnsurgeon-start", daemon=True)
    try:
        with signals_collected() as arrived:
            starter.start()
            stopped_since: float | None = None
            signalled: float | None = None
            last = time.monotonic()
            while not done.wait(START_POLL_S):
                now = time.monotonic()
                if now - last > 1.0:  # this process was itself stopped (the whole job): start the count again
                    stopped_since = None
                last = now
                if arrived:
                    signalled = signalled or now
                    if now - signalled >= SIGNAL_GRACE_S:  # a server that hangs (not stopped) answers nothing either
                        break
                server = fork_server_pid()
                if server is None or not stopped(server):
                    stopped_since = None
                    continue
                stopped_since = stopped_since or now
                if arrived:  # the server answers nothing until it is continued: the interruption is answered now
                    break
                if now - stopped_since >= stopped_bound:
                    raise HostFailureError(
                        f"the fork server that starts the ranks (pid {server}) was stopped for {stopped_bound:g} s "
                        "(SIGSTOP: a debugger, job control or a cgroup freezer) and started none; it was killed",
                        SERVER_STOPPED_HINT,
                    )
        if arrived:
            raise Interrupted(arrived[0])
        if failures:
            raise failures[0]
    except BaseException:
        if starter.is_alive():
            _kill_fork_server()  # it will never start the rest; its end frees every wait on it
        for process in (p for p in processes if p.pid is not None):
            process.kill()
            process.join(5.0)
        raise


def fork_server_pid() -> int | None:
    """The pid of the fork server the ranks come from (None before it starts, or where there is none)."""
    if "forkserver" not in mp.get_all_start_methods():
        return None
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _kill_fork_server() -> None:
    """Kill our fork server (a stopped one answers nothing: multiprocessing waits on it for every start and
    every exit status it relays). The next pool starts another."""
    server = fork_server_pid()
    if server is not None:
        try:
            os.kill(server, signal.SIGKILL)
        except OSError:
            pass


#: how often a start that has not ended looks at the fork server
START_POLL_S = 0.02
#: how long a start may still take once Ctrl-C or SIGTERM came (a start takes milliseconds; a hung server, forever)
SIGNAL_GRACE_S = 5.0
#: how often a wait for a rank's end looks at the fork server that relays it
REAP_POLL_S = 0.2
#: how long the server must stay stopped before a wait for a rank's end kills it (a profiler or a tracer stops a
#: process for moments: py-spy, strace -f)
SERVER_STOPPED_S = 2.0


def _pool_entry(rank, tasks, results, environment):
    """A rank: run each task it is sent, in a process group made for that task, until the parent closes
    its task pipe (or is gone: the pipe breaks the same way)."""
    _become_rank(environment)

    def hold() -> None:  # a machine failure was reported: wait for the parent to stop this rank
        try:
            while True:
                tasks.recv_bytes()
        except (EOFError, OSError):
            return

    try:
        while True:
            task_id, world_size, port, collective_timeout, work = pickle.loads(tasks.recv_bytes())
            started = time.monotonic()

            def send(status: str, payload: object, task_id=task_id, started=started) -> None:
                results.send_bytes(pickle.dumps((task_id, status, payload, time.monotonic() - started)))

            _run_in_group(rank, world_size, port, collective_timeout, work, send, hold)
    except (EOFError, OSError):  # the parent closed the pool, or is gone
        return


def _deliver(connection, data: bytes) -> None:
    try:
        connection.send_bytes(data)
    except BaseException:  # the rank is gone: its sentinel tells the parent, not this thread
        pass


def _read(rank: int, connection, events: "queue.SimpleQueue") -> None:
    """Post each result a rank sends, then ("closed", rank) once nothing more can come."""
    while True:
        try:
            data = connection.recv_bytes()
        except BaseException:  # end of file: the rank, and every copy of its end, is gone
            events.put(("closed", rank, None))
            return
        events.put(("result", rank, data))


def _watch(sentinels: dict, events: "queue.SimpleQueue") -> None:
    """Post ("exited", rank) the moment each rank's process ends, however it ends."""
    from multiprocessing.connection import wait

    waiting = dict(sentinels)
    while waiting:
        try:
            ready_ones = wait(list(waiting))
        except (OSError, ValueError):  # a sentinel closed under us: the pool is gone, nobody listens
            return
        for ready in ready_ones:
            events.put(("exited", waiting.pop(ready), None))


class _Rank:
    """One rank's process and the parent's ends of its two one-way pipes (the rank holds the others)."""

    def __init__(self, context, rank: int, environment: dict[str, str]) -> None:
        self.rank = rank
        self.senders: list[threading.Thread] = []
        self.readers: list[threading.Thread] = []
        task_end, self.tasks = context.Pipe(duplex=False)
        try:
            self.results, result_end = context.Pipe(duplex=False)
        except BaseException:
            task_end.close()
            self.tasks.close()
            raise
        self._child_ends: list[Any] = [task_end, result_end]
        self.process: Any = context.Process(
            target=_pool_entry, args=(rank, task_end, result_end, environment), name=f"bnsurgeon-rank-{rank}"
        )

    def started(self) -> None:
        """Only the rank holds its ends now: when it dies, a write to it fails and a read ends."""
        for end in self._child_ends:
            end.close()
        self._child_ends = []

    def send(self, data: bytes) -> None:
        """Write a task from a daemon thread: a rank that never reads it cannot hold up the parent."""
        thread = threading.Thread(
            target=_deliver, args=(self.tasks, data), name=f"bnsurgeon-send-{self.rank}", daemon=True
        )
        thread.start()
        self.senders.append(thread)

    def listen(self, events: "queue.SimpleQueue") -> None:
        thread = threading.Thread(
            target=_read, args=(self.rank, self.results, events), name=f"bnsurgeon-read-{self.rank}", daemon=True
        )
        thread.start()
        self.readers.append(thread)

    def idle(self) -> bool:
        """No task is being written to the rank."""
        return not any(thread.is_alive() for thread in self.senders)

    def kill(self) -> None:
        if self.process.pid is not None and self.process.exitcode is None:
            self.process.kill()
        elif self.orphaned():  # multiprocessing thinks it ended (exit 255) and would not kill it
            try:
                os.kill(cast(int, self.process.pid), signal.SIGKILL)
            except OSError:
                pass

    def orphaned(self) -> bool:
        """Whether this rank still runs though its fork server was killed: multiprocessing then reports it as
        ended (exit 255), having lost the only process that could say how it ends."""
        pid = self.process.pid
        if pid is None or self.process.exitcode != LOST_SERVER or not fork_server_lost():
            return False
        return running(pid)

    def reap(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the process's end, as its fork server relays it; a server stopped meanwhile
        would relay nothing until it is continued (and multiprocessing's join at interpreter exit would wait as
        long): it is killed, which ends every such wait."""
        if self.process.pid is None:
            return
        deadline = time.monotonic() + seconds
        stopped_since: float | None = None
        while self.process.exitcode is None and time.monotonic() < deadline:
            server = fork_server_pid()
            if server is not None and stopped(server):
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since >= SERVER_STOPPED_S:
                    _kill_fork_server()
            else:
                stopped_since = None
            self.process.join(min(REAP_POLL_S, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Close the parent's ends once no thread of ours can still be using them (else leave them open:
        closing a pipe under a thread blocked on it could let it write to whatever reuses the number)."""
        threads = self.senders + self.readers
        for thread in threads:
            thread.join(1.0)
        if not any(thread.is_alive() for thread in threads):
            for end in (self.tasks, self.results, *self._child_ends):
                end.close()


#: after a rank's process ends, how long its result may still be in the pipe on its way to the parent
LAST_RESULT_S = 2.0
#: how often a rank whose fork server was killed is looked at (nothing signals its end)
ORPHAN_POLL_S = 0.2
#: how often the ranks are looked at for a stopped process (SIGSTOP signals nothing to the parent)
STOPPED_POLL_S = 1.0


class RankPool:
    """``size`` processes that run ``fn(rank, world_size, *args)`` on the first W of them.

    Use as a context manager; the processes start at once (the fork server's first start, which
    imports torch and timm, is waited for: overlapping it with the parent's checks was slower on
    2 cores) and are stopped, or killed, on exit. After a failure
    the pool is broken and every later ``run`` raises. A rank that dies, whenever it dies, is an
    error of the run that needs it (``HostFailureError`` when the machine killed it).
    """

    def __init__(self, size: int, *, collective_timeout: float = 60.0) -> None:
        self.size = size
        self.collective_timeout = collective_timeout
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._ranks: list[_Rank] = []
        self._next_task = 0
        self._broken: str | None = None
        self._closed = False
        self._exited: dict[int, float] = {}  # rank -> when its process was seen to end
        self._drained: set[int] = set()  # ranks whose result pipe has closed: every result they sent is in
        self._holding: set[int] = set()  # ranks that reported a machine failure: stopped after the others
        self._stopped_since: dict[int, float] = {}  # rank -> since when its process has been seen stopped
        self.task_seconds: list[float] = []  # per run: the slowest rank's time inside the task
        limit = open_file_limit()
        if limit is not None and limit < files_needed(size):
            self._broken = "too few open files"
            raise HostFailureError(
                f"the open-file limit (ulimit -n {limit}) is too low for {size} ranks: rank 0 needs at least "
                f"{files_needed(size)} open files",
                FILES_HINT,
            )
        try:
            context = forked_context()
            environment = dict(os.environ)
            self._ranks = [_Rank(context, rank, environment) for rank in range(size)]
            start_ranks([r.process for r in self._ranks], self.collective_timeout)
            for r in self._ranks:
                r.started()
                r.listen(self._events)
            sentinels = {r.process.sentinel: r.rank for r in self._ranks}
            threading.Thread(target=_watch, args=(sentinels, self._events), name="bnsurgeon-watch", daemon=True).start()
        except (OSError, RuntimeError, EOFError) as error:  # pipes, processes or threads refused: the machine's limits
            self._broken = type(error).__name__
            self.close()
            if isinstance(error, RuntimeError) and "thread" not in str(error):
                raise
            cause = machine_cause(error)
            if isinstance(error, EOFError):  # the fork server's pipe closed under it: the server died while starting
                cause = ("the fork server that starts them died while starting (killed: out of memory?)", KILLED_HINT)
            raise HostFailureError(
                f"the ranks could not be started: {cause[0] if cause else f'{type(error).__name__}: {first_line(error)}'}",
                cause[1] if cause else START_HINT,
            ) from None
        except BaseException:
            self._broken = "interrupted"
            self.close()
            raise

    @property
    def pids(self) -> list[int | None]:
        """The ranks' process ids, by rank."""
        return [r.process.pid for r in self._ranks]

    def run(self, world_size: int, fn, *args, timeout: float = 180.0, allow_errors: bool = False) -> list:
        """Results of ``fn(rank, world_size, *args)`` on ranks 0..W-1, by rank; raises RankFailure, or
        HostFailureError for a rank the machine stopped. ``allow_errors``: (status, value) per rank instead,
        status "ok", "error" (value: the text) or "died" (value: how it ended)."""
        if self._broken:
            raise RankFailure(f"the rank pool failed earlier: {self._broken}")
        if not 1 <= world_size <= self.size:
            raise ValueError(f"world size {world_size} does not fit a pool of {self.size}")
        task_id, self._next_task = self._next_task, self._next_task + 1
        # plain pickle bytes, unpickled in the rank: tensors by value, not a file descriptor each
        work = pickle.dumps((fn, args))
        task = pickle.dumps((task_id, world_size, free_port(), self.collective_timeout, work))
        collected: dict[int, tuple[str, Any]] = {}
        seconds = 0.0
        deadline = time.monotonic() + timeout
        try:
            self._take_events(0.0, task_id, world_size, collected, allow_errors)  # deaths since the last run
            for rank in range(world_size):
                if rank not in collected:
                    try:
                        self._ranks[rank].send(task)
                    except RuntimeError as error:  # "can't start new thread": the machine's limit
                        raise HostFailureError(
                            f"a task could not be sent to rank {rank}: {error}", START_HINT
                        ) from None
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._judge_stopped(world_size, collected, at_deadline=True)
                    raise RankFailure(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish within "
                        f"{timeout:g} s (the run's timeout)"
                    )
                wait = min(remaining, STOPPED_POLL_S)
                seconds = max(seconds, self._take_events(wait, task_id, world_size, collected, allow_errors))
                self._judge_stopped(world_size, collected)
        except HostFailureError as error:
            self._broken = error.message
            raise
        except RankFailure as error:
            self._broken = str(error).splitlines()[0]
            raise
        except BaseException as error:  # interrupted while the ranks work: they cannot be waited for
            self._broken = type(error).__name__
            raise
        import torch

        def value(status: str, payload: Any) -> Any:
            return torch.load(io.BytesIO(cast(bytes, payload)), weights_only=False) if status == "ok" else payload

        if allow_errors:
            return [(collected[r][0], value(*collected[r])) for r in range(world_size)]
        errors = {rank: payload for rank, (status, payload) in collected.items() if status != "ok"}
        if errors:
            self._broken = "a rank raised"
            raise RankFailure("\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))
        self.task_seconds.append(seconds)
        return [value(*collected[rank]) for rank in range(world_size)]

    def _judge_stopped(self, world_size: int, collected: dict, *, at_deadline: bool = False) -> None:
        """A rank whose process has been stopped for the group's collective timeout (or is stopped when the run's
        deadline comes) is the machine's doing: HostFailureError naming it, not a failed check; its peers could
        only wait for it (in a collective, or in the store's retries)."""
        now = time.monotonic()
        for rank in range(world_size):
            pid = self._ranks[rank].process.pid
            if rank in collected or pid is None or not stopped(pid):
                self._stopped_since.pop(rank, None)
                continue
            since = self._stopped_since.setdefault(rank, now)
            if at_deadline or now - since >= self.collective_timeout:
                waited = "when the run's deadline came" if at_deadline else f"for {now - since:.0f} s"
                raise HostFailureError(
                    f"rank {rank} (pid {pid}) was stopped {waited} (SIGSTOP: a debugger, job control or a cgroup "
                    f"freezer) and answered nothing; the ranks wait for each other {self.collective_timeout:g} s",
                    STOPPED_HINT,
                )

    def _take_events(self, wait_s: float, task_id: int, world_size: int, collected: dict, allow_errors: bool) -> float:
        """Take what the ranks' threads posted (waiting up to ``wait_s`` for the first), then judge the ranks
        whose process ended; the longest task time among the results taken."""
        seconds = 0.0
        waiting = [r for r in self._exited if r < world_size and r not in self._drained and r not in collected]
        orphans = {r for r in waiting if self._ranks[r].orphaned()}  # still running: their results may come
        pending_deaths = [self._exited[r] for r in waiting if r not in orphans]
        if pending_deaths:  # wake up when a dead rank's last result is overdue
            wait_s = min(wait_s, max(0.0, min(pending_deaths) + LAST_RESULT_S - time.monotonic()))
        if orphans:  # no sentinel tells when they end: look again soon
            wait_s = min(wait_s, ORPHAN_POLL_S)
        while True:
            try:
                kind, rank, data = self._events.get(timeout=wait_s) if wait_s > 0 else self._events.get_nowait()
            except queue.Empty:
                break
            wait_s = 0.0  # the rest only as far as they are already there
            if kind == "exited":
                self._exited[rank] = time.monotonic()
            elif kind == "closed":
                self._drained.add(rank)
            else:
                got_id, status, payload, spent = pickle.loads(data)
                if got_id != task_id or rank >= world_size:  # a late answer to an earlier, failed task
                    continue
                if status == "machine":
                    self._holding.add(rank)
                    if not allow_errors:
                        raise HostFailureError(*payload)
                    status, payload = "error", payload[0]
                seconds = max(seconds, spent)
                collected[rank] = (status, payload)
        now = time.monotonic()
        for rank, when in sorted(self._exited.items()):
            if rank >= world_size or rank in collected:
                continue
            if rank not in self._drained and now - when < LAST_RESULT_S:
                continue  # its result may still be on its way
            if self._ranks[rank].orphaned():
                continue  # it works on without its fork server: the run's deadline bounds the wait
            process = self._ranks[rank].process
            process.join(1.0)
            line, fix = exit_cause(rank, process.exitcode)
            if fix is None and process.exitcode == LOST_SERVER and fork_server_lost():
                line, fix = (
                    f"rank {rank} ended after the fork server that started it was killed (out of memory?); how it "
                    "ended was lost with the server",
                    KILLED_HINT,
                )
            limit = open_file_limit()
            if fix is None and process.exitcode == -signal.SIGABRT and limit is not None and limit < FEW_FILES:
                line, fix = f"{line} (out of open files? ulimit -n is {limit})", FILES_HINT
            if allow_errors:
                collected[rank] = ("died", line)
            elif fix is not None:
                raise HostFailureError(line, fix)
            else:
                raise RankFailure(line)
        return seconds

    def close(self) -> None:
        """Stop the ranks: an idle pool's finish at the end of their task pipe; a broken pool's are killed at
        once, those holding a machine failure last (the others must not see its process group go)."""
        if self._closed:
            return
        self._closed = True
        started = [r for r in self._ranks if r.process.pid is not None]
        if self._broken is None:
            for r in started:
                if r.idle():  # the end of its task pipe tells the rank to finish
                    _close_quietly(r.tasks)
            for r in started:
                r.reap(10)
            for r in started:  # told to finish, but no server says when they have: wait briefly, then kill below
                deadline = time.monotonic() + 5.0
                while r.orphaned() and time.monotonic() < deadline:
                    time.sleep(0.05)
        first = [r for r in reversed(started) if r.rank not in self._holding]
        for group in (first, [r for r in started if r.rank in self._holding]):
            orphans = [r for r in group if r.orphaned()]
            for r in group:
                r.kill()
            for r in group:
                r.reap(10)
            deadline = time.monotonic() + 10.0
            while any(running(cast(int, r.process.pid)) for r in orphans) and time.monotonic() < deadline:
                time.sleep(0.05)  # not our children: nothing to join, so wait until they are gone
        for r in self._ranks:
            r.close()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self._broken is None:  # interrupted or failed: stop the ranks at once
            self._broken = exc_type.__name__
        self.close()


def _close_quietly(connection) -> None:
    try:
        connection.close()
    except OSError:
        pass


def run_world(
    world_size: int,
    fn,
    *args,
    timeout: float = 180.0,
    collective_timeout: float | None = None,
    allow_errors: bool = False,
) -> list:
    """Results of ``fn(rank, world_size, *args)`` by rank, on W processes started for this call; raises on
    error, death, hang or timeout. ``allow_errors``: (status, value) per rank instead (``RankPool.run``).

    ``collective_timeout``, the process group's own, is ``timeout`` unless given: the run's bound is the
    hang detector, and a collective that waits for a slow rank (one still compiling, on a busy machine)
    must not fire before it. Give a shorter one only where a timeout is what is being tested."""
    with RankPool(world_size, collective_timeout=collective_timeout or timeout) as pool:
        return pool.run(world_size, fn, *args, timeout=timeout, allow_errors=allow_errors)
