"""User code that calls sys.exit(0) never makes a command succeed (issue 47, finding 1's class: passing without
verifying). A factory module that exits while imported, or a factory that exits when called, ended verify and
convert with exit 0: no check run, no file written, and CI read "passed"."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app

GOOD = "from torch import nn\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))\n"
EXITS = {
    "exit47_on_import": "import sys\nsys.exit(0)\n",
    "exit47_on_call": "import sys\ndef make():\n    sys.exit(0)\n",
}


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_named_module puts the working directory first
    (tmp_path / "good47.py").write_text(GOOD)
    for name, text in EXITS.items():
        (tmp_path / f"{name}.py").write_text(text)
    yield tmp_path
    for name in ("good47", *EXITS):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "factory, code, said",
    [
        ("exit47_on_import:make", 3, "importing exit47_on_import called sys.exit(0)"),
        ("exit47_on_call:make", 2, "factory 'exit47_on_call:make' raised SystemExit: 0"),
    ],
)
def test_a_factory_that_calls_sys_exit_0_fails_verify_and_convert(work, factory, code, said):
    runner = CliRunner()
    converted = runner.invoke(app, ["convert", "good47:build", "-o", "c.safetensors", "--input-shape", "2,3,8,8"])
    assert converted.exit_code == 0, converted.output
    verify = ["verify", factory, "c.safetensors", "--converted-model", "good47:build", "--input-shape", "2,3,8,8"]
    result = runner.invoke(app, verify, env={"COLUMNS": "200"})
    assert result.exit_code == code and said in result.output, result.output
    result = runner.invoke(app, ["convert", factory, "-o", "o.safetensors", "--input-shape", "2,3,8,8"])
    assert result.exit_code == code and said in result.output and not (work / "o.safetensors").exists(), result.output


FORWARD_EXITS = (
    "import sys\nfrom torch import nn\n"
    "class Quits(nn.Sequential):\n"
    "    def forward(self, x):\n"
    "        sys.exit(0)\n"
    "def build():\n    return Quits(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))\n"
    "def batches():\n    sys.exit(0)\n"
)


def test_user_code_that_exits_anywhere_in_a_command_is_a_failure_not_success(work):
    """The class: not only a factory's import or call, but a model's forward (the eval check, verify's checks)
    and a --data function. Each ended the command with exit 0 before."""
    (work / "quits47.py").write_text(FORWARD_EXITS)
    runner = CliRunner()
    said = "the user's code called sys.exit(0)"
    try:
        result = runner.invoke(app, ["convert", "quits47:build", "-o", "q.safetensors", "--input-shape", "2,3,8,8"])
        assert result.exit_code == 2 and said in result.output, result.output
        assert not (work / "q.safetensors").exists()
        converted = runner.invoke(app, ["convert", "good47:build", "-o", "c.safetensors", "--input-shape", "2,3,8,8"])
        assert converted.exit_code == 0, converted.output
        recal = ["recalibrate", "good47:build", "--data", "quits47:batches", "-o", "r.safetensors"]
        result = runner.invoke(app, recal, env={"COLUMNS": "200"})
        assert result.exit_code == 2 and said in result.output, result.output
        assert not (work / "r.safetensors").exists()
    finally:
        sys.modules.pop("quits47", None)


def test_user_code_that_raises_while_imported_is_the_users_error_not_a_bug(work):
    """A factory module or a --rules module whose import raises (not ImportError) was exit 70, "a bug in
    bnsurgeon"; it is the user's code: one line naming the module and its error, the import's exit code."""
    (work / "raises47.py").write_text("raise RuntimeError('config missing')\ndef build():\n    pass\nRULES = []\n")
    runner = CliRunner()
    try:
        for command in (
            ["convert", "raises47:build", "-o", "x.safetensors", "--input-shape", "2,3,8,8"],
            ["inspect", "good47:build", "--rules", "raises47:RULES"],
        ):
            result = runner.invoke(app, command, env={"COLUMNS": "200"})
            assert result.exit_code == 3, (command, result.output)
            assert "importing raises47 raised RuntimeError: config missing" in result.output, result.output
            assert "bug" not in result.output and "Traceback" not in result.output
    finally:
        sys.modules.pop("raises47", None)


def test_a_library_that_cannot_be_mapped_is_a_memory_limit_not_a_bug(monkeypatch):
    """Under ``ulimit -v`` torch itself fails to load ("failed to map segment from shared object"): that was
    exit 70, "a bug in bnsurgeon"; it is the machine's limit, exit 9 as any out-of-memory, in one line."""
    from bnsurgeon.cli import catalog

    def unloadable():
        raise ImportError("libtorch_cpu.so: failed to map segment from shared object")

    monkeypatch.setattr(catalog, "describe_rules", unloadable)
    result = CliRunner().invoke(app, ["rules"], env={"COLUMNS": "200"})
    assert result.exit_code == 9, result.output
    assert "failed to map segment" in result.output and "ulimit -v" in result.output and "bug" not in result.output
