"""Checkpoints as users have them, and bad input that never costs data (issue 5)."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from _modules import install_module
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.cli.commands import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def snapshot(directory):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.fixture(scope="module")
def resnet():
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=10)


def assert_clean_failure(result, code, message, directory, before):
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert snapshot(directory) == before


def test_truncated_safetensors(tmp_path, resnet):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file(resnet.state_dict(), str(path))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = snapshot(tmp_path)
    result = run("convert", path, "-m", "resnet18", "--model-arg", "num_classes=10", "-o", tmp_path / "o.safetensors")
    assert_clean_failure(result, 4, "not a readable .safetensors", tmp_path, before)


def test_truncated_pt(tmp_path, resnet):
    path = tmp_path / "w.pt"
    torch.save(resnet.state_dict(), path)
    path.write_bytes(path.read_bytes()[:1000])
    before = snapshot(tmp_path)
    result = run("convert", path, "-m", "resnet18", "-o", tmp_path / "o.safetensors")
    assert_clean_failure(result, 4, "not a readable PyTorch checkpoint", tmp_path, before)


def test_file_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("these are my notes, not weights\n")
    before = snapshot(tmp_path)
    result = run("convert", path, "-m", "resnet18", "-o", tmp_path / "o.safetensors")
    assert_clean_failure(result, 4, "not a readable PyTorch checkpoint", tmp_path, before)


def test_checkpoint_without_model_weights(tmp_path):
    path = tmp_path / "meta.pt"
    torch.save({"epoch": 1, "note": "no tensors"}, path)
    result = run("convert", path, "-m", "resnet18", "-o", tmp_path / "o.safetensors")
    assert result.exit_code == 4 and "holds no model weights" in result.output


def test_output_directory_not_writable(tmp_path, monkeypatch):
    import os

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    before = snapshot(tmp_path)
    result = run("convert", "resnet18", "-o", tmp_path / "o.safetensors")
    assert_clean_failure(result, 8, "is not writable", tmp_path, before)


@pytest.mark.parametrize(
    "failure, code, message",
    [
        (KeyboardInterrupt(), 130, "interrupted"),
        (OSError(errno.ENOSPC, "No space left on device"), 8, "No space left on device"),
    ],
)
def test_interrupted_or_full_disk_write_keeps_previous_file_and_leaves_nothing(
    tmp_path, monkeypatch, failure, code, message
):
    import safetensors.torch

    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous version")

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"half a file")
        raise failure

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    before = snapshot(tmp_path)
    result = run("convert", "resnet18", "-o", out, "--force")
    assert_clean_failure(result, code, message, tmp_path, before)
    assert out.read_bytes() == b"previous version"


def test_weights_flag_picks_the_ema_and_lists_choices(tmp_path, resnet):
    import argparse

    ema = {k: v + 1 if v.is_floating_point() else v for k, v in resnet.state_dict().items()}
    path = tmp_path / "train.pth.tar"
    torch.save(
        {
            "arch": "resnet18",
            "args": argparse.Namespace(num_classes=10),
            "state_dict": resnet.state_dict(),
            "state_dict_ema": ema,
            "epoch": 7,
        },
        path,
    )
    listing = runner.invoke(app, ["inspect", str(path), "--json"])
    data = json.loads(listing.stdout)
    assert data["checkpoint"]["model_weights"] == {"state_dict": 122, "state_dict_ema": 122}
    assert {e["key"] for e in data["checkpoint"]["entries"]} == {
        "arch",
        "args",
        "state_dict",
        "state_dict_ema",
        "epoch",
    }

    out = tmp_path / "ema.safetensors"
    assert run("convert", path, "--weights", "state_dict_ema", "-o", out).exit_code == 0
    assert torch.equal(bnsurgeon.load(out).conv1.weight, ema["conv1.weight"])
    bad = run("convert", path, "--weights", "nope", "-o", tmp_path / "x.safetensors")
    assert bad.exit_code == 2 and "'state_dict_ema'" in bad.output


@pytest.mark.parametrize("layout", ["lightning", "nested-model", "bare-bin", "safetensors-no-metadata"])
def test_common_layouts_convert_with_model(tmp_path, resnet, layout):
    from safetensors.torch import save_file

    state = resnet.state_dict()
    if layout == "lightning":
        path = tmp_path / "l.ckpt"
        torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 1}, path)
    elif layout == "nested-model":
        path = tmp_path / "n.pth"
        torch.save({"model": state}, path)
    elif layout == "bare-bin":
        path = tmp_path / "pytorch_model.bin"
        torch.save(state, path)
    else:
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    out = tmp_path / "out.safetensors"
    result = run("convert", path, "-m", "resnet18", "--model-arg", "num_classes=10", "-o", out)
    assert result.exit_code == 0, result.output
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(resnet.eval()(x), bnsurgeon.load(out).eval()(x))


def test_whole_module_pickle_needs_trust(tmp_path, resnet):
    path = tmp_path / "whole.pt"
    torch.save(resnet, path)
    before = snapshot(tmp_path)
    result = run("convert", path, "-o", tmp_path / "o.safetensors")
    assert_clean_failure(result, 5, "would run code", tmp_path, before)
    trusted = run("convert", path, "--trust-pickle", "-o", tmp_path / "o.safetensors")
    assert trusted.exit_code == 0, trusted.output
    model = bnsurgeon.load(tmp_path / "o.safetensors", model=bnsurgeon.convert(resnet, "plain").model)
    assert type(model.bn1).__name__ == "SyncBatchNorm"


def test_uninitialized_lazy_bn_via_cli(tmp_path, monkeypatch):
    install_module(
        tmp_path,
        monkeypatch,
        "lazy_model",
        "import torch.nn as nn\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d())\n",
    )
    before = snapshot(tmp_path)
    result = run("convert", "lazy_model:build", "-o", tmp_path / "o.safetensors")
    assert_clean_failure(result, 7, "uninitialized lazy batch norm", tmp_path, before)
    assert "run one forward pass" in result.output
