"""What the replaced converters did while a script runs: each call's report, its summary line and file.

Shared by ``converters.py`` (a converter the script calls) and ``built.py`` (the torch SyncBatchNorm layers
a model builds itself, adopted where the model is wrapped or first runs).
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bnsurgeon.core.errors import BnSurgeonError

if TYPE_CHECKING:
    from bnsurgeon.surgery.report import Report

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass
class Conversion:
    """One call of a converter: which, from where, and the surgery's report."""

    converter: str
    called_at: str
    report: "Report"


@dataclass
class ConversionLog:
    """The options every replaced converter uses, and what the calls did.

    ``refusal`` is the error a replaced converter raised (an unhandled BN-like class, an
    uninitialized lazy BN): the runner tells it from the script's own exceptions by identity.
    """

    allow_unhandled: bool = False
    report_path: Path | None = None
    quiet: bool = False
    conversions: list[Conversion] = field(default_factory=list)
    refusal: BnSurgeonError | None = None
    #: a process the script started (not the run's own): its rank is not 0 just because it has none yet
    child: bool = False
    #: the process this log was made in: a process forked from it (a fork-start pool's worker) is not the run's own
    pid: int = field(default_factory=os.getpid)
    #: the RANK the run itself had (for a child: inherited from it, so no rank of the child's own)
    run_rank: str | None = field(default_factory=lambda: os.environ.get("RANK"))
    #: a failure to print or write already said (said once; training goes on)
    failed_output: bool = False
    #: False once the run's replacements are put back: one the script kept behaves as the original
    active: bool = True

    def record(self, converter: str, called_at: str, report: "Report") -> None:
        """Keep the call; on rank 0, print its summary line and write its report.

        Best-effort, bounded and never fatal: the conversion happened, and a line or report that cannot be
        written (stderr closed or its reader gone, a full disk) must not stop the script's training. No
        lock is taken and no signal held, so the script's own handlers run as they would under python.
        """
        from bnsurgeon import __version__

        if not self.active:
            return
        known = self.rank()
        who = "" if known is not None else f" (process {os.getpid()}: its rank is not known yet)"
        report.source = f"{converter} at {called_at}{who}"  # a report names the process its line names
        report.tool_version = report.tool_version or __version__
        conversion = Conversion(converter, called_at, report)
        self.conversions.append(conversion)
        if known is not None and known != 0:
            return
        if not self.quiet:
            say(summary(conversion, who))
        if self.report_path is not None:
            try:
                write_report(self.report_path, report.to_json() + "\n")
            except Exception as error:  # a full disk, or anything the script did to the process: training goes on
                if not self.failed_output:
                    self.failed_output = True
                    why = getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"
                    say(f"bnsurgeon run: the report could not be written ({why}); training goes on")

    def rank(self) -> int | None:
        """This process's rank, as ``rank`` tells it: a process other than the run's own (started or forked by the
        script) has no rank from the RANK it only inherited, nor from a process group its fork copied."""
        if os.getpid() != self.pid:  # forked from the process this log was made in (a fork-start pool's worker)
            return rank(child=True, inherited=FORK.rank, group_copied=FORK.with_group)
        return rank(child=self.child, inherited=self.run_rank)


def say(line: str) -> bool:
    """One line on stderr if it can be written; False if not (closed, no reader, not a file)."""
    stream = sys.stderr
    try:
        stream.write(line + "\n")
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()
    except Exception:  # the script's stream may raise anything (a wrapper's NotImplementedError, a closed file)
        return False
    return True


def write_report(path: Path, text: str) -> Path:
    """``text`` in the first free name of PATH, NAME.2.json, ..., atomically and never over an existing file.

    Written to a file with no name (Linux's O_TMPFILE: a process killed meanwhile, as a script's own SIGTERM
    handler may end it, leaves nothing behind), or else to a hidden temporary file beside it, then hard-linked to
    the name, which fails if the name exists: of several processes or threads converting at once, each report
    gets its own name. (A filesystem without hard links: the name is reserved by an exclusive create, then
    filled.) Files are created with mode 0666 and the kernel applies the umask: reading the umask means setting
    it, a race with the script's own threads.
    """
    handle = _unnamed_file(path.parent)
    if handle is not None:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            try:
                return _link_first_free(f"/proc/self/fd/{file.fileno()}", path)
            except OSError:  # no /proc, no hard links: a named temporary file says why, if it fails too
                pass
    import secrets

    temp = path.parent / f".bnsurgeon-report-{secrets.token_hex(8)}.tmp"
    handle = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        return _link_first_free(str(temp), path, temp)
    finally:
        if os.path.lexists(temp):
            os.unlink(temp)


#: why an unnamed file cannot be made here: a filesystem or kernel without O_TMPFILE
_NO_UNNAMED = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.ENOTSUP}


def _unnamed_file(directory: Path) -> int | None:
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    try:
        return os.open(directory, flag | os.O_WRONLY, 0o666)
    except OSError as error:
        if error.errno in _NO_UNNAMED:
            return None
        raise


def _link_first_free(source: str, path: Path, temp: Path | None = None) -> Path:
    """``source`` hard-linked to the first free name of ``path``; without hard links (``temp`` given), the name
    reserved by an exclusive create and ``temp`` moved there."""
    from bnsurgeon.files.safewrite import NO_LINKS

    count = 1
    while True:
        final = numbered(path, count)
        try:
            os.link(source, final)  # follows /proc/self/fd's link to the unnamed file (linkat, AT_SYMLINK_FOLLOW)
            return final
        except FileExistsError:
            count += 1
        except OSError as error:
            if error.errno not in NO_LINKS or temp is None:
                raise
            try:
                reserved = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                count += 1
                continue
            os.close(reserved)
            os.replace(temp, final)
            return final


def numbered(path: Path, count: int) -> Path:
    """``--report run.json``: the first conversion's report there, the second's in ``run.2.json``, ..."""
    return path if count == 1 else path.with_name(f"{path.stem}.{count}{path.suffix}")


def summary(conversion: Conversion, who: str = "") -> str:
    """The one line rank 0 prints for a conversion (a file name's control characters escaped); ``who`` names
    a process whose rank is not known."""
    from bnsurgeon.core.layout import counted, printable
    from bnsurgeon.surgery.report import short

    report = conversion.report
    classes = ", ".join(
        f"{short(source)} -> {short(target)} {count}" for (source, target), count in report.class_changes().items()
    )
    what = "to bnsurgeon's exact sync BN" if report.target == "sync" else "back to their original classes"
    return printable(
        f"bnsurgeon run{who}: {conversion.converter} at {conversion.called_at}: "
        f"{counted(len(report.changed), 'module')} {what}" + (f" ({classes})" if classes else "") + f"; "
        f"{len(report.kept)} kept, {len(report.unhandled)} unhandled"
    )


def rank(*, child: bool = False, inherited: str | None = None, group_copied: bool = False) -> int | None:
    """This process's rank: the default group's when it exists, else torchrun's RANK, else 0 for the run's own
    process and None (not known yet) for a process the script started (a spawn worker before it joins).

    A child's RANK equal to ``inherited`` (its parent's) was only inherited: ``torch.multiprocessing.spawn``
    workers of torchrun's rank 0 all see RANK=0, and none is rank 0 (None: it names itself); those of rank k > 0
    are silent as rank k is. ``group_copied``: a forked process whose parent had a process group holds a copy of
    it, not a rank of its own."""
    dist = sys.modules.get("torch.distributed")
    if not group_copied and dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    given = os.environ.get("RANK")
    try:
        number = int(given) if given is not None else None
    except ValueError:
        number = None
    if child and given == inherited:
        return number or None
    if number is None:
        return None if child else 0
    return number


@dataclass
class _Fork:
    """What a forked process inherited, read at the fork (``os.register_at_fork``): its parent's RANK, and whether
    its parent had a process group (copied by the fork, not one it joined)."""

    rank: str | None = None
    with_group: bool = False

    def forked(self) -> None:
        dist = sys.modules.get("torch.distributed")
        self.rank = os.environ.get("RANK")
        self.with_group = bool(dist is not None and dist.is_available() and dist.is_initialized())


FORK = _Fork()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=FORK.forked)


def called_at(*outside: str) -> str:
    """``file:line`` of the first caller outside bnsurgeon (the script, or the framework that converts), and
    outside the directories ``outside`` names (torch's, for where a layer was built)."""
    skipped = (_PACKAGE_DIR, *outside)
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
