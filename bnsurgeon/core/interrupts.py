"""SIGINT, SIGTERM and SIGHUP as one exception, and a window in which none of them lands.

Schedulers preempt jobs with SIGTERM (and a closed terminal sends SIGHUP); by default
they kill the process on the spot, skipping every cleanup. Under ``signals_raise()`` they
raise ``Interrupted`` like Ctrl-C does, so temp files are removed and the message is true.
``signals_deferred()`` holds them for the few renames that commit an output, so a
signal lands either before anything is committed or after all of it is.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from bnsurgeon.core.errors import Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise(signum: int, frame) -> None:
    raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise ``Interrupted`` (exit code 128 + signal) inside the block."""
    if not _in_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise) for signum in HANDLED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def signals_collected() -> Iterator[list[int]]:
    """Hold the handled signals while the block runs; the caller reads which arrived (nothing is raised)."""
    arrived: list[int] = []
    if not _in_main_thread():
        yield arrived
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: arrived.append(signum)) for signum in HANDLED}
    try:
        yield arrived
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """Hold the handled signals until the block ends, then raise the first one that arrived."""
    with signals_collected() as arrived:
        yield arrived
    if arrived:
        raise Interrupted(arrived[0])


@contextmanager
def signals_ignored() -> Iterator[None]:
    """While the one line about an error or interruption is printed, a further Ctrl-C changes nothing: the
    process exits with the code the line names, not killed by the signal halfway through it (exit -2)."""
    if not _in_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in HANDLED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
