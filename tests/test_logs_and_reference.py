"""Issue 47, also seen: a log is never truncated, and the generated CLI reference summarises each command
in a whole sentence that points to the docs, not the README."""

from __future__ import annotations

import io
import os

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app
from bnsurgeon.cli.render import INSPECT_COLUMNS, MAX_CELL, fitted, table_width

ROW = [
    "BatchNormAct2d",
    "78",
    "timm-batchnorm-act",
    "SyncBatchNormAct",
    "kept",
    "FrozenBatchNormAct",
    "drops act=SiLU, drop",
    "drops act=SiLU (52/78); eps 0.001 -> 1e-05",
    "bn1, blocks.0.0.bn1, blocks.0.0.bn2",
]


def test_a_table_off_a_terminal_is_whole_at_any_console_width():
    out = Console(file=io.StringIO(), width=40)
    lines = fitted(out, INSPECT_COLUMNS, [ROW])
    assert table_width(out) > 10**9
    assert all(cell in lines[1] for cell in ROW), lines
    assert all(column.header in lines[0] for column in INSPECT_COLUMNS), lines


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_terminal_is_still_fitted_to_its_width():
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            out = Console(file=tty, width=60)
            lines = fitted(out, INSPECT_COLUMNS, [ROW])
            assert table_width(out) == 60 and all(len(line) <= 60 for line in lines), lines
        assert "BatchNormAct2d" in lines[1] and "bn1, blocks.0.0.bn1" not in lines[1]
    finally:
        os.close(leader)
        os.close(follower)


def test_a_huge_name_from_a_file_is_still_bounded_off_a_terminal(tmp_path):
    """Whole cells, but a megabyte-long state-dict key is cut with its length said, as in prose."""
    name = "k" * 1_000_000
    path = tmp_path / "huge.pt"
    torch.save({name: torch.zeros(2), "state_dict": {"w": torch.zeros(2)}}, path)
    result = CliRunner().invoke(app, ["inspect", str(path)], env={"COLUMNS": None})
    assert "(1,000,000 characters)" in result.output and len(result.output) < 3 * MAX_CELL + 2000, result.output[:3000]


def test_each_commands_summary_is_one_whole_sentence_and_sends_readers_to_the_docs():
    """mkdocs-click and `bnsurgeon --help` show the first line of each command's help as its summary."""
    from bnsurgeon.cli.click_command import command

    for name, sub in command.commands.items():
        lines = (sub.help or "").strip().splitlines()
        assert lines and lines[0].rstrip().endswith("."), (name, lines[:2])
        assert len(lines) == 1 or not lines[1].strip(), f"{name}: the summary goes on past its first line: {lines[:2]}"
        assert "README" not in (sub.help or ""), f"{name}: the README no longer holds what its help points to"
    listed = " ".join(CliRunner().invoke(app, ["--help"], env={"COLUMNS": None}).output.split())
    for name, sub in command.commands.items():  # whole in `bnsurgeon --help` too: Click would cut it to 45 or so
        assert " ".join(sub.help.strip().splitlines()[0].split()) in listed, (name, listed)
