"""Human output (plain aligned text, to stderr) and machine output (one JSON document, to stdout).

Human output is read in logs and CI as often as in a terminal, so it is plain aligned
columns (``layout.py``). On a terminal, tables are fitted to its width (``COLUMNS`` when set):
long cells shortened, the least useful columns dropped. Off a terminal nothing is cut: every
column, every cell whole (``table_width``); prose wraps at ``COLUMNS`` or ``PIPED_WIDTH``.
Colour is added only on a terminal (Rich decides; ``NO_COLOR`` is
honoured). Nothing here imports torch: ``bnsurgeon rules`` renders without it.
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable

from rich.console import Console
from rich.text import Text

from bnsurgeon.core.errors import bounded
from bnsurgeon.core.json_text import dumps
from bnsurgeon.core.layout import Column, clipped, counted, printable, table_lines, wrap  # noqa: F401 (printable: every untrusted text's way out)
from bnsurgeon.surgery.report import collapse_paths, short

if TYPE_CHECKING:
    from bnsurgeon.surgery.inspection import Inspection
    from bnsurgeon.surgery.report import Report

PIPED_WIDTH = 160
STYLES = {
    r"\b(FAIL(ED)?|failed)\b": "bold red",
    r"\bUNHANDLED\b": "bold red",
    r"\bpass(ed)?\b": "green",
    r"^error:": "bold red",
}


def output_width(stream=None) -> int:
    """COLUMNS when set; else the terminal's width; else PIPED_WIDTH (logs do not wrap)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    stream = stream or sys.stderr
    if hasattr(stream, "isatty") and stream.isatty():
        return shutil.get_terminal_size((PIPED_WIDTH, 24)).columns
    return PIPED_WIDTH


def console() -> Console:
    """Stderr console at the output width; Rich never wraps (lines are fitted here)."""
    return Console(stderr=True, highlight=False, soft_wrap=True, width=output_width())


#: the width of a table that is not on a terminal: no limit, so that no cell is cut and no column dropped
UNCUT = sys.maxsize


def table_width(out: Console) -> int:
    """The width a table is fitted to: the terminal's (or COLUMNS) on a terminal. Off one (a file, a pipe,
    a CI log) nothing is ever cut: a log is read after the fact, and there is no screen edge to fit."""
    try:  # the stream itself: FORCE_COLOR makes Rich say "terminal"
        on_terminal = bool(out.file.isatty())
    except (AttributeError, OSError, ValueError):  # no isatty, or a closed stream
        on_terminal = False
    return out.width if on_terminal else UNCUT


#: a cell is never longer, terminal or not: a name from a file may be a megabyte (cut, with its length said)
MAX_CELL = 1000


def fitted(out: Console, columns: list[Column], rows: list[list[str]], *, header: bool = True) -> list[str]:
    """The table's lines for ``out``: fitted to a terminal, whole off one (``table_width``)."""
    rows = [[clipped(cell, MAX_CELL) for cell in row] for row in rows]
    return table_lines(columns, rows, table_width(out), header=header)


def emit(out: Console, lines: Iterable[str]) -> None:
    """Print finished lines, status words coloured on a terminal, flushed (logs see each line)."""
    for line in lines:
        text = Text(printable(line))  # the last guard: nothing from a file reaches the terminal raw
        for pattern, style in STYLES.items():
            text.highlight_regex(pattern, style)
        out.print(text)
    out.file.flush()


#: no prose line is longer, whatever it quotes (a safety net: each quoted name is clipped first)
MAX_SAID = 4000


def say(out: Console, text: str, indent: str = "  ") -> None:
    """A prose line (summary, note), wrapped at the width, at most ``MAX_SAID`` characters."""
    emit(out, wrap(bounded(text, MAX_SAID), out.width, indent))


@contextmanager
def phases(out: Console, enabled: bool = True):
    """A spinner on stderr naming the current phase (only on a terminal); yields the updater."""
    if not enabled or not out.is_terminal:
        yield lambda text: None
        return
    with out.status("starting") as status:  # Text, never markup: the phase names the SOURCE path
        yield lambda text: status.update(Text(printable(f"{text} ...")))


#: this command's --json: asked for (set by the option, eagerly, before any other value is judged), and whether
#: its document is out; a failure with none out yet prints the error as the document (one per command)
JSON_OUTPUT = {"wanted": False, "emitted": False}


def want_json(value: bool) -> bool:
    """The --json option's callback (eager: every other option's refusal already knows)."""
    JSON_OUTPUT.update(wanted=bool(value), emitted=False)
    return value


def emit_json(data: Any) -> None:
    JSON_OUTPUT["emitted"] = True
    sys.stdout.write(dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit_json_error(message: str, hint: str, exit_code: int) -> None:
    """A command that fails under --json before its document is out: the error is the one document."""
    if JSON_OUTPUT["wanted"] and not JSON_OUTPUT["emitted"]:
        emit_json({"error": {"message": message, "fix": hint, "exit_code": exit_code}})


#: entries of a checkpoint (and carried entries) listed without -v; a file may hold 200,000 (--json has them all)
MAX_LISTED_ENTRIES = 40


def render_checkpoint(contents: dict, out: Console, *, verbose: bool = False) -> None:
    say(out, f"{contents['path']} ({contents['format']}):")
    weights = contents["model_weights"]
    rows = []
    entries = contents["entries"]
    shown = entries
    if not verbose and len(entries) > MAX_LISTED_ENTRIES:  # entries holding tensors first, in the file's order
        keep = {id(e) for e in [e for e in entries if e["tensors"]][:MAX_LISTED_ENTRIES]}
        keep |= {id(e) for e in [e for e in entries if not e["tensors"]][: MAX_LISTED_ENTRIES - len(keep)]}
        shown = [e for e in entries if id(e) in keep]
    for entry in shown:
        looks = "yes" if entry["key"] in weights or (entry["key"] == "<top level>" and weights) else ""
        rows.append([entry["key"], entry["type"], str(entry["tensors"]), looks])
    columns = [
        Column("entry", shrink=True, min_width=16),
        Column("type", shrink=True),
        Column("tensors", "right"),
        Column("model weights?", short_header="weights?"),
    ]
    emit(out, fitted(out, columns, rows))
    if len(rows) < len(entries):
        say(out, f"... and {len(entries) - len(rows):,} more entries (-v lists them all)")
    if contents["bnsurgeon"]:
        say(out, "a bnsurgeon checkpoint (self-describing)")


INSPECT_COLUMNS = [
    Column("class"),
    Column("count", "right"),
    Column("rule"),
    Column("--to sync", priority=3),
    Column("--to plain", priority=5),
    Column("--to frozen", priority=4),
    Column("torch convert_sync_batchnorm", priority=2, shrink=True, min_width=20, short_header="torch converter"),
    # dropped after the example paths, before --to plain (equal priority: the later column goes first)
    Column("transformers replace_batch_norm", priority=5, shrink=True, min_width=30, short_header="HF replace_bn"),
    Column("example paths", priority=6, shrink=True, min_width=20),
]


def render_inspection(inspection: "Inspection", out: Console, *, verbose: bool = False) -> None:
    if inspection.checkpoint is not None:
        render_checkpoint(inspection.checkpoint, out, verbose=verbose)
    if not inspection.groups and inspection.checkpoint is not None:
        for note in inspection.notes:
            say(out, f"note: {note}")
        return
    rows = [
        [
            short(g.cls),
            str(g.count),
            g.rule or "UNHANDLED",
            g.targets["sync"],
            g.targets["plain"],
            g.targets["frozen"],
            g.torch_converter,
            g.transformers_replace,
            ", ".join(g.examples),
        ]
        for g in inspection.groups
    ]
    if rows:
        emit(out, fitted(out, INSPECT_COLUMNS, rows))
    say(
        out,
        f"{counted(inspection.bn_modules, 'BN-family module')} in "
        f"{len(inspection.groups)} {'class' if len(inspection.groups) == 1 else 'classes'}, "
        f"{inspection.unhandled} unhandled; {inspection.parameters:,} parameters.",
        indent="",
    )
    if verbose:
        for group in inspection.groups:
            say(out, f"{short(group.cls)} ({counted(group.paths, 'path')}): " + ", ".join(group.all_paths))
    for note in inspection.notes:
        say(out, f"note: {note}", indent="")


def _patterns(paths: list[str], verbose: bool) -> str:
    patterns = collapse_paths(paths)
    shown = patterns if verbose else patterns[:3]
    text = ", ".join(f"{p} x{n}" if n > 1 else p for p, n in shown)
    if len(shown) < len(patterns):
        text += f", ... ({counted(len(patterns) - len(shown), 'more pattern')})"
    return text


def fusion_summary(fusion: dict[str, Any]) -> str:
    """One line for --to fused: BN before/after, folds, how producers were found, the measured error."""
    errors = fusion.get("max_rel_error") or {}
    measured = ", ".join(f"{k.replace('_', ' ')} {v:.2g}" for k, v in errors.items())
    folded = len(fusion["folded"])
    return (
        f"fused: {folded} BN folded into {'its producer' if folded == 1 else 'their producers'}, "
        f"{len(fusion['left'])} left; "
        f"BN modules {fusion['bn_before']} -> {fusion['bn_after']}; producers from {fusion['method']}"
        + (f"; max relative error {measured}" if measured else "")
    )


def render_report(report: "Report", out: Console, *, verbose: bool = False) -> None:
    grouped: dict[tuple[str, str], list[str]] = {}
    for change in report.changed:
        grouped.setdefault((change.from_class, change.to_class), []).append(change.path)
    rows = [
        [short(src), "->", short(dst), str(len(paths)), _patterns(paths, verbose)]
        for (src, dst), paths in sorted(grouped.items())
    ]
    columns = [
        Column("from", shrink=True, min_width=14),
        Column(""),
        Column("to", shrink=True, min_width=14),
        Column("count", "right"),
        Column("paths", priority=1, shrink=True, min_width=20),
    ]
    if rows:
        if verbose:  # every pattern: on lines of their own rather than shortened in a cell
            emit(out, fitted(out, columns[:-1], [row[:-1] for row in rows], header=False))
            for row in rows:
                say(out, f"{row[0]} -> {row[2]}: {row[4]}")
        else:
            emit(out, fitted(out, columns, rows, header=False))
    totals = report.totals
    say(
        out,
        f"{totals['changed']} converted, {totals['kept']} kept, {totals['unhandled']} unhandled; "
        f"state-dict keys +{totals['keys_added']} -{totals['keys_removed']}",
        indent="",
    )
    for item in report.kept + report.unhandled:
        if verbose or item.rule is None:
            say(out, f"  kept {item.path} ({short(item.cls)}): {item.reason}", indent="    ")
    if report.kept and not verbose:
        reasons = sorted({item.reason for item in report.kept})
        say(out, f"  {len(report.kept)} kept: " + "; ".join(reasons), indent="    ")
    if report.check is not None:
        check = report.check
        status = "passed" if check.passed else "FAILED"
        shown = getattr(check, "input", "") or tuple(check.input_shape)
        say(
            out,
            f"eval check ({check.mode}, input {shown}): {status}, "
            f"max |diff| {check.max_abs_diff:.3g}" + (f"; {check.note}" if check.note else ""),
            indent="",
        )
    if report.fusion is not None:
        say(out, fusion_summary(report.fusion), indent="")
    if report.carried:
        carried = list(report.carried.items())
        shown = carried if verbose else carried[:MAX_LISTED_ENTRIES]
        say(
            out,
            "carried from the source checkpoint: "
            + "; ".join(f"{clipped(name)} ({what})" for name, what in shown)
            + (
                f"; ... and {len(carried) - len(shown):,} more (-v lists them all)" if len(shown) < len(carried) else ""
            ),
            indent="  ",
        )
    for note in sorted({n for change in report.changed for n in change.notes}):
        say(out, f"note: {note}", indent="")


def render_rules(rules: list[dict[str, Any]], out: Console, *, verbose: bool = False) -> None:
    def classes(rule: dict[str, Any]) -> str:
        return ", ".join(c if verbose else short(c) for c in rule["classes"])

    rows = [
        [r["name"], classes(r), ",".join(r["targets"]), "yes" if r["exact"] else "close", r["description"]]
        for r in rules
    ]
    columns = [
        Column("rule"),
        Column("classes", shrink=not verbose, min_width=20),
        Column("targets", priority=2),
        Column("exact eval"),
        Column("description", priority=1, shrink=True, min_width=20),
    ]
    if verbose:  # full class paths do not fit a cell: one line each
        emit(out, fitted(out, [c for c in columns if c.header != "classes"], [r[:1] + r[2:] for r in rows]))
        for row in rows:
            say(out, f"{row[0]}: {row[1]}")
    else:
        emit(out, fitted(out, columns, rows))


# verify streams one line per check as it finishes, so its columns have fixed widths
CHECK_COLUMNS = [
    Column("check", min_width=30),
    Column("result"),
    Column("max |diff|", "right"),
    Column("time", "right"),
    Column("detail", priority=1, shrink=True, min_width=16),
]
CHECK_WIDTHS = (30, 6, 10, 7)


def _check_cells(check) -> list[str]:
    result = {True: "pass", False: "FAIL", None: "n/a"}[check.passed]
    diff = "-" if check.passed is None else f"{check.max_abs_diff:.3g}"
    return [check.name, result, diff, f"{check.seconds:.1f}s", check.detail]


def _check_line(cells: list[str], width: int) -> str:
    from bnsurgeon.core.layout import GAP, INDENT, format_row, shorten

    cells = [clipped(cell, MAX_CELL) for cell in cells]
    widths = (max(CHECK_WIDTHS[0], len(cells[0])), *CHECK_WIDTHS[1:])  # a long check name pushes, never cut
    fixed = format_row(cells[:4], widths, [c.align for c in CHECK_COLUMNS[:4]])
    fixed = fixed.ljust(len(INDENT) + sum(widths) + len(GAP) * 3)
    room = width - len(fixed) - len(GAP)
    detail = shorten(cells[4], room) if room >= 8 else ""
    return shorten((fixed + GAP + detail).rstrip(), width)


class CheckStream:
    """Prints verify's header, then each check's line the moment it finishes (flushed)."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self.started = False

    def __call__(self, check) -> None:
        if not self.started:
            emit(self.out, [_check_line([c.header for c in CHECK_COLUMNS], table_width(self.out))])
            self.started = True
        emit(self.out, [_check_line(_check_cells(check), table_width(self.out))])


def render_verification_summary(verification, out: Console) -> None:
    failed = verification.first_failure
    total = sum(check.seconds for check in verification.checks)
    if getattr(verification, "compare_at_why", None):
        say(out, verification.compare_at_why, indent="")
    if failed is None:
        shown = getattr(verification, "input", "") or tuple(verification.input_shape)
        say(out, f"all checks passed (input {shown}; checks took {total:.1f}s)", indent="")
    else:
        where = (
            f": first divergent module {failed.first_divergence}"
            if failed.first_divergence
            else f": {failed.detail}"
            if failed.detail
            else ""
        )
        say(out, f"{failed.name} failed{where}", indent="  ")


def render_verification(verification, out: Console) -> None:
    """The whole verify table at once (used when the checks were not streamed)."""
    stream = CheckStream(out)
    for check in verification.checks:
        stream(check)
    render_verification_summary(verification, out)


@contextmanager
def batch_progress(out: Console, enabled: bool = True):
    """A progress line on stderr (a terminal only): batches, samples and samples/s; yields the updater."""
    if not enabled or not out.is_terminal:
        yield lambda batches, samples: None
        return
    import time

    from rich.progress import Progress, SpinnerColumn, TextColumn

    started = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=out, transient=True) as progress:
        task = progress.add_task("recalibrating")

        def update(batches: int, samples: int) -> None:
            rate = samples / max(time.perf_counter() - started, 1e-9)
            progress.update(
                task,
                description=f"recalibrating: {counted(batches, 'batch')}, "
                f"{counted(samples, 'sample')}, {rate:,.0f} samples/s",
            )

        yield update


def render_recalibration(report, out: Console, *, verbose: bool = False) -> None:
    """The pass in one line, then each module's change (the largest few without -v)."""
    say(
        out,
        f"recalibrated {counted(len(report.modules), 'BN module')} of {report.source} on "
        f"{counted(report.samples, 'sample')} "
        f"({counted(report.batches, 'batch')}, {counted(report.ranks, 'rank')}, "
        f"{report.seconds:.1f} s)",
        indent="",
    )
    if report.data:
        say(out, f"data: {report.data.get('description', '')}, sha256 {report.data.get('sha256', '')}")
        if report.data.get("preprocessing"):
            say(out, f"images read with {report.data['preprocessing']}")
    for item in report.skipped:
        say(out, f"skipped {item['path']}: {item['reason']}")
    for note in report.notes:
        say(out, note)
    modules = report.modules if verbose else sorted(report.modules, key=lambda m: -m.var_change_rel)[:8]
    rows = [
        [m.path, str(m.elements), f"{m.calls_per_batch:g}", f"{m.mean_change_rel:.3g}", f"{m.var_change_rel:.3g}"]
        for m in modules
    ]
    if rows:
        say(
            out,
            (
                "every module"
                if verbose or len(modules) == len(report.modules)
                else f"the {len(modules)} whose variance moved most (-v: all)"
            )
            + ": path, elements per channel, calls per batch, max |d mean|/std, max |d var|/var",
        )
        for row in rows:
            say(out, "  ".join(row), indent="    ")
