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
