"""``bnsurgeon run --stats PATH`` and ``bnsurgeon.record_sync_gaps``: whether this model and data need sync BN.

Every rank records the gaps of its sync layers' first training steps (``runtime/gaps.py``: from the rows each
forward already gathers, no extra collective, no host read while recording); once the steps are recorded (or at
exit, for a shorter run), every rank summarizes the same numbers, and rank 0 writes the JSON document (PATH), its
picture (PATH with ``.html``) and one closing line on stderr with the verdict and its reason. The files follow
``--report``'s rules: checked before the script starts, written atomically to the first free name, never over a
file, earlier documents replaced only with ``--force``.

The verdict compares the median mean gap with the global batch's own sampling error, the standard error of its
mean in its own standard deviations: 1 / sqrt(B) for B samples in the global batch (the values of one sample
vary together, so counting samples, not values, is the error's upper bound). Above it, plain BN would move every
normalized value by more than the global batch's statistics are uncertain by: sync BN matters. Within it, sync
changes the statistics by less than their own noise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bnsurgeon.core.errors import OutputError
from bnsurgeon.core.layout import counted, printable
from bnsurgeon.launch.log import rank, say, write_report
from bnsurgeon.launch.outputs import REPORTS, RunOutput, read_what_we_wrote

KIND = "bnsurgeon sync gaps"
SCHEMA_VERSION = 1
DEFAULT_STEPS = 20


def picture_path(path: Path) -> Path:
    """The picture beside the document: PATH with its suffix replaced by ``.html`` (``gaps.json`` -> ``gaps.html``)."""
    return path.with_suffix(".html") if path.suffix and path.suffix != ".html" else path.with_name(path.name + ".html")


def holds_gaps(name: Path) -> bool:
    """Whether ``name`` is a regular file that a sync-gap run wrote: its document or its picture."""
    from bnsurgeon.launch.gaps_picture import MARK

    data = read_what_we_wrote(name)
    if data is None:
        return False
    if data.startswith(b"<!doctype html>\n" + MARK.encode()):
        return True
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and document.get("kind") == KIND


GAPS = RunOutput("--stats", "sync-gap document", lambda path: [path, picture_path(path)], holds_gaps)


def refuse_shared_names(report: Path | None, gaps: Path) -> None:
    """``--report`` and ``--stats`` naming the same file (or the picture's): refused before the script starts."""
    if report is not None and set(REPORTS.written(report)) & set(GAPS.written(gaps)):
        raise OutputError(
            f"--report {report} and --stats {gaps} name the same file",
            "give the reports and the sync-gap document different paths",
        )


def document(summary: dict[str, Any], world_size: int, source: str, patterns: Sequence[str]) -> dict[str, Any]:
    """The JSON document (schema: docs/report-schema.md) of a recorder's summary, with its verdict."""
    from bnsurgeon import __version__

    return {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "source": source,
        "world_size": world_size,
        "steps": summary["steps"],
        "layers_selected": list(patterns) or ["*"],
        "samples_per_rank": summary["samples_per_rank"],
        "noise": summary["noise"],
        "mean_gap": summary["mean_gap"],
        "scale_gap": summary["scale_gap"],
        "verdict": verdict(summary),
        "layers": summary["layers"],
    }


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Whether sync BN matters here, and the sentence that says so with its reason."""
    layers, noise = summary["layers"], summary["noise"]
    median, largest = summary["mean_gap"]["median"], summary["mean_gap"]["max"]
    if not layers or median is None or noise is None:
        return {"sync_matters": None, "line": "no sync layer ran in train mode under a process group: nothing measured"}
    samples = summary["samples_per_rank"]
    low, high = min(samples), max(samples)
    per_rank = f"{_count(low)}" if low == high else f"{_count(low)} to {_count(high)}"
    total = sum(samples)
    matters = median > noise
    said = (
        f"at {per_rank} samples per rank, sync changed batch means by a median {median:.2g} and at most "
        f"{largest:.2g} global standard deviations ({counted(len(layers), 'layer')}, {counted(summary['steps'], 'step')}): "
    )
    error = f"the global batch's own sampling error, 1/sqrt({_count(total)} samples) = {noise:.2g}"
    if matters:
        said += f"sync BN matters here (more than {error})"
    else:
        said += f"sync BN changes little here (within {error})"
    return {"sync_matters": matters, "line": said}


def _count(value: float) -> str:
    return f"{value:g}"


@dataclass
class GapOutput:
    """Where a recorder's summary goes: rank 0 writes PATH and its picture and says the verdict."""

    path: Path
    source: str
    patterns: Sequence[str] = ()
    quiet: bool = False
    prefix: str = "bnsurgeon run"
    #: a process the script started (not the run's own)
    child: bool = False

    def complete(self, recorder: Any) -> dict[str, Any] | None:
        """Summarize (every rank: the same numbers), and on rank 0 write and say. Best-effort, never fatal to
        training: a file that cannot be written is said in one line. A process whose sync layers never trained
        under a process group (the run's own where the script's children are the ranks, a helper process) writes
        nothing; the run's own process says so."""
        if not recorder.layers:
            speaker = recorder.rank if recorder.rank is not None else rank(child=self.child)
            if self.quiet or self.child or speaker != 0:  # said once, by the run's rank 0 (or its own process)
                return None
            if recorder.passed_over:
                names = list(recorder.passed_over)
                shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
                say(
                    printable(
                        f"{self.prefix}: --stats: --stats-layers {' '.join(self.patterns)} matched none of the sync "
                        f"layers that trained ({shown}), so no sync-gap document was written; give a pattern that "
                        "matches their names"
                    )
                )
            else:
                say(
                    f"{self.prefix}: --stats: no sync layer trained under a process group in this process, so it "
                    "wrote no sync-gap document (ranks it started write their own)"
                )
            return None
        summary = recorder.summarize()
        result = document(summary, _world_size(summary), self.source, self.patterns)
        if recorder.rank != 0:
            return result
        try:
            from bnsurgeon.core.json_text import dumps

            written = write_report(self.path, dumps(result, indent=2) + "\n")
            from bnsurgeon.launch.gaps_picture import render

            picture = write_report(picture_path(self.path), render(result))
        except Exception as error:  # a full disk, a directory gone: training goes on
            why = getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"
            say(f"{self.prefix}: the sync-gap document could not be written ({why}); training goes on")
            return result
        if not self.quiet:
            say(printable(f"{self.prefix}: {result['verdict']['line']}; wrote {written} and {picture}"))
        return result


def _world_size(summary: dict[str, Any]) -> int:
    return len(summary["samples_per_rank"])


@dataclass(frozen=True)
class GapRequest:
    """What ``--stats`` asks for: the document's path, how many training steps, which layers (shell patterns)."""

    path: str | os.PathLike
    steps: int = DEFAULT_STEPS
    layers: Sequence[str] = ()

    def settings(self, quiet: bool, source: str) -> dict[str, Any]:
        """As the run's children receive it (``BNSURGEON_RUN``)."""
        return {
            "path": os.fspath(self.path),
            "steps": self.steps,
            "layers": list(self.layers),
            "quiet": quiet,
            "source": source,
        }


def start_recording_gaps(
    path: Path,
    steps: int,
    layers: Sequence[str],
    *,
    quiet: bool,
    source: str,
    prefix: str = "bnsurgeon run",
    child: bool = False,
) -> "SyncGapRecording":
    """A recorder fed by this process's sync layers from their next call, whose summary goes to ``path`` on rank 0
    when ``steps`` steps are recorded or, at the latest, when the process exits."""
    import atexit

    from bnsurgeon.runtime.gaps import GapRecorder, start_recording

    recording = SyncGapRecording(GapOutput(path, source, list(layers), quiet, prefix, child))
    recording.recorder = GapRecorder(steps, layers, on_complete=recording.completed)
    start_recording(recording.recorder)
    atexit.register(recording.at_exit)
    return recording


class SyncGapRecording:
    """A sync-gap recording: ``finish()`` (or leaving its ``with`` block) ends it early and writes what was recorded;
    ``document`` is what was written (the same on every rank), None before."""

    def __init__(self, output: GapOutput) -> None:
        self.output = output
        self.recorder: Any = None
        self.document: dict[str, Any] | None = None
        self._pid = os.getpid()

    def completed(self, recorder: Any) -> None:
        self.document = self.output.complete(recorder)

    def finish(self) -> None:
        """End the recording now (writing what was recorded, once); ``document`` then holds it."""
        import atexit

        from bnsurgeon.runtime.gaps import stop_recording

        atexit.unregister(self.at_exit)
        if self.recorder is not None and not self.recorder.done:
            self.recorder.finish()
        stop_recording(self.recorder)

    def at_exit(self) -> None:
        if os.getpid() == self._pid:  # not in a fork of this process that exits while it goes on
            self.finish()

    def __enter__(self) -> "SyncGapRecording":
        return self

    def __exit__(self, *_: Any) -> None:
        self.finish()


def record_sync_gaps(
    path: str | os.PathLike,
    *,
    steps: int = DEFAULT_STEPS,
    layers: Sequence[str] = (),
    force: bool = False,
    quiet: bool = False,
) -> SyncGapRecording:
    """Record, for a script that converts its model itself, how far each rank's batch statistics are from the
    global batch's in the sync layers' first ``steps`` training steps (those whose names match ``layers``, shell
    patterns; all by default), as ``bnsurgeon run --stats`` does: rank 0 writes ``path`` (JSON) and its picture
    (``.html``) and says the verdict in one line on stderr once the steps are recorded, or when the recording
    ends (``finish()``, the end of a ``with`` block, the process's exit). ``path`` follows ``--report``'s rules:
    an existing document is replaced only with ``force``, never another file."""
    from bnsurgeon.launch.log import rank as this_rank
    from bnsurgeon.launch.outputs import check_report, claim_report, report_location

    if steps < 1:
        from bnsurgeon.core.errors import UsageError

        raise UsageError(f"steps must be at least 1, not {steps}", "record at least one step: steps=20")
    first = this_rank() in (0, None)
    where, earlier = check_report(report_location(path, GAPS), force=force, first=first, kind=GAPS)
    claim_report(where, [], earlier, force=force, first=first, kind=GAPS)
    return start_recording_gaps(
        where, steps, layers, quiet=quiet, source="bnsurgeon.record_sync_gaps", prefix="bnsurgeon"
    )
