"""Trust, round two (issue 32): the newer surface (training checkpoints carried whole, fused records,
example inputs, --rules, hints, bounded messages) held to the same promises, and no confirmation asked
twice. Each test failed on the code before its fix."""

from __future__ import annotations

import sys

import pytest
import torch

import bnsurgeon
from test_untrusted import TINY, one_line_failure, run


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    (tmp_path / "tiny.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TINY_MARK", str(tmp_path / "called.txt"))
    sys.modules.pop("tiny", None)
    yield tmp_path
    sys.modules.pop("tiny", None)


def converted(tiny, name, *args):
    out = tiny / name
    result = run("convert", *args, "-o", out, "--input-shape", "2,3,8,8")
    assert result.exit_code == 0, result.output
    return out


# ---- 1. the user is not asked to confirm what the user typed ------------------------------

def test_verify_uses_the_factory_typed_as_source_for_the_file_made_from_it(tiny):
    out = converted(tiny, "out.safetensors", "tiny:build")
    result = run("verify", "tiny:build", out, "--input-shape", "2,3,8,8", "--no-perturb")
    assert result.exit_code == 0, result.output


def test_the_same_factory_with_the_same_arguments_is_confirmed_and_other_arguments_are_not(tiny):
    out = converted(tiny, "w6.safetensors", "tiny:build", "--model-arg", "width=6")
    same = run("verify", "tiny:build", out, "--model-arg", "width=6", "--input-shape", "2,3,8,8", "--no-perturb")
    assert same.exit_code == 0, same.output
    # SOURCE built without the argument: the file's width=6 is not what the user typed
    other = run("verify", "tiny:build", out, "--input-shape", "2,3,8,8")
    one_line_failure(other, 10, "width=6")


def test_a_different_factory_named_as_source_confirms_nothing(tiny):
    out = converted(tiny, "out.safetensors", "tiny:build")
    result = run("verify", "tiny:wide", out, "--input-shape", "2,3,8,8")
    one_line_failure(result, 10, "factory 'tiny:build'", "confirm it with --converted-model tiny:build")
    assert not (tiny / "called.txt").exists()


def test_the_python_verify_takes_the_source_factory_too(tiny):
    out = converted(tiny, "out.safetensors", "tiny:build")
    verification = bnsurgeon.api.verify("tiny:build", str(out), input_shape=(2, 3, 8, 8), perturb=False)
    assert verification.passed


def test_load_still_asks_for_a_factory_the_file_names(tiny):
    from bnsurgeon.core.errors import ConfirmationError

    out = converted(tiny, "out.safetensors", "tiny:build")
    with pytest.raises(ConfirmationError, match="tiny:build"):
        bnsurgeon.load(out)
