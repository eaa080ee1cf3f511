"""Each command through Typer's runner: output, JSON, exit codes, and nothing written on failure."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from _modules import install_module
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.cli.commands import app
from bnsurgeon.core.errors import UsageError
from bnsurgeon.runtime import SyncBatchNormAct

runner = CliRunner()


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, [str(a) for a in args], env=env or {"COLUMNS": "200"})


def files(directory: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def test_version_and_help():
    assert run("--version").stdout.strip() == f"bnsurgeon {bnsurgeon.__version__}"
    result = run("convert", "--help")
    assert result.exit_code == 0 and "--to" in result.stdout and "Example" in result.stdout


def test_inspect_efficientnet_lists_batchnormact_and_torch_converter_effect():
    result = run("inspect", "tf_efficientnet_b3")
    assert result.exit_code == 0, result.output
    assert "BatchNormAct2d" in result.output and "78" in result.output
    assert "drops act=SiLU" in result.output
    assert "78 BN-family modules in 1 class, 0 unhandled" in result.output


def test_inspect_json_is_one_document_with_the_same_facts():
    result = runner.invoke(app, ["inspect", "timm:tf_efficientnet_b3", "--json"])
    data = json.loads(result.stdout)
    group = data["groups"][0]
    assert group["cls"] == "timm.layers.norm_act.BatchNormAct2d" and group["count"] == 78
    assert group["targets"]["sync"] == "SyncBatchNormAct" and "drops act=SiLU" in group["torch_converter"]
    assert group["targets"]["fused"] == "foldable"  # --to fused folds it into the conv before it
    assert data["totals"]["parameters"] == 12233232


def test_rules_lists_the_registry():
    result = runner.invoke(app, ["rules", "--json"])
    names = {rule["name"] for rule in json.loads(result.stdout)}
    assert {"torch-batchnorm", "timm-batchnorm-act", "torchvision-frozen", "timm-frozen-act", "bnsurgeon-sync"} <= names


def test_convert_load_and_back_to_plain(tmp_path):
    import timm

    sync_path = tmp_path / "b0.sync.safetensors"
    result = run("convert", "efficientnet_b0", "-o", sync_path, "--model-arg", "num_classes=10")
    assert result.exit_code == 0, result.output
    assert "SyncBatchNormAct" in result.output and "passed" in result.output
    report = json.loads((tmp_path / "b0.sync.safetensors.report.json").read_text())
    assert report["totals"]["changed"] == 49 and report["check"]["passed"] and report["schema_version"] == 1
    assert "## bnsurgeon" in (tmp_path / "b0.sync.safetensors.report.md").read_text()

    model = bnsurgeon.load(sync_path)
    assert isinstance(model.bn1, SyncBatchNormAct) and isinstance(model.bn1.act, torch.nn.SiLU)
    reference = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        assert torch.equal(reference.eval()(x), model.eval()(x))

    plain_path = tmp_path / "b0.plain.safetensors"
    result = run("convert", sync_path, "--to", "plain", "-o", plain_path)
    assert result.exit_code == 0, result.output
    plain = bnsurgeon.load(plain_path)
    assert type(plain.bn1).__name__ == "BatchNormAct2d"
    assert plain.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in model.state_dict().items())


def test_metadata_round_trip(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "r.safetensors"
    assert run("convert", "resnet18", "-o", path, "--to", "frozen").exit_code == 0
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["format"] == "pt"
    assert json.loads(meta["bnsurgeon.architecture"]) == {"kind": "timm", "name": "resnet18", "kwargs": {}}
    assert json.loads(meta["bnsurgeon.target"]) == "frozen"
    assert json.loads(meta["bnsurgeon.classes"])["bn1"] == "bnsurgeon.runtime.layers.FrozenBatchNorm"
    assert type(bnsurgeon.load(path).bn1).__name__ == "FrozenBatchNorm"


def test_pt_output_loads_with_weights_only(tmp_path):
    path = tmp_path / "r.pt"
    assert run("convert", "resnet18", "-o", path).exit_code == 0
    payload = torch.load(path, weights_only=True)
    assert "bn1.weight" in payload["state_dict"] and "architecture" in payload["bnsurgeon"]
    assert type(bnsurgeon.load(path).bn1).__name__ == "SyncBatchNorm"


def test_shared_module_saved_once_and_restored(tmp_path, monkeypatch):
    install_module(
        tmp_path,
        monkeypatch,
        "shared_model",
        "import torch.nn as nn\n"
        "def build():\n"
        "    bn = nn.BatchNorm2d(3)\n"
        "    return nn.Sequential(nn.Conv2d(3, 3, 1), bn, nn.Conv2d(3, 3, 1), bn)\n",
    )
    out = tmp_path / "s.safetensors"
    result = run("convert", "shared_model:build", "-o", out)
    assert result.exit_code == 0, result.output
    with pytest.raises(UsageError, match="runs code"):
        bnsurgeon.load(out)
    model = bnsurgeon.load(out, model="shared_model:build")
    assert model[1] is model[3] and type(model[1]).__name__ == "SyncBatchNorm"


def test_user_bn_subclass_refused_then_allowed(tmp_path, monkeypatch):
    install_module(
        tmp_path,
        monkeypatch,
        "custom_model",
        "import torch.nn as nn\n"
        "class MyBN(nn.BatchNorm2d):\n"
        "    pass\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), MyBN(4))\n",
    )
    out = tmp_path / "c.safetensors"
    before = files(tmp_path)
    result = run("convert", "custom_model:build", "-o", out)
    assert result.exit_code == 7
    assert "2 (MyBN)" in result.output and "--allow-unhandled" in result.output
    assert "Traceback" not in result.output and files(tmp_path) == before
    result = run("convert", "custom_model:build", "-o", out, "--allow-unhandled")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "c.safetensors.report.json").read_text())
    assert [u["cls"] for u in report["unhandled"]] == ["custom_model.MyBN"]


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["convert", "resnet5O", "-o", "{tmp}/x.safetensors"], 3, "did you mean resnet50"),
        (
            ["convert", "resnet18", "-o", "{tmp}/x.safetensors", "--to", "sideways"],
            2,
            "'sideways' is not one of 'sync', 'plain', 'frozen'",
        ),
        (["convert", "{tmp}/missing.pt", "-m", "resnet18", "-o", "{tmp}/x.safetensors"], 3, "no such file"),
        (["convert", "{tmp}", "-m", "resnet18", "-o", "{tmp}/x.safetensors"], 4, "is a directory"),
        (["convert", "{tmp}/empty.pt", "-m", "resnet18", "-o", "{tmp}/x.safetensors"], 4, "is empty"),
        (["convert", "resnet18", "-o", "{tmp}/nodir/x.safetensors"], 8, "does not exist"),
        (["convert", "resnet18", "-o", "{tmp}/x.txt"], 8, "cannot tell the format"),
        (["convert", "{tmp}/same.safetensors", "-o", "{tmp}/same.safetensors", "--force"], 8, "is the input file"),
    ],
)
def test_bad_input_exit_codes_messages_and_nothing_written(tmp_path, args, code, message):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "same.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    before = files(tmp_path)
    result = run(*[a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert files(tmp_path) == before


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"precious")
    result = run("convert", "resnet18", "-o", out)
    assert result.exit_code == 8 and "--force" in result.output and out.read_bytes() == b"precious"
    assert run("convert", "resnet18", "-o", out, "--force").exit_code == 0
    assert out.read_bytes() != b"precious"


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "payload": Evil()}, path)
    result = run("convert", path, "-m", "resnet18", "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 5, result.output
    assert "would run code" in result.output and "--trust-pickle" in result.output
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_timm_training_checkpoint_with_ddp_prefix_needs_no_model(tmp_path):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    args = argparse.Namespace(model="resnet18", num_classes=10, lr=0.1)
    path = tmp_path / "checkpoint.pth.tar"
    torch.save({"epoch": 3, "arch": "resnet18", "state_dict": state, "optimizer": {"state": {}}, "args": args}, path)
    out = tmp_path / "r18.sync.safetensors"
    result = run("convert", path, "-o", out)
    assert result.exit_code == 0, result.output
    loaded = bnsurgeon.load(out)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), loaded.eval()(x))
    report = json.loads((tmp_path / "r18.sync.safetensors.report.json").read_text())
    assert "optimizer" in report["carried"] and "epoch" in report["carried"]


def test_weights_that_do_not_fit_list_the_keys(tmp_path):
    import timm

    path = tmp_path / "w.pt"
    torch.save(timm.create_model("resnet18", pretrained=False, num_classes=10).state_dict(), path)
    result = run("convert", path, "-m", "resnet18", "-o", tmp_path / "o.safetensors")
    assert result.exit_code == 6
    assert "shape mismatch" in result.output and "fc.weight" in result.output and "num_classes" in result.output


def test_json_and_human_output_carry_the_same_facts(tmp_path):
    human = run("inspect", "resnet18")
    data = json.loads(runner.invoke(app, ["inspect", "resnet18", "--json"]).stdout)
    group = data["groups"][0]
    assert f"{data['totals']['bn_modules']} BN-family modules" in human.output
    assert f"{data['totals']['parameters']:,} parameters" in human.output
    assert group["rule"] in human.output and group["targets"]["sync"] in human.output

    out = tmp_path / "r.safetensors"
    report = json.loads(runner.invoke(app, ["convert", "resnet18", "-o", str(out), "--json"]).stdout)
    human = run("convert", "resnet18", "-o", out, "--force")
    assert f"{report['totals']['changed']} converted" in human.output
    assert report["check"]["mode"] in human.output and report["schema_version"] == 1

    rules = json.loads(runner.invoke(app, ["rules", "--json"]).stdout)
    human = run("rules")
    assert all(rule["name"] in human.output for rule in rules)


def test_quiet_prints_nothing_but_errors():
    assert run("inspect", "resnet18", "--quiet").output == ""
    failing = run("inspect", "resnet5O", "--quiet")
    assert failing.exit_code == 3 and "unknown timm model" in failing.output
