"""Write files as one unit: all of them complete, or none of them changed.

Each file is written inside a private staging directory next to the outputs
(``.OUT.bnsurgeon-tmp-<pid>-<random>``), fsynced and given its final mode (the umask for
a new file, the old file's mode for one replaced with ``force``). Then, with signals
held, every file is committed: without ``force`` by a hard link, which fails if the name
exists, so of two concurrent writers exactly one wins and nothing is clobbered; with
``force`` by rename. A run killed outright (SIGKILL) leaves only its staging directory,
which the next write to the same output removes once its process is gone.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from bnsurgeon.core.errors import BnSurgeonError, Interrupted, OutputError
from bnsurgeon.core.interrupts import signals_collected, signals_deferred

TEMP_MARK = ".bnsurgeon-tmp-"
#: errnos meaning "this filesystem has no hard links": fall back to an exclusive create
NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EXDEV}
#: how a full disk reads inside another library's error (safetensors wraps the OS error in its own)
DISK_FULL = re.compile(r"no space left|quota|StorageFull|QuotaExceeded|file too large|FileTooLarge", re.IGNORECASE)
#: the longest suffix bnsurgeon adds to an output's name (temp directory, report names)
NAME_OVERHEAD = len(TEMP_MARK) + 1 + 10 + 1 + 8 + len(".report.json")


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on the output directory itself (no lock file to leave behind) while a unit is
    committed; a filesystem without flock commits unlocked, as before."""
    import fcntl

    try:
        handle = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(handle)  # releases the lock


def new_file_mode() -> int:
    """0666 minus the process's umask: what open() would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: Path, name: str) -> list[Path]:
    """Remove staging directories for ``name`` left by runs whose process is gone."""
    pattern = re.compile(re.escape(f".{name}{TEMP_MARK}") + r"(\d+)-[0-9a-f]+$")
    removed: list = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(handle)


def _link_new(temp: Path, final: Path, mode: int) -> None:
    """Create ``final`` from ``temp`` only if no file has that name (atomic)."""
    try:
        os.link(temp, final)
        return
    except FileExistsError:
        raise
    except OSError as error:
        if error.errno not in NO_LINKS:
            raise
    handle = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)  # reserve the name, then fill it
    os.close(handle)
    os.replace(temp, final)


def _keep_previous(staged: dict, stage: Path) -> dict[Path, Path | None]:
    """Hard links to the files ``force`` will replace, so that a failed commit can put them back.

    None for a name that did not exist (a rollback removes it); a filesystem without hard
    links gets no backup for that name (a rollback cannot restore it and says so).
    """
    backups: dict[Path, Path | None] = {}
    for index, final in enumerate(staged):
        if not os.path.lexists(final):
            backups[final] = None
            continue
        backup = stage / f"previous-{index}"
        try:
            os.link(final, backup, follow_symlinks=False)
            backups[final] = backup
        except OSError:
            pass
    return backups


def _roll_back(committed: list[Path], backups: dict[Path, Path | None], force: bool) -> list[Path]:
    """Undo a partial commit; returns the names still holding this run's files."""
    left = []
    for final in committed:
        if not force:
            final.unlink(missing_ok=True)
        elif final in backups:
            try:
                backup = backups[final]
                if backup is None:
                    final.unlink(missing_ok=True)
                else:
                    os.replace(backup, final)
            except OSError:
                left.append(final)
        else:
            left.append(final)
    return left


def _remove_stage(stage: Path) -> int | None:
    """Remove the staging directory with signals held, so that a second Ctrl-C cannot leave it behind;
    returns the first signal that arrived meanwhile."""
    with signals_collected() as arrived:
        shutil.rmtree(stage, ignore_errors=True)
    return arrived[0] if arrived else None


def _names(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths)


def write_files(writers: dict[Path, Callable[[Path], object]], *, force: bool) -> list[Path]:
    """Write every ``path: write(temp_path)`` as one unit; returns the paths written.

    On any failure or interruption nothing is committed (existing files are untouched)
    and the error says so.
    """
    finals = list(writers)
    directory = finals[0].parent
    for final in finals:
        remove_stale_temps(directory, final.name)
    stage = directory / f".{finals[0].name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    existing = [final for final in finals if os.path.lexists(final)]
    untouched = f"nothing was written; {_names(existing)} unchanged" if existing else "nothing was written"
    committed: list[Path] = []
    current = finals[0]
    succeeded = False
    try:
        os.mkdir(stage, 0o700)
        staged = {}
        default_mode = new_file_mode()
        for final, write in writers.items():
            current = final
            temp = stage / final.name
            write(temp)
            _fsync(temp)
            mode = os.stat(final).st_mode & 0o7777 if force and final.exists() else default_mode
            os.chmod(temp, mode)
            staged[final] = (temp, mode)
        # held signals, and one writer at a time in this directory: of two --force runs to one output, the
        # checkpoint and its reports all come from the same run
        with signals_deferred(), _directory_lock(directory):
            backups = _keep_previous(staged, stage) if force else {}
            try:
                for final, (temp, mode) in staged.items():
                    current = final
                    if force:
                        os.replace(temp, final)
                    else:
                        _link_new(temp, final, mode)
                    committed.append(final)
            except BaseException:
                committed[:] = _roll_back(committed, backups, force)
                raise
        _fsync(directory, directory=True)
        succeeded = True
        return finals
    except FileExistsError:
        raise OutputError(
            f"{current} appeared while bnsurgeon was writing (another run?); {untouched} by this run",
            "pass --force to replace it, or choose another path",
        ) from None
    except OSError as error:
        done = f"; {_names(committed)} were replaced" if committed else f"; {untouched}"
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        raise OutputError(
            f"could not write {current}: {error.strerror or error}{done}",
            "free disk space or choose another directory" if full else "choose a directory you can write to",
        ) from None
    except BnSurgeonError:
        raise
    except Exception as error:  # e.g. safetensors' SafetensorError wrapping an I/O error
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        full = DISK_FULL.search(str(error)) is not None
        raise OutputError(
            f"could not write {current}: {text}; {untouched}",
            "free disk space or choose another directory"
            if full
            else "not a disk problem bnsurgeon knows of: run again with BNSURGEON_DEBUG=1 for the "
            "traceback, and report it",
        ) from None
    except Interrupted as interrupt:
        interrupt.state = f"{_names(committed)} written completely" if len(committed) == len(finals) else untouched
        raise
    except KeyboardInterrupt as interrupt:
        raise Interrupted(signal.SIGINT, untouched) from interrupt
    finally:
        late = _remove_stage(stage)
        if late is not None and succeeded:  # the files are in place: say so, not "nothing was written"
            raise Interrupted(late, f"{_names(finals)} written completely")
