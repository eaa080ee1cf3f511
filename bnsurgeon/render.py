"""Human output (Rich, to stderr) and machine output (one JSON document, to stdout)."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

from .inspection import Inspection
from .report import Report, collapse_paths, short


def console() -> Console:
    """Stderr console: colour only on a terminal, NO_COLOR honoured (Rich reads it)."""
    return Console(stderr=True, highlight=False, soft_wrap=False)


@contextmanager
def phases(out: Console, enabled: bool = True):
    """A spinner on stderr naming the current phase (only on a terminal); yields the updater."""
    if not enabled or not out.is_terminal:
        yield lambda text: None
        return
    with out.status("starting") as status:
        yield lambda text: status.update(f"{text} ...")


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def render_checkpoint(contents: dict, out: Console) -> None:
    table = Table(title=f"{contents['path']} ({contents['format']})", title_justify="left")
    for column in ("entry", "type", "tensors", "model weights?"):
        table.add_column(column)
    weights = contents["model_weights"]
    for entry in contents["entries"]:
        looks = "yes" if entry["key"] in weights or (entry["key"] == "<top level>" and weights) else ""
        table.add_row(entry["key"], entry["type"], str(entry["tensors"]), looks)
    out.print(table)
    if contents["bnsurgeon"]:
        out.print("a bnsurgeon checkpoint (self-describing)")


def render_inspection(inspection: Inspection, out: Console, *, verbose: bool = False) -> None:
    if inspection.checkpoint is not None:
        render_checkpoint(inspection.checkpoint, out)
    if not inspection.groups and inspection.checkpoint is not None:
        for note in inspection.notes:
            out.print(f"note: {note}")
        return
    table = Table(title=f"BatchNorm-family modules in {inspection.source}", title_justify="left")
    for column in ("class", "count", "rule", "--to sync", "--to plain", "--to frozen", "torch convert_sync_batchnorm", "example paths"):
        table.add_column(column, overflow="fold")
    for group in inspection.groups:
        rule = group.rule or "[bold red]UNHANDLED[/]"
        table.add_row(
            short(group.cls), str(group.count), rule,
            group.targets["sync"], group.targets["plain"], group.targets["frozen"],
            group.torch_converter, ", ".join(group.all_paths if verbose else group.examples),
        )
    out.print(table)
    out.print(
        f"{inspection.bn_modules} BN-family modules in {len(inspection.groups)} classes, "
        f"{inspection.unhandled} unhandled; {inspection.parameters:,} parameters."
    )
    for note in inspection.notes:
        out.print(f"note: {note}")


def fusion_summary(fusion: dict[str, Any]) -> str:
    """One line for --to fused: BN before/after, folds, how producers were found, the measured error."""
    errors = fusion.get("max_rel_error") or {}
    measured = ", ".join(f"{k.replace('_', ' ')} {v:.2g}" for k, v in errors.items())
    return (f"fused: {len(fusion['folded'])} BN folded into their producers, {len(fusion['left'])} left; "
            f"BN modules {fusion['bn_before']} -> {fusion['bn_after']}; producers from {fusion['method']}"
            + (f"; max relative error {measured}" if measured else ""))


def render_report(report: Report, out: Console, *, verbose: bool = False) -> None:
    table = Table(title=f"convert -> {report.target}", title_justify="left")
    for column in ("from", "to", "count", "paths"):
        table.add_column(column, overflow="fold")
    grouped: dict[tuple[str, str], list[str]] = {}
    for change in report.changed:
        grouped.setdefault((change.from_class, change.to_class), []).append(change.path)
    for (src, dst), paths in sorted(grouped.items()):
        patterns = collapse_paths(paths)
        shown = patterns if verbose else patterns[:3]
        text = ", ".join(f"{p} x{n}" if n > 1 else p for p, n in shown)
        if len(shown) < len(patterns):
            text += f", ... ({len(patterns) - len(shown)} more patterns)"
        table.add_row(short(src), short(dst), str(len(paths)), text)
    out.print(table)
    totals = report.totals
    out.print(
        f"{totals['changed']} converted, {totals['kept']} kept, {totals['unhandled']} unhandled; "
        f"state-dict keys +{totals['keys_added']} -{totals['keys_removed']}"
    )
    for item in report.kept + report.unhandled:
        if verbose or item.rule is None:
            out.print(f"  kept {item.path} ({short(item.cls)}): {item.reason}")
    if report.kept and not verbose:
        reasons = sorted({item.reason for item in report.kept})
        out.print(f"  {len(report.kept)} kept: " + "; ".join(reasons))
    if report.check is not None:
        check = report.check
        status = "[green]passed[/]" if check.passed else "[bold red]FAILED[/]"
        out.print(f"eval check ({check.mode}, input {tuple(check.input_shape)}): {status}, max |diff| {check.max_abs_diff:.3g}")
    if report.fusion is not None:
        out.print(fusion_summary(report.fusion))
    for note in sorted({n for change in report.changed for n in change.notes}):
        out.print(f"note: {note}")


def render_rules(rules: list[dict[str, Any]], out: Console) -> None:
    table = Table(title="bnsurgeon rules", title_justify="left")
    for column in ("rule", "classes", "exact eval", "description"):
        table.add_column(column, overflow="fold")
    for rule in rules:
        table.add_row(rule["name"], "\n".join(rule["classes"]), "yes" if rule["exact"] else "close", rule["description"])
    out.print(table)


def render_verification(verification, out: Console) -> None:
    table = Table(title=f"verify {verification.converted} against {verification.source}", title_justify="left")
    for column in ("check", "result", "max |diff|", "detail"):
        table.add_column(column, overflow="fold")
    for check in verification.checks:
        result = {True: "[green]pass[/]", False: "[bold red]FAIL[/]", None: "n/a"}[check.passed]
        diff = "-" if check.passed is None else f"{check.max_abs_diff:.3g}"
        table.add_row(check.name, result, diff, check.detail)
    out.print(table)
    failed = verification.first_failure
    if failed is None:
        out.print(f"[green]all checks passed[/] (input {tuple(verification.input_shape)})")
    else:
        where = f": first divergent module {failed.first_divergence}" if failed.first_divergence else ""
        out.print(f"[bold red]{failed.name} failed[/]{where}", markup=True)
