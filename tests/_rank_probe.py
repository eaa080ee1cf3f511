"""Functions run inside ranks by test_multiproc (importable by name; importing this module imports no torch)."""

from __future__ import annotations

import os
import sys


def environment_and_modules(rank: int, world_size: int, name: str) -> tuple[str | None, bool, int]:
    """What a rank sees: the variable ``name``, whether timm was already imported when the task began
    (the fork server's preload), and the process id."""
    return os.environ.get(name), "timm" in sys.modules, os.getpid()


def sleeping(rank: int, world_size: int, seconds: float, marker: str) -> int:
    """Say that the task began (rank 0 touches ``marker``), then sleep: a rank busy when Ctrl-C comes."""
    import time
    from pathlib import Path

    if rank == 0:
        Path(marker).touch()
    time.sleep(seconds)
    return rank


def killed_in_a_collective(rank: int, world_size: int) -> str:
    """Rank 1 is killed (SIGKILL, as the out-of-memory killer does) while rank 0 waits for it in a collective."""
    import signal
    import time

    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(3))
    return "finished"


def stopped_in_a_collective(rank: int, world_size: int) -> str:
    """Rank 1 stops itself (SIGSTOP, as a debugger or a cgroup freezer stops it) while rank 0 waits for it."""
    import signal
    import time

    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(3))
    return "finished"


def killed_after_its_result(rank: int, world_size: int) -> int:
    """Report, then be killed a moment later (rank 1): the pool learns it between tasks."""
    import signal
    import threading
    import time

    if rank == 1:
        threading.Thread(target=lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
    return rank


def killed_while_the_other_works(rank: int, world_size: int, seconds: float) -> str:
    """Rank 1 is killed at once; rank 0 is busy for ``seconds`` (as a rank waiting in a collective with a long
    timeout is): the run cannot succeed, and must not wait for rank 0."""
    import signal
    import time

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    return "finished"


def out_of_open_files(rank: int, world_size: int) -> str:
    """Rank 0, which hosts the group's store, runs into its open-file limit (as under ``ulimit -n 24``) while
    rank 1 waits on that store, as it does while the group is being made: had rank 0 let go of the store,
    rank 1's torch would print a C++ stack of some 20 lines."""
    import resource
    import time

    import torch.distributed as dist

    if rank == 0:
        time.sleep(0.5)
        resource.setrlimit(resource.RLIMIT_NOFILE, (3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        open(os.devnull).close()
    dist.distributed_c10d._get_default_store().wait(["never set"])
    return "finished"


def aborted(rank: int, world_size: int) -> int:
    """Rank 1 aborts, as gloo aborts a rank from a thread of its own when it cannot make a socket or pipe."""
    if rank == 1:
        os.abort()
    return rank
