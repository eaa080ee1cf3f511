"""Trust, round two (issue 32): the newer surface (training checkpoints carried whole, fused records,
example inputs, --rules, hints, bounded messages) held to the same promises, and no confirmation asked
twice. Each test failed on the code before its fix."""

from __future__ import annotations

import sys

import pytest
import torch
from test_untrusted import one_line_failure, run, tiny  # noqa: F401 (tiny: the fixture, shared)

import bnsurgeon


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


def listing(directory):
    return sorted(p.name for p in directory.iterdir() if p.name != "__pycache__")


def tiny_checkpoint(tiny, name, **entries):
    sys.path.insert(0, str(tiny))
    import tiny as tiny_module

    model = tiny_module.build()
    path = tiny / name
    torch.save({"state_dict": model.state_dict(), **entries}, path)
    return path, model


# ---- 4. one line, its own code, everywhere ------------------------------------------------

RAISING_RULE = """
from torch import nn
from bnsurgeon.rules import Rule, keep_if, to_frozen, to_plain


class OddBN(nn.BatchNorm2d):
    pass


def broken_sync(module, context):
    raise ValueError("the rule author's bug")


RULE = Rule("odd-bn", (OddBN,), {"sync": broken_sync, "plain": to_plain, "frozen": to_frozen})


def build():
    return nn.Sequential(nn.Conv2d(3, 4, 3), OddBN(4))
"""


def test_a_user_rule_whose_builder_raises_is_one_line_naming_the_rule(tiny, monkeypatch):
    import bnsurgeon.rules as rules_module

    (tiny / "odd_rules.py").write_text(RAISING_RULE)
    monkeypatch.setattr(rules_module, "_named_specs", {})
    monkeypatch.setattr(rules_module, "_default", None)  # the rule registers into a registry this test discards
    monkeypatch.delitem(sys.modules, "odd_rules", raising=False)
    before = listing(tiny)
    result = run(
        "convert",
        "odd_rules:build",
        "--rules",
        "odd_rules:RULE",
        "--input-shape",
        "2,3,8,8",
        "-o",
        tiny / "o.safetensors",
    )
    one_line_failure(
        result,
        2,
        "rule 'odd-bn' raised ValueError building --to sync for '1'",
        "the rule author's bug",
        "fix the rule's builder",
    )
    assert listing(tiny) == before


def test_an_unexpected_exception_is_an_internal_error_not_a_failed_check(tiny, monkeypatch):
    import bnsurgeon.api

    def crash(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(bnsurgeon.api, "convert_source", crash)
    result = run("convert", "tiny:build", "-o", tiny / "o.safetensors")
    one_line_failure(result, 70, "internal error: ZeroDivisionError: a bug", "a bug in bnsurgeon", "-v")
    verbose = run("convert", "tiny:build", "-o", tiny / "o.safetensors", "-v")
    assert verbose.exit_code == 70 and "Traceback" in verbose.output and "ZeroDivisionError" in verbose.output


def test_a_huge_entry_name_is_clipped_on_the_terminal_and_in_the_markdown_report(tiny):
    import json

    name = "x" * 1_000_000
    path, _ = tiny_checkpoint(tiny, "long.pth", **{name: 1})
    out = tiny / "o.pth"
    for args in ((), ("-v",)):
        result = run("convert", path, "--model", "tiny:build", "--input-shape", "2,3,8,8", "-o", out, "--force", *args)
        assert result.exit_code == 0, result.output[:2000]
        assert len(result.output) < 5_000 and "(1,000,000 characters)" in result.output
    assert (tiny / "o.pth.report.md").stat().st_size < 5_000
    assert name in json.loads((tiny / "o.pth.report.json").read_text())["carried"]  # the data stays whole


def test_a_refused_safe_load_names_what_it_could_not_read_not_how_to_turn_it_off(tiny):
    bad = tiny / "opcode.pt"
    bad.write_bytes(b"\x80\x02\x82\x01.")  # EXT1: an opcode torch's safe unpickler does not run
    result = run("inspect", bad)
    one_line_failure(result, 4, "Unsupported operand 130")
    assert "weights_only" not in result.output and "False" not in result.output


def test_the_rules_confirmation_hint_is_a_whole_command_or_none(tiny):
    from test_untrusted import edited

    good = converted(tiny, "good.safetensors", "tiny:build")
    specs = [f"pkg{i}.{'m' * 140}:rules" for i in range(10)]
    few = edited(good, tiny / "few.safetensors", rules=specs[:2])
    many = edited(good, tiny / "many.safetensors", rules=specs)
    whole = run("convert", few, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(whole, 10, f"confirm with --rules {specs[0]} --rules {specs[1]}")
    result = run("convert", many, "--model", "tiny:build", "--to", "plain", "-o", tiny / "o.safetensors")
    one_line_failure(result, 10, "name each of the 10 recorded rule modules with --rules")
    hint = result.output.split("fix:", 1)[1]
    assert "more character" not in hint and "--rules pkg" not in hint


def test_with_an_optimizer_state_fused_says_bn_parameters_are_removed_not_buffers(tiny):
    path, model = tiny_checkpoint(tiny, "train.pth")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    result = run(
        "convert", path, "--model", "tiny:build", "--to", "fused", "--input-shape", "2,3,8,8", "-o", tiny / "o.pth"
    )
    one_line_failure(result, 2, "optimizer state", "are removed (folded into the layer before)")
    assert "buffer" not in result.output


# ---- 5. writes and signals ----------------------------------------------------------------


def test_load_leaves_the_callers_safe_globals_as_they_were(tiny):
    import argparse
    import datetime

    path = converted(tiny, "plain.pth", "tiny:build")
    mine = [argparse.Namespace, datetime.date]
    torch.serialization.add_safe_globals(mine)
    try:
        bnsurgeon.load(path, model="tiny:build")
        allowed = torch.serialization.get_safe_globals()
        assert all(entry in allowed for entry in mine), "bnsurgeon.load removed the caller's allow-list entries"
    finally:
        torch.serialization.clear_safe_globals()


# ---- 2. training checkpoints: nothing lost, nothing mislabelled ---------------------------


def training_checkpoint(tiny, name="train.pth.tar", ema_value=None, optimizer=True):
    """A timm-style training checkpoint of tiny:build: raw weights, an EMA that differs, optimizer, epoch."""
    sys.path.insert(0, str(tiny))
    import tiny as tiny_module

    raw = tiny_module.build()
    ema = tiny_module.build()
    with torch.no_grad():
        for parameter in ema.parameters():
            parameter.add_(0.25)
        for module in ema.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.fill_(0.5)
                module.running_var.fill_(2.0)
    state_ema = ema.state_dict()
    if ema_value is not None:
        state_ema["1.running_mean"] = torch.full_like(state_ema["1.running_mean"], ema_value)
    entries = {"epoch": 3, "state_dict": raw.state_dict(), "state_dict_ema": state_ema}
    if optimizer:
        entries["optimizer"] = torch.optim.SGD(raw.parameters(), lr=0.1).state_dict()
    path = tiny / name
    torch.save(entries, path)
    return path, raw.state_dict(), state_ema


@pytest.mark.parametrize("suffix", [".pth.tar", ".pth"])
def test_weights_ema_keeps_every_state_dict_under_its_own_name_and_load_returns_the_ema(tiny, suffix):
    path, raw, ema = training_checkpoint(tiny)
    out = tiny / f"o{suffix}"
    result = run(
        "convert", path, "--model", "tiny:build", "--weights", "state_dict_ema", "--input-shape", "2,3,8,8", "-o", out
    )
    assert result.exit_code == 0, result.output
    written = torch.load(out, weights_only=True)
    for key, value in raw.items():  # sync keeps every key: each entry holds its own source's values
        assert torch.equal(written["state_dict"][key], value), key
        assert torch.equal(written["state_dict_ema"][key], ema[key]), key
    assert written["epoch"] == 3 and "optimizer" in written
    loaded = bnsurgeon.load(out, model="tiny:build")
    assert torch.equal(loaded.state_dict()["1.running_mean"], ema["1.running_mean"])
    assert torch.equal(loaded.state_dict()["0.weight"], ema["0.weight"])
    # converting the output back takes the recorded weights, and still keeps both
    back = tiny / f"back{suffix}"
    converted_back = run(
        "convert", out, "--model", "tiny:build", "--to", "plain", "--input-shape", "2,3,8,8", "-o", back
    )
    assert converted_back.exit_code == 0, converted_back.output
    again = torch.load(back, weights_only=True)
    assert torch.equal(again["state_dict"]["0.weight"], raw["0.weight"])
    assert torch.equal(bnsurgeon.load(back, model="tiny:build").state_dict()["0.weight"], ema["0.weight"])


def test_carried_state_dicts_take_the_same_filters_and_folds(tiny):
    path, raw, ema = training_checkpoint(tiny, optimizer=False)
    out = tiny / "o.pth.tar"
    result = run(
        "convert",
        path,
        "--model",
        "tiny:build",
        "--to",
        "fused",
        "--exclude",
        "4",
        "--input-shape",
        "2,3,8,8",
        "-o",
        out,
    )
    assert result.exit_code == 0, result.output
    written = torch.load(out, weights_only=True)
    assert set(written["state_dict_ema"]) == set(written["state_dict"])  # the same BN left, the same folded
    assert "4.running_mean" in written["state_dict_ema"] and "1.running_mean" not in written["state_dict_ema"]
    verified = run(
        "verify",
        path,
        out,
        "--model",
        "tiny:build",
        "--weights",
        "state_dict_ema",
        "--converted-weights",
        "state_dict_ema",
        "--input-shape",
        "2,3,8,8",
    )
    assert verified.exit_code == 0, verified.output


def test_nan_in_a_carried_state_dict_is_refused_and_nothing_is_written(tiny):
    path, _, _ = training_checkpoint(tiny, ema_value=float("nan"))
    before = listing(tiny)
    result = run("convert", path, "--model", "tiny:build", "--input-shape", "2,3,8,8", "-o", tiny / "o.pth")
    one_line_failure(result, 4, "entry 'state_dict_ema'", "NaN or Inf", "1.running_mean")
    assert listing(tiny) == before


def test_an_entry_named_like_bnsurgeons_metadata_is_refused_not_written_unloadable(tiny):
    path, _ = tiny_checkpoint(tiny, "odd.pth", bnsurgeon={"note": "mine"})
    before = listing(tiny)
    result = run("convert", path, "--model", "tiny:build", "--input-shape", "2,3,8,8", "-o", tiny / "o.pth")
    one_line_failure(result, 2, "entry named 'bnsurgeon'", ".safetensors")
    assert listing(tiny) == before


def test_a_state_dict_entry_that_holds_no_weights_is_carried_and_the_output_loads(tiny):
    sys.path.insert(0, str(tiny))
    import tiny as tiny_module

    model = tiny_module.build()
    path = tiny / "odd.pth"
    torch.save({"state_dict": {"note": "not weights"}, "model": model.state_dict()}, path)
    out = tiny / "o.pth"
    result = run("convert", path, "--model", "tiny:build", "--input-shape", "2,3,8,8", "-o", out)
    assert result.exit_code == 0, result.output
    assert torch.load(out, weights_only=True)["state_dict"] == {"note": "not weights"}
    assert torch.equal(bnsurgeon.load(out, model="tiny:build").state_dict()["0.weight"], model.state_dict()["0.weight"])


# ---- 3. memory: a small file cannot make bnsurgeon allocate a lot -------------------------


def test_a_compressed_checkpoint_that_would_expand_in_memory_is_refused_before_it_is_read(tiny, monkeypatch):
    import zipfile

    stored = tiny / "stored.pt"
    torch.save({"state_dict": {"w": torch.zeros(4 * 1024 * 1024)}}, stored)  # 16 MiB of zeros
    bomb = tiny / "bomb.pt"
    with zipfile.ZipFile(stored) as src, zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    stored.unlink()
    assert bomb.stat().st_size < 200_000
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("the records were read"))
    result = run("inspect", bomb, "--model", "tiny:build")
    one_line_failure(result, 4, "compressed record", "expands", "16.0 MiB", "torch.save never compresses")


@pytest.mark.parametrize("example", ["expanded", "shared"])
def test_an_example_input_declaring_more_values_than_its_file_holds_is_refused(tiny, example):
    base = torch.zeros(2, 3, 64, 64)
    value = torch.zeros(1).expand(2, 3, 1024, 1024) if example == "expanded" else [base] * 16
    path = tiny / "x.pt"
    torch.save(value, path)
    before = listing(tiny)
    result = run("convert", "tiny:build", "--example-input", path, "-o", tiny / "o.safetensors")
    one_line_failure(result, 2, "declares", "bytes of values but the file holds", "torch.save(x.clone()")
    assert listing(tiny) == before


def test_running_out_of_memory_is_exit_9_with_the_size_not_a_traceback(tiny, monkeypatch):
    import bnsurgeon.api

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 123480309760 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(bnsurgeon.api, "convert_source", out_of_memory)
    result = run("convert", "tiny:build", "--to", "fused", "-o", tiny / "o.safetensors")
    one_line_failure(result, 9, "larger than this machine's memory", "115.0 GiB", "smaller --input-shape")
    monkeypatch.setattr(bnsurgeon.api, "convert_source", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    one_line_failure(run("convert", "tiny:build", "-o", tiny / "o.safetensors"), 9, "larger than this machine's memory")


# ---- 5. writes and signals (continued) ----------------------------------------------------


def test_two_force_writers_to_one_output_never_mix_their_files(tmp_path, monkeypatch):
    """A commits slowly, B quickly and after A started: unlocked, the checkpoint came from B and the
    reports from A. The unit is committed under a lock on the directory."""
    import os
    import threading
    import time

    from bnsurgeon.files import safewrite

    finals = [tmp_path / "out.pth", tmp_path / "out.pth.report.json", tmp_path / "out.pth.report.md"]
    real_replace = os.replace
    a_committing = threading.Event()

    def replace(src, dst):
        real_replace(src, dst)
        if threading.current_thread().name == "A":
            a_committing.set()
            time.sleep(0.2)

    monkeypatch.setattr(safewrite.os, "replace", replace)

    def writer(tag):
        def write(temp):
            temp.write_text(tag)

        return write

    def run_writer(tag, wait=None):
        if wait is not None:
            wait.wait(5)
        safewrite.write_files({final: writer(tag) for final in finals}, force=True)

    a = threading.Thread(target=run_writer, args=("A",), name="A")
    b = threading.Thread(target=run_writer, args=("B", a_committing), name="B")
    a.start()
    b.start()
    a.join(10)
    b.join(10)
    contents = {final.read_text() for final in finals}
    assert len(contents) == 1, [final.read_text() for final in finals]
    assert not [p for p in tmp_path.iterdir() if ".bnsurgeon-tmp-" in p.name]


def stray_temps(directory):
    return [p.name for p in directory.iterdir() if ".bnsurgeon-tmp-" in p.name]


def test_a_second_ctrl_c_during_cleanup_leaves_no_temp_directory(tiny, monkeypatch):
    import os
    import shutil
    import signal
    import time

    import safetensors.torch

    real_rmtree = shutil.rmtree

    def interrupted_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, while the checkpoint is written
        time.sleep(1)

    def rmtree_then_again(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the second, as the cleanup starts
        time.sleep(0.2)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted_save)
    monkeypatch.setattr(shutil, "rmtree", rmtree_then_again)
    result = run("convert", "tiny:build", "--input-shape", "2,3,8,8", "-o", tiny / "o.safetensors")
    one_line_failure(result, 130, "interrupted (SIGINT)", "nothing was written")
    assert stray_temps(tiny) == [] and not (tiny / "o.safetensors").exists()


def test_a_ctrl_c_during_cleanup_after_the_commit_says_the_files_are_written(tiny, monkeypatch):
    import os
    import shutil
    import signal
    import time

    real_rmtree = shutil.rmtree

    def rmtree_interrupted(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_interrupted)
    out = tiny / "o.safetensors"
    result = run("convert", "tiny:build", "--input-shape", "2,3,8,8", "-o", out)
    one_line_failure(result, 130, "interrupted (SIGINT)", "written completely")
    assert out.exists() and stray_temps(tiny) == []


def test_outputs_holding_a_bool_mask_are_compared_not_a_crash():
    from bnsurgeon.checks.verify import Tolerance, _within  # noqa: F401  (the comparison verify uses)

    mask = torch.tensor([True, False])
    ok, _ = _within([torch.ones(2), mask], [torch.ones(2) + 1e-9, mask], Tolerance(rtol=1e-6))
    assert ok
    ok, _ = _within([mask], [~mask], Tolerance(rtol=1e-6))
    assert not ok


def test_load_restores_which_parameters_train_and_refuses_names_it_does_not_have(tiny):
    from test_untrusted import edited

    out = converted(tiny, "out.safetensors", "tiny:build")
    assert all(p.requires_grad for p in bnsurgeon.load(out, model="tiny:build").parameters())
    frozen = edited(out, tiny / "frozen.safetensors", frozen_parameters=["0.weight"])
    model = bnsurgeon.load(frozen, model="tiny:build")
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["0.weight"]
    bad = edited(out, tiny / "bad.safetensors", frozen_parameters=["nowhere.weight"])
    one_line_failure(run("inspect", bad, "--model", "tiny:build"), 4, "frozen_parameters", "nowhere.weight")
