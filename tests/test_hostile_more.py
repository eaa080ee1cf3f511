"""Hostile files and CLI edge cases, continued (after test_untrusted and test_hostile_files):
text from a file that would drive the terminal, entries keyed by something other than a
name, an input named as an output, safetensors dtypes beyond the common ones, constructor
sizes read from a file, and output directories that are not directories. Each is one line
with its own exit code, and nothing on disk is lost or misstated."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_untrusted import edited, good, one_line_failure, run, tiny  # noqa: F401 (fixtures)


def listing(directory):
    """Every name with its size and mtime (symlinks as themselves: a dangling one too)."""
    return {p.name: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in directory.iterdir() if p.name != "__pycache__"}


# ---- output directories that are not directories ------------------------------------------------

@pytest.mark.parametrize("output, message", [
    ("afile/o.safetensors", "output directory afile is a file, not a directory"),
    ("afile/sub/o.safetensors", "output directory afile/sub cannot be created: afile is a file, not a directory"),
    ("link/o.safetensors", "output directory link is a symlink to a missing path, not a directory"),
])
def test_an_output_directory_that_is_a_file_is_named_as_one(tiny, output, message):
    (tiny / "afile").write_text("not a directory")
    (tiny / "link").symlink_to(tiny / "missing")
    before = listing(tiny)
    result = run("convert", "tiny:build", "-o", output, "--input-shape", "2,3,8,8")
    one_line_failure(result, 8, message)
    assert "does not exist" not in result.output and "mkdir" not in result.output
    assert listing(tiny) == before and (tiny / "afile").read_text() == "not a directory"


# ---- an input is never an output, --force or not ------------------------------------------------

@pytest.mark.parametrize("output, example, what", [
    ("x.pt", "x.pt", "output"),
    ("o.safetensors", "o.safetensors.report.json", "report"),
    ("o.pt", "o.pt.report.md", "report"),
])
@pytest.mark.parametrize("force", [True, False])
def test_the_example_input_is_never_overwritten_as_an_output(tiny, output, example, what, force):
    torch.save(torch.randn(2, 3, 8, 8), tiny / example)
    before, content = listing(tiny), (tiny / example).read_bytes()
    result = run("convert", "tiny:build", "-o", output, "--example-input", tiny / example, *(["--force"] if force else []))
    one_line_failure(result, 8, f"{what} ", f"{example} is the --example-input file", "never overwrites an input")
    assert "pass --force" not in result.output
    assert listing(tiny) == before and (tiny / example).read_bytes() == content


def test_the_example_input_reached_by_a_symlink_or_hard_link_is_still_an_input(tiny):
    torch.save(torch.randn(2, 3, 8, 8), tiny / "x.pt")
    (tiny / "sym.pt").symlink_to(tiny / "x.pt")
    os.link(tiny / "x.pt", tiny / "hard.pt")
    content = (tiny / "x.pt").read_bytes()
    for output in ("sym.pt", "hard.pt"):
        result = run("convert", "tiny:build", "-o", tiny / output, "--example-input", "x.pt", "--force")
        one_line_failure(result, 8, "is the --example-input file")
    assert (tiny / "x.pt").read_bytes() == content and (tiny / "sym.pt").is_symlink()
