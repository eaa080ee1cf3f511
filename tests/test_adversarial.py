"""The newest inputs tried as an attacker and an unlucky user would: --example-input files,
recorded check inputs, history filters and rules specs in a file's metadata, --include /
--exclude, --compare-at and --rules. Each bad one is one line, its own exit code, nothing
written, nothing imported that the user did not name, nothing allocated beyond a bound."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_untrusted import edited, good, listing, one_line_failure, run, tiny  # noqa: F401 (fixtures)

import bnsurgeon
from bnsurgeon.core.errors import MetadataError, UsageError

# ---- --example-input: odd files are refused with a reason, not a traceback or a wrong reason ----


def _empty(path):
    path.write_bytes(b"")
    return path


def _directory(path):
    path.mkdir()
    return path


def _fifo(path):  # opening it would block forever: refused before it is opened
    os.mkfifo(path)
    return path


def _safetensors(path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2, 3, 8, 8)}, str(path))
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (_empty, "is empty"),
        (_directory, "is a directory, not a file"),
        (_fifo, "is not a regular file"),
        (_safetensors, "is a .safetensors file"),
    ],
)
def test_odd_example_input_files_are_one_line_usage_errors(tiny, make, message):
    path = make(tiny / "x.pt")
    before = listing(tiny)
    result = run("convert", "tiny:build", "--example-input", path, "-o", tiny / "o.safetensors")
    one_line_failure(result, 2, f"--example-input {path} {message}", "fix:")
    assert listing(tiny) == before


# ---- a recorded check input is bounded like an --example-input, before anything is allocated ----


def test_recorded_check_input_memory_bomb_is_refused_as_bad_metadata(good, tiny, monkeypatch):
    allocated = []
    monkeypatch.setattr(torch, "randn", lambda *a, **k: allocated.append(a) or pytest.fail("allocated"))
    bomb = edited(good, tiny / "bomb.safetensors", check_input={"kind": "tensor", "shapes": [[10000, 3, 10000, 10000]]})
    before = listing(tiny)
    result = run("convert", bomb, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "metadata bnsurgeon.check_input", "3,000,000,000,000 values")
    assert listing(tiny) == before and not allocated
    # below this machine's memory, so the physical-memory guard would let it through: still refused
    large = edited(good, tiny / "large.safetensors", check_input={"kind": "list", "shapes": [[3, 4096, 4096]] * 8})
    with pytest.raises(MetadataError, match="bnsurgeon.check_input"):
        bnsurgeon.load(large, model="tiny:build")


def test_a_check_input_the_reader_would_refuse_is_not_recorded(tiny):
    """--input-shape is the user's to choose; the file must stay loadable whatever it was."""
    out = tiny / "wide.safetensors"
    result = run("convert", "tiny:build", "--input-shape", "1,3,16385,8", "-o", out)
    assert result.exit_code == 0, result.output
    assert isinstance(bnsurgeon.load(out, model="tiny:build"), torch.nn.Module)


def test_metadata_nested_past_the_recursion_limit_is_bad_metadata(good, tiny):
    bad = edited(good, tiny / "deep.safetensors", raw_history="[" * 100_000 + "]" * 100_000)
    result = run("convert", bad, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "metadata bnsurgeon.history is nested too deeply")


# ---- --include / --exclude ------------------------------------------------------------------


def test_a_filter_given_as_a_string_is_refused_not_split_into_letters():
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4)))
    with pytest.raises(UsageError, match="takes a list of module-path globs, not a str"):
        bnsurgeon.convert(model, "sync", include="2.*")  # as letters: '*' would select every module
    with pytest.raises(UsageError, match="not a str"):
        bnsurgeon.convert(model, "sync", exclude="1")


def test_recorded_filters_that_are_not_lists_are_bad_metadata(good, tiny):
    step = {"target": "sync", "frozen": "keep", "allow_unhandled": False, "include": "14"}
    bad = edited(good, tiny / "bad.safetensors", history=[step])
    result = run("convert", bad, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "metadata bnsurgeon.history is not a valid conversion history", "not a str")


@pytest.mark.parametrize("flag", ["--include", "--exclude"])
def test_a_glob_that_matches_no_bn_module_is_refused(tiny, flag):
    """``--exclude layer1`` for ``layer1.*`` would convert exactly what the user meant to keep."""
    before = listing(tiny)
    result = run(
        "convert", "tiny:build", flag, "1", flag, "nope", "--input-shape", "2,3,8,8", "-o", tiny / "o.safetensors"
    )
    one_line_failure(result, 2, f"{flag} nope matches no BatchNorm module (their paths: 1, 4)")
    assert listing(tiny) == before


@pytest.mark.parametrize("flags", [("--exclude", "*"), ("--include", "1", "--exclude", "1")])
def test_filters_that_keep_every_bn_module_are_refused(tiny, flags):
    """Every glob matches, yet nothing is left to convert: a file saying 'sync' with no sync layer."""
    before = listing(tiny)
    result = run("convert", "tiny:build", *flags, "--input-shape", "2,3,8,8", "-o", tiny / "o.safetensors")
    one_line_failure(result, 2, "globs keep all 2 BatchNorm modules: nothing would be converted")
    assert listing(tiny) == before


# ---- --compare-at --------------------------------------------------------------------------


def test_compare_at_a_module_before_every_bn_is_refused_not_passed():
    from torch import nn

    from bnsurgeon.checks.verify import verify_models

    torch.manual_seed(0)
    source = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    converted = copy.deepcopy(source)
    converted[1].weight.data.add_(1.0)  # a broken conversion: comparing at the conv cannot see it
    with pytest.raises(UsageError, match="no BatchNorm-family module runs before"):
        verify_models(source, converted, (2, 3, 8, 8), world_sizes=(), perturb=False, compare_at="0")
    failed = verify_models(source, converted, (2, 3, 8, 8), world_sizes=(), perturb=False, compare_at="1")
    assert not failed.passed


# ---- --rules --------------------------------------------------------------------------------

USER_RULES = """
from torch import nn
from bnsurgeon.rules import Rule, keep_if, to_frozen, to_plain, to_sync


class MyBN(nn.BatchNorm2d):
    pass


def raises():
    raise RuntimeError("rules factory broke")


def needs_arg(x):
    return []


HIJACK = Rule("hijack", (nn.BatchNorm2d,), {"sync": to_plain, "plain": to_plain, "frozen": to_plain})
SAME_NAME = Rule("torch-batchnorm", (MyBN,), {"sync": to_sync, "plain": keep_if("plain"), "frozen": to_frozen})
"""


@pytest.mark.parametrize(
    "spec, message",
    [
        ("adv_rules:raises", "--rules adv_rules:raises raised RuntimeError: rules factory broke"),
        ("adv_rules:needs_arg", "--rules adv_rules:needs_arg raised TypeError"),
        (".adv_rules:raises", "is not package.module:object"),
        (
            "adv_rules:HIJACK",
            "claims torch.nn.modules.batchnorm.BatchNorm2d, which the built-in rule 'torch-batchnorm'",
        ),
        ("adv_rules:SAME_NAME", "rule name 'torch-batchnorm' is a built-in rule's"),
    ],
)
def test_bad_rules_specs_are_usage_errors_and_never_replace_a_builtin(tiny, monkeypatch, spec, message):
    import bnsurgeon.rules as rules_module
    from bnsurgeon.rules import default_registry

    (tiny / "adv_rules.py").write_text(USER_RULES)
    monkeypatch.setattr(rules_module, "_named_specs", {})
    monkeypatch.delitem(__import__("sys").modules, "adv_rules", raising=False)
    before = listing(tiny)
    result = run("convert", "tiny:build", "--rules", spec, "--input-shape", "2,3,8,8", "-o", tiny / "o.safetensors")
    one_line_failure(result, 2, message, "fix:")
    assert listing(tiny) == before
    assert default_registry().lookup(torch.nn.BatchNorm2d).name == "torch-batchnorm"
    assert "torch-batchnorm" in [rule.name for rule in default_registry()]


# ---- error lines are text: what a file or a path says is never Rich markup or emoji -------------


def test_error_lines_show_file_contents_and_paths_literally(good, tiny):
    step = {"target": "[/]", "frozen": "keep", "allow_unhandled": False}
    bad = edited(good, tiny / "markup.safetensors", history=[step])
    result = run("convert", bad, "--model", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 4, "'target': '[/]'")
    hidden = edited(good, tiny / "hidden.safetensors", history=[dict(step, target="[conceal]x")])
    one_line_failure(run("convert", hidden, "--model", "tiny:build", "-o", tiny / "o.safetensors"), 4, "[conceal]x")
    missing = tiny / "a:fire:b.pt"
    one_line_failure(
        run("convert", "tiny:build", "--example-input", missing, "-o", tiny / "o.safetensors"),
        2,
        f"--example-input {missing}: no such file",
    )
