"""The diff report of a conversion: dataclasses, JSON and Markdown.

The JSON document is versioned (``schema_version``); the Markdown puts the summary
first and collapses paths by pattern (``blocks.*.bn1``) so it reads well in a PR.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from bnsurgeon.core.json_text import dumps
from bnsurgeon.core.layout import clipped, counted, printable

REPORT_SCHEMA_VERSION = 1


@dataclass
class ModuleChange:
    path: str
    aliases: list[str]
    from_class: str
    to_class: str
    rule: str
    children: list[str]
    notes: list[str] = field(default_factory=list)


@dataclass
class ModuleKept:
    path: str
    aliases: list[str]
    cls: str
    rule: str | None
    reason: str


@dataclass
class CheckResult:
    """The pre-write equivalence check: eval outputs of source vs converted on a seeded input."""

    passed: bool
    mode: str  # "bit-identical" or "close"
    max_abs_diff: float
    input_shape: list[int]
    seed: int
    note: str = ""
    input: str = ""  # the check input described: a shape, "list of 2 sample(s) (3, 96, 96)", "dict {...}"


@dataclass
class Report:
    target: str
    source: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    changed: list[ModuleChange] = field(default_factory=list)
    kept: list[ModuleKept] = field(default_factory=list)
    unhandled: list[ModuleKept] = field(default_factory=list)
    keys_added: list[str] = field(default_factory=list)
    keys_removed: list[str] = field(default_factory=list)
    check: CheckResult | None = None
    verification: dict[str, Any] | None = None
    #: fused target: how producers were found, each fold, the reason for each BN left
    fusion: dict[str, Any] | None = None
    output: str | None = None
    carried: dict[str, str] = field(default_factory=dict)
    schema_version: int = REPORT_SCHEMA_VERSION
    tool_version: str = ""

    @property
    def totals(self) -> dict[str, int]:
        return {
            "changed": len(self.changed),
            "kept": len(self.kept),
            "unhandled": len(self.unhandled),
            "keys_added": len(self.keys_added),
            "keys_removed": len(self.keys_removed),
        }

    def class_changes(self) -> Counter:
        return Counter((c.from_class, c.to_class) for c in self.changed)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["totals"] = self.totals
        return data

    def to_json(self) -> str:
        return dumps(self.to_dict(), indent=2, sort_keys=False)

    def to_markdown(self) -> str:
        return render_markdown(self)


def short(cls_name: str) -> str:
    return cls_name.rsplit(".", 1)[-1]


def pattern_of(path: str) -> str:
    """``blocks.3.1.bn1`` -> ``blocks.*.*.bn1``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def collapse_paths(paths: list[str]) -> list[tuple[str, int]]:
    """Group paths by pattern, numeric components replaced by ``*``: ``blocks.*.bn1`` x 16."""
    groups: dict[str, int] = defaultdict(int)
    for path in paths:
        groups[pattern_of(path)] += 1
    return sorted(groups.items(), key=lambda item: (-item[1], item[0]))


def code(text: Any, *, cell: bool = False) -> str:
    """``text`` as one Markdown code span, whatever it holds: a fence longer than any run of backticks in it,
    and in a table cell its pipes escaped (a module name with "`" or "|" must not end the span or the cell)."""
    text = str(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{_cell(text) if cell else text}{pad}{fence}"


def _cell(text: Any) -> str:
    """Plain text in a Markdown table cell: its pipes escaped."""
    return str(text).replace("|", "\\|")


def render_markdown(report: Report) -> str:
    totals = report.totals
    lines = [f"## bnsurgeon: convert to {code(report.target)}", ""]
    if report.source:
        lines.append(f"Source: {code(report.source)}" + (f" -> {code(report.output)}" if report.output else ""))
        lines.append("")
    summary = (
        f"**{counted(totals['changed'], 'module')} converted**, {totals['kept']} kept as they were, "
        f"{totals['unhandled']} unhandled; state-dict keys added: {totals['keys_added']}, "
        f"removed: {totals['keys_removed']}."
    )
    lines.append(summary)
    if report.check is not None:
        check = report.check
        verdict = "passed" if check.passed else "FAILED"
        lines.append(
            f"Eval check ({check.mode}, input {check.input or tuple(check.input_shape)}, seed {check.seed}): "
            f"**{verdict}**, max |diff| = {check.max_abs_diff:.3g}." + (f" {check.note}" if check.note else "")
        )
    if report.verification is not None:
        checks = report.verification["checks"]
        passed = sum(1 for c in checks if c["passed"])
        skipped = sum(1 for c in checks if c["passed"] is None)
        lines.append(
            f"Verification: {passed}/{len(checks) - skipped} checks passed"
            + (f", {skipped} not applicable" if skipped else "")
            + "."
        )
    lines.append("")
    by_class: dict[tuple[str, str], list[ModuleChange]] = defaultdict(list)
    for change in report.changed:
        by_class[(change.from_class, change.to_class)].append(change)
    for (src, dst), changes in sorted(by_class.items()):
        lines += [
            f"### {short(src)} -> {short(dst)} ({len(changes)})",
            "",
            "| paths | count | kept children |",
            "|---|---|---|",
        ]
        children_by_pattern: dict[str, set[str]] = defaultdict(set)
        for change in changes:
            children_by_pattern[pattern_of(change.path)].update(change.children)
        for pattern, count in collapse_paths([c.path for c in changes]):
            children = sorted(children_by_pattern[pattern]) or ["-"]
            lines.append(f"| {code(pattern, cell=True)} | {count} | {_cell(', '.join(children))} |")
        notes = sorted({n for change in changes for n in change.notes})
        lines += [""] + [f"> {note}" for note in notes] + ([""] if notes else [])
    for title, items in (("Kept as they were", report.kept), ("Unhandled (left untouched)", report.unhandled)):
        if not items:
            continue
        lines += [f"### {title} ({len(items)})", "", "| class | paths | reason |", "|---|---|---|"]
        grouped: dict[tuple[str, str], list[str]] = defaultdict(list)
        for item in items:
            grouped[(item.cls, item.reason)].append(item.path)
        for (cls, reason), paths in sorted(grouped.items()):
            patterns = ", ".join(code(p, cell=True) + (f" x{n}" if n > 1 else "") for p, n in collapse_paths(paths)[:4])
            lines.append(f"| {_cell(short(cls))} | {patterns} | {_cell(reason)} |")
        lines.append("")
    if report.fusion is not None:
        lines += _fusion_markdown(report.fusion)
    if report.keys_added or report.keys_removed:
        lines += ["### State-dict keys", ""]
        lines += [f"- added: {code(k)}" for k in report.keys_added[:20]]
        lines += [f"- removed: {code(k)}" for k in report.keys_removed[:20]]
        lines.append("")
    if report.carried:
        lines += ["### Carried from the source checkpoint", ""]
        lines += [f"- {code(clipped(k))}: {v}" for k, v in report.carried.items()]
        lines.append("")
    # names come from the model and the file: no raw control character (a newline would start a heading)
    return "\n".join(printable(line) for line in lines).rstrip() + "\n"


def _fusion_markdown(fusion: dict[str, Any]) -> list[str]:
    """--to fused: how producers were found, the measured error, and each BN -> producer fold."""
    lines = [
        f"### Folds ({len(fusion['folded'])})",
        "",
        f"BN modules {fusion['bn_before']} -> {fusion['bn_after']}. Producers found from {fusion['method']}.",
    ]
    for name, value in (fusion.get("max_rel_error") or {}).items():
        lines.append(f"Max error relative to the output scale, {name.replace('_', ' ')}: {value:.3g}.")
    lines += ["", "| BN | folded into |", "|---|---|"]
    lines += [
        f"| {code(f['bn'], cell=True)} ({_cell(short(f['bn_class']))}) | {code(f['producer'], cell=True)} "
        f"({_cell(short(f['producer_class']))}) |"
        for f in fusion["folded"]
    ]
    return lines + [""]
