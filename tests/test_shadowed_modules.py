"""A module in the working directory that hides an installed one (issue 47, also seen): the working directory comes
first on the import path for the user's factory, so a ``safetensors.py`` beside ``mymodels.py`` is what bnsurgeon's
own ``import safetensors`` gets. That is the user's environment, not a bug in bnsurgeon (exit 70): it is named,
exit 17. Each case runs in a fresh interpreter, where safetensors is not imported yet (in this one it is)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: bnsurgeon's entry point, with the working directory off the path as a console script has it
MAIN = "import sys\ndel sys.path[0]\nfrom bnsurgeon.cli.commands import main\nsys.argv[0] = 'bnsurgeon'\nmain()\n"
FACTORY = (
    "from torch import nn\n{extra}\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))\n"
)


def convert(directory: Path) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", MAIN, "convert", "mymodels:build", "-o", "out.safetensors", "--input-shape", "2,3,8,8"],
        cwd=directory,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(
    "extra, where",
    [
        ("", "bnsurgeon imports it to write the file: was an internal error, exit 70"),
        ("import safetensors.torch", "the factory's own module imports it: was 'cannot import', exit 3"),
    ],
)
def test_a_module_of_the_working_directory_that_hides_an_installed_one_is_named(tmp_path, extra, where):
    (tmp_path / "mymodels.py").write_text(FACTORY.format(extra=extra))
    (tmp_path / "safetensors.py").write_text("# the user's own helpers\n")
    code, output = convert(tmp_path)
    assert code == 17, (where, output)
    lines = output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("  fix: rename"), output
    assert str(tmp_path / "safetensors.py") in lines[0] and "hides the installed module 'safetensors'" in lines[0]
    assert "bug" not in output and not (tmp_path / "out.safetensors").exists()


def test_without_a_hiding_module_the_same_factory_converts(tmp_path):
    (tmp_path / "mymodels.py").write_text(FACTORY.format(extra="import safetensors.torch"))
    code, output = convert(tmp_path)
    assert code == 0 and (tmp_path / "out.safetensors").exists(), output


def test_a_module_of_the_working_directory_that_hides_nothing_is_not_named(tmp_path, monkeypatch):
    """Only a module installed elsewhere too is a shadow: the user's own factory module is not."""
    from bnsurgeon.core import user_code

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(user_code, "USER_DIRECTORIES", set())
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_named_module puts the working directory first
    (tmp_path / "own_factory_module_47.py").write_text("def build():\n    return None\n")
    user_code.import_named_module("own_factory_module_47:build")
    try:
        assert user_code.shadowing_modules() == [] and user_code.shadowing_error() is None
    finally:
        sys.modules.pop("own_factory_module_47", None)
