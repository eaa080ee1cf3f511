"""The files ``bnsurgeon run`` writes on rank 0 (``--report``'s reports, ``--stats``' sync-gap document and its
picture), under one set of rules: the path checked before anything of the script runs, a regular file or nothing,
never the script, an existing file replaced only with ``--force`` and only where it holds what bnsurgeon wrote."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from bnsurgeon.core.errors import OutputError


def report_names(report: Path) -> list[Path]:
    """The report files a run may write: PATH, then NAME.2.SUFFIX, NAME.3.SUFFIX, ... (those that exist)."""
    pattern = re.compile(re.escape(report.stem) + r"\.([2-9]|[1-9]\d+)" + re.escape(report.suffix))
    try:
        numbered_names = [entry for entry in report.parent.iterdir() if pattern.fullmatch(entry.name)]
    except OSError:
        numbered_names = []
    return [report, *sorted(numbered_names)]


def report_location(report: str | os.PathLike, kind: "RunOutput | None" = None) -> Path:
    """``--report`` (or another ``kind`` of output) as an absolute path. A name ending in a separator names a
    directory, and a report is a file: refused, not read as the file without the slash (as ``os.path.abspath`` and
    a click Path would drop it)."""
    option, noun = (kind or REPORTS).option, (kind or REPORTS).noun
    text = os.fspath(report)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    name = os.path.basename(text)
    if text.endswith(("/", os.sep)) or name in (".", ".."):
        raise OutputError(
            f"{option} {text}: a name ending in {os.sep}, {os.sep}. or {os.sep}.. names a directory, and a {noun} is "
            "a file",
            f"give a file path such as {text.rstrip('/' + os.sep + '.') or '.'}{os.sep}run.json",
        )
    parent = os.path.dirname(text) or "."
    if ".." in Path(parent).parts:  # resolved as the system resolves it (a missing or linked directory before ..)
        if not os.path.isdir(parent):
            raise OutputError(
                f"{option} {text}: the directory {parent!r} does not exist, as the system reads the path",
                "create it first, or give the path without ..",
            )
        return Path(os.path.realpath(parent)) / name
    return Path(os.path.abspath(text))


@dataclass(frozen=True)
class RunOutput:
    """A kind of file ``bnsurgeon run`` writes on rank 0 under the rules of ``--report``: the option that names it,
    what it is called in messages, the files a run may write for a PATH, and whether an existing file holds one
    (only such files are ever replaced, with ``--force``)."""

    option: str
    noun: str
    #: the files a run writes for PATH (each may be numbered: NAME.2.SUFFIX, ...)
    written: Callable[[Path], list[Path]]
    holds: Callable[[Path], bool]

    def names(self, path: Path) -> list[Path]:
        """The files of this kind a run may have written for PATH (those numbered that exist)."""
        return [name for first in self.written(path) for name in report_names(first)]


def check_report(
    report: str | os.PathLike,
    *,
    force: bool,
    first: bool,
    script: str | None = None,
    kind: "RunOutput | None" = None,
) -> tuple[Path, list[Path]]:
    """``--report`` (or another ``kind`` of output), absolute (a script that changes directory writes it where it
    was asked for), checked before anything of the script runs (a package's ``__init__`` for ``-m`` included): a
    name the filesystem takes, in a directory whose files can be created; a regular file or nothing (a FIFO, a
    device, a link, a directory is refused and never removed, ``--force`` or not); existing reports (PATH,
    NAME.2.SUFFIX, ...) only with ``force``. ``first``: this process writes the reports (rank 0 of a torchrun
    launch): only it looks at existing ones. Returns the path and the earlier run's reports, which ``claim_report``
    removes once the script's own file is known (only those: a report a package's ``__init__`` wrote meanwhile is
    this run's)."""
    import tempfile

    kind = kind or REPORTS
    option, noun = kind.option, kind.noun
    path = Path(os.path.abspath(report))
    limit = _name_max(path.parent)
    longest = max(kind.written(path), key=lambda name: len(os.fsencode(name.name)))
    if len(os.fsencode(longest.name)) + len(".999") > limit:  # room for NAME.999.SUFFIX
        raise OutputError(
            f"{option} {path}: the file name is too long ({len(os.fsencode(longest.name))} bytes; this filesystem takes "
            f"{limit}, and numbered {noun}s add up to 4)",
            f"choose a shorter {noun} name",
        )
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise OutputError(f"{option} {path}: the directory {str(parent)!r} {what}", "create it first")
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{option} {path} is a directory", "give a file path such as run.json")
    _refuse_special(path, path, kind)
    try:
        probe, probe_path = tempfile.mkstemp(dir=parent, prefix=".bnsurgeon-probe-")
        os.close(probe)
        os.unlink(probe_path)
    except OSError as error:
        raise OutputError(
            f"{option} {path}: cannot create a file in {parent} ({error.strerror or error})",
            "choose a directory you can write to",
        ) from None
    if not first:
        return path, []
    existing = [name for name in kind.names(path) if os.path.lexists(name)]
    for name in existing:
        _refuse_special(path, name, kind)
    runs = [] if script is None else [script, os.path.join(script, "__main__.py")]
    for name in existing:  # first: no --force makes this path usable
        said = next((given for given in runs if _same_file(name, given)), None)
        if said is not None:
            raise OutputError(
                f"{option} {path} would write over the script {said}",
                f"choose another {noun} path; bnsurgeon never overwrites what it runs, --force or not",
            )
    for name in existing:  # --force replaces reports, never a file of the user's (a package's __init__.py)
        if not kind.holds(name):
            raise OutputError(
                f"{option} {path}: {name} exists and is not a bnsurgeon {noun}; --force replaces only the {noun}s "
                "of an earlier run, and bnsurgeon never removes another file",
                f"choose another {noun} path",
            )
    if existing and not force:
        raise OutputError(
            f"{option} {path}: {existing[0]} already exists",
            f"pass --force to replace the {noun}s of an earlier run, or choose another path",
        )
    return path, existing


#: the most of an existing file read to tell whether it is a report (a run's reports are kilobytes to megabytes)
REPORT_READ_LIMIT = 64 * 1024 * 1024
#: what every report's JSON starts with (``Report.to_json``: its first field), and the fields it always has
REPORT_START = b'{\n  "target": '
REPORT_FIELDS = frozenset({"target", "changed", "kept", "unhandled", "schema_version", "tool_version"})


def read_what_we_wrote(name: Path) -> bytes | None:
    """The bytes of ``name`` where it is a regular file of at most ``REPORT_READ_LIMIT``, read without following a
    link or waiting on a FIFO put there meanwhile; None otherwise."""
    import stat

    try:
        handle = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return None
        with os.fdopen(handle, "rb", closefd=False) as file:
            data = file.read(REPORT_READ_LIMIT + 1)
    except OSError:
        return None
    finally:
        os.close(handle)
    return data if len(data) <= REPORT_READ_LIMIT else None


def holds_a_report(name: Path) -> bool:
    """Whether ``name`` is a regular file holding a bnsurgeon report (a JSON document as ``Report.to_json`` writes
    it)."""
    import json

    data = read_what_we_wrote(name)
    if data is None or not data.startswith(REPORT_START):
        return False
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and REPORT_FIELDS <= document.keys()


REPORTS = RunOutput("--report", "report", lambda path: [path], holds_a_report)


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _refuse_special(report: Path, name: Path, kind: "RunOutput | None" = None) -> None:
    """A name that exists and is not a regular file (a FIFO, a device, a socket, a symbolic link, /dev/stdout) is
    no report of an earlier run: refused, and never removed."""
    import stat

    try:
        mode = os.lstat(name).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    what = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    kind = kind or REPORTS
    raise OutputError(
        f"{kind.option} {report}: {name} is {what}; {kind.noun}s are written only as regular files, and bnsurgeon "
        "never removes anything else",
        "give the path of a regular file (or of none yet)",
    )


def claim_report(
    path: Path,
    run: Sequence[str],
    earlier: Sequence[Path],
    *,
    force: bool,
    first: bool,
    kind: "RunOutput | None" = None,
) -> None:
    """Once the file that runs is known (a script, a directory's or zip's ``__main__``, a module's file), before
    its first line: no report name is that file (by identity: a hard link too), then, with ``force``, the
    earlier run's reports (``earlier``, found by ``check_report``) are removed, so that a report there afterwards
    is this run's."""
    kind = kind or REPORTS
    option, noun = kind.option, kind.noun
    firsts = kind.written(path)
    patterns = [re.compile(re.escape(name.stem) + r"(\.\d+)?" + re.escape(name.suffix)) for name in firsts]
    names = kind.names(path)
    for given in run:
        entry = Path(os.path.realpath(given))
        same_place = entry.parent == Path(os.path.realpath(path.parent)) and any(
            pattern.fullmatch(entry.name) for pattern in patterns
        )
        if same_place or any(_same_file(name, given) for name in names):
            raise OutputError(
                f"{option} {path} would write over the script {given}",
                f"choose another {noun} path; bnsurgeon never overwrites what it runs, --force or not",
            )
    if not first or not force:
        return
    for name in earlier:
        if os.path.lexists(name):
            _refuse_special(path, name, kind)
            if not kind.holds(name):  # replaced since it was checked (by a package's __init__ for -m)
                raise OutputError(
                    f"{option} {path}: {name} is no longer a bnsurgeon {noun}; bnsurgeon never removes another file",
                    f"choose another {noun} path",
                )
            name.unlink()


def _same_file(name: Path, other: str) -> bool:
    try:
        return os.path.samefile(name, other)
    except OSError:
        return False
