"""Other processes of this machine, read without signalling them: whether one runs, and whether it is the same
process that was there before (pids are reused; its start time, where /proc tells, is not).

Imports nothing but the standard library, and nothing of bnsurgeon: ``bnsurgeon run``'s start-up in a child
process loads this file alone (``launch/_child/sitecustomize.py``), so that a process no live run started imports
no bnsurgeon.
"""

from __future__ import annotations

import json
import os
from typing import Any


def stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): field 3 (state) is index 0,
    so field N is index N - 3. Raises OSError where there is no such process or no /proc."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat); None where /proc
    does not tell."""
    try:
        return stat_fields(pid)[19].decode("ascii")
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and (where /proc tells) is not a zombie waiting to be reaped.
    Only looked at: ``kill(pid, 0)`` sends no signal, and is asked only on POSIX (on Windows it would end it)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        pass
    try:
        return stat_fields(pid)[0] != b"Z"
    except (OSError, IndexError):
        return True


def still_running(pid: int, started: str | None) -> bool:
    """Whether the process that was ``pid`` when it started at ``started`` (``start_time``) still runs, not
    another process that was given its pid since; where the start time is not known, whether ``pid`` runs."""
    if not running(pid):
        return False
    return started is None or start_time(pid) in (None, started)


def live_run(text: str) -> dict[str, Any] | None:
    """The settings ``text`` (JSON) of the process that wrote them, where that process still runs; None where
    ``text`` is not such settings (a hand-set value, one truncated) or their process has ended (a leaked value)."""
    try:
        values = json.loads(text)
    except ValueError:
        return None
    if not isinstance(values, dict) or not isinstance(values.get("run"), str):
        return None
    pid, started = values.get("pid"), values.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or not (started is None or isinstance(started, str)):
        return None
    if started is None and start_time(os.getpid()) is not None:  # a run here records its start time: not one
        return None
    return values if still_running(pid, started) else None
