"""What the replaced converters did while a script runs: each call's report, its summary line and file.

Shared by ``converters.py`` (a converter the script calls) and ``built.py`` (the torch SyncBatchNorm layers
a model builds itself, adopted where the model is wrapped or first runs).
"""

from __future__ import annotations

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

    def record(self, converter: str, called_at: str, report: "Report") -> None:
        """Keep the call; on rank 0, print its summary line and write its report."""
        from bnsurgeon import __version__

        report.source = f"{converter} at {called_at}"
        report.tool_version = report.tool_version or __version__
        conversion = Conversion(converter, called_at, report)
        self.conversions.append(conversion)
        if rank() != 0:
            return
        if not self.quiet:
            print(summary(conversion), file=sys.stderr, flush=True)
        if self.report_path is not None:
            from bnsurgeon.files.safewrite import write_files

            path = next_free(self.report_path)
            text = report.to_json() + "\n"
            write_files({path: lambda temp: temp.write_text(text)}, force=True)


def numbered(path: Path, count: int) -> Path:
    """``--report run.json``: the first conversion's report there, the second's in ``run.2.json``, ..."""
    return path if count == 1 else path.with_name(f"{path.stem}.{count}{path.suffix}")


def next_free(path: Path) -> Path:
    """The first of PATH, NAME.2.json, ... that does not exist: the run removed (or refused) the earlier run's
    before the script started, so those that exist are this run's, written by this process or by another
    one of the run (a spawned rank 0, Lightning's), which keeps no count in common with this one."""
    count = 1
    while os.path.lexists(numbered(path, count)):
        count += 1
    return numbered(path, count)


def summary(conversion: Conversion) -> str:
    """The one line rank 0 prints for a conversion (a file name's control characters escaped)."""
    from bnsurgeon.core.layout import counted, printable
    from bnsurgeon.surgery.report import short

    report = conversion.report
    classes = ", ".join(
        f"{short(source)} -> {short(target)} {count}" for (source, target), count in report.class_changes().items()
    )
    what = "to bnsurgeon's exact sync BN" if report.target == "sync" else "back to their original classes"
    return printable(
        f"bnsurgeon run: {conversion.converter} at {conversion.called_at}: "
        f"{counted(len(report.changed), 'module')} {what}" + (f" ({classes})" if classes else "") + f"; "
        f"{len(report.kept)} kept, {len(report.unhandled)} unhandled"
    )


def rank() -> int:
    """This process's rank: the default group's when it exists, else torchrun's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def called_at(*outside: str) -> str:
    """``file:line`` of the first caller outside bnsurgeon (the script, or the framework that converts), and
    outside the directories ``outside`` names (torch's, for where a layer was built)."""
    skipped = (_PACKAGE_DIR, *outside)
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
