"""Real segmentation and detection models (torchvision, segmentation_models_pytorch, and
OpenMMLab / ultralytics where installed) through inspect / convert / verify / revert.

Small inputs, no weights downloaded (weights=None, encoder_weights=None, seeded init).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_inspect_builds_for_real_where_the_meta_build_fails():
    """torchvision RegNet copies out of a tensor at init: no meta build; inspect falls back as convert does."""
    result = run("inspect", "torchvision.models:regnet_y_400mf", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(g["cls"], g["count"]) for g in data["groups"]] == [("torch.nn.modules.batchnorm.BatchNorm2d", 53)]
    assert any("cannot be built on the meta device" in note for note in data["notes"])


def test_inspect_ultralytics_yaml_model():
    pytest.importorskip("ultralytics", reason="ultralytics not installed (optional: pip install ultralytics)")
    result = run(
        "inspect",
        "ultralytics.nn.tasks:DetectionModel",
        "--model-arg",
        "cfg=yolov8n.yaml",
        "--model-arg",
        "verbose=False",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["totals"]["bn_modules"] == 57 and data["totals"]["unhandled"] == 0


# -- the check input ------------------------------------------------------------------------


def test_check_input_is_sized_for_the_first_conv_the_forward_reaches():
    """Module order lies: the head is declared first; the stem (a Conv2d subclass) runs first."""
    import torch
    from torch import nn

    from bnsurgeon.checks.eval_check import infer_input_shape

    class SamePadConv(nn.Conv2d):
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Conv2d(16, 4, 1)
            self.stem = SamePadConv(3, 16, 3, padding=1)
            self.bn = nn.BatchNorm2d(16)

        def forward(self, x):
            return self.head(self.bn(self.stem(x)))

    torch.manual_seed(0)
    assert infer_input_shape(Net()) == (2, 3, 64, 64)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _classes(path, factory):
    import bnsurgeon
    from bnsurgeon.surgery.walk import class_map

    return set(class_map(bnsurgeon.load(path, model=factory)).values())


def test_dict_example_input_is_recorded_and_reused(in_tmp):
    import torch

    from bnsurgeon.files.reading import read_checkpoint
    from bnsurgeon.loading.recorded import read_recorded

    factory = "_real_models:dict_input"
    refused = run("convert", factory, "-o", in_tmp / "x.safetensors")
    assert (
        refused.exit_code == 9 and "cannot run on the input" in refused.output and "--example-input" in refused.output
    )
    torch.save({"image": torch.zeros(2, 3, 16, 16), "scale": torch.ones(2, 8)}, in_tmp / "batch.pt")
    sync = in_tmp / "sync.safetensors"
    result = run("convert", factory, "--example-input", in_tmp / "batch.pt", "-o", sync, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["check"]["input"] == "dict {image: (2, 3, 16, 16), scale: (2, 8)}"
    assert read_recorded(read_checkpoint(sync)).check_input.to_record() == {
        "kind": "dict",
        "shapes": [["image", [2, 3, 16, 16]], ["scale", [2, 8]]],
    }
    plain = in_tmp / "plain.safetensors"
    again = run("convert", sync, "--to", "plain", "--model", factory, "-o", plain, "--json")
    assert again.exit_code == 0, again.output  # no --example-input: the recorded one is used
    assert json.loads(again.stdout)["check"]["input"].startswith("dict {image")
    assert _classes(plain, factory) == {"torch.nn.modules.batchnorm.BatchNorm2d"}


@pytest.mark.parametrize(
    "payload, message",
    [
        ("code", "not a plain tensor file"),
        ("ints", "has dtype torch.int64"),
        ("str", "holds a str"),
        ("ragged", "share the batch size"),
        ("empty_side", "holds no values"),
        ("scalar_samples", "at least one dimension"),
    ],
)
def test_example_input_is_data_only_and_validated(in_tmp, payload, message):
    import os

    import torch

    path = in_tmp / "x.pt"
    value = {
        "code": os.getcwd.__class__,
        "ints": torch.arange(4),
        "str": "hello",
        "ragged": {"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)},
        "empty_side": torch.zeros(2, 3, 0, 8),
        "scalar_samples": [torch.tensor(1.0), torch.tensor(2.0)],
    }[payload]
    if payload == "code":  # a pickle that names a global: must not be imported, let alone run
        import pickle

        path.write_bytes(pickle.dumps(os.system))
    else:
        torch.save(value, path)
    before = sorted(p.name for p in in_tmp.iterdir())
    result = run("convert", "_real_models:dict_input", "--example-input", path, "-o", in_tmp / "out.safetensors")
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in in_tmp.iterdir()) == before


def test_recorded_check_input_is_validated(in_tmp):
    from bnsurgeon.checks.check_input import CheckInput
    from bnsurgeon.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="recorded check input is invalid"):
        CheckInput.from_record({"kind": "tensor", "shapes": [[2, 3, 10**9]]})
    with pytest.raises(CheckpointError, match="recorded check input is invalid"):
        CheckInput.from_record({"kind": "dict", "shapes": [["__class__.x", [2]]]})
    assert CheckInput.from_record({"kind": "list", "shapes": [[3, 8, 8]]}).describe() == "list of 1 sample (3, 8, 8)"


# -- verify on outputs that are not plain tensors -------------------------------------------

VACUOUS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.mode = mode

    def forward(self, x):
        y = self.body(x)
        if self.mode == "empty":
            return [{"boxes": y.new_zeros(0, 4), "scores": y.new_zeros(0)} for _ in range(len(x))]
        if self.mode == "nan":
            return y * float("nan")
        return y.sum()  # one number for the whole batch: not per sample


def empty():
    torch.manual_seed(0)
    return Net("empty")


def nan():
    torch.manual_seed(0)
    return Net("nan")


def pooled():
    torch.manual_seed(0)
    return Net("pooled")
"""


@pytest.fixture
def vacuous_models(in_tmp, monkeypatch):
    (in_tmp / "vacuous_models.py").write_text(VACUOUS)
    monkeypatch.syspath_prepend(str(in_tmp))
    return in_tmp


@pytest.mark.parametrize("factory, reason", [("empty", "outputs are empty"), ("nan", "NaN/inf")])
def test_vacuous_comparisons_are_not_a_pass(vacuous_models, factory, reason):
    """NaN outputs are vacuous, not a pass. Empty outputs make verify compare at the deepest module whose
    outputs hold values instead (as for a detector without weights), saying where and how many values."""
    out = vacuous_models / "sync.safetensors"
    converted = run("convert", f"vacuous_models:{factory}", "--input-shape", "2,3,8,8", "-o", out, "--json")
    assert converted.exit_code == 0, converted.output
    assert "inconclusive" in json.loads(converted.stdout)["check"]["note"]
    verify = (
        "verify",
        f"vacuous_models:{factory}",
        out,
        "--converted-model",
        f"vacuous_models:{factory}",
        "--input-shape",
        "2,3,8,8",
        "--no-perturb",
        "-w",
        "2",
        "--json",
    )
    result = run(*verify)
    if factory == "empty":
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        assert document["compare_at"] and "empty" in document["compare_at_why"], document
        assert all(c["values"] > 0 for c in document["checks"] if c["passed"] is not None), document["checks"]
        return
    assert result.exit_code == 1, result.output
    checks = json.loads(result.stdout)["checks"]
    assert checks[0]["name"] == "eval" and checks[0]["passed"] is False
    assert all(
        "vacuous, not a pass" in c["detail"] and reason in c["detail"] for c in checks if c["passed"] is not None
    )


@pytest.mark.distributed
def test_compare_at_a_submodule_where_the_output_is_not_per_sample(vacuous_models):
    out = vacuous_models / "sync.safetensors"
    assert run("convert", "vacuous_models:pooled", "--input-shape", "2,3,8,8", "-o", out).exit_code == 0
    whole = run(
        "verify",
        "vacuous_models:pooled",
        out,
        "--converted-model",
        "vacuous_models:pooled",
        "--input-shape",
        "2,3,8,8",
        "--no-perturb",
        "--json",
    )
    assert whole.exit_code == 1
    ranks = json.loads(whole.stdout)["checks"][-1]
    assert ranks["name"] == "2 ranks" and "not per sample" in ranks["detail"]
    at = run(
        "verify",
        "vacuous_models:pooled",
        out,
        "--converted-model",
        "vacuous_models:pooled",
        "--input-shape",
        "2,3,8,8",
        "--no-perturb",
        "--json",
        "--compare-at",
        "body",
    )
    assert at.exit_code == 0, at.output
    assert json.loads(at.stdout)["compare_at"] == "body"
    bad = run(
        "verify",
        "vacuous_models:pooled",
        out,
        "--converted-model",
        "vacuous_models:pooled",
        "--input-shape",
        "2,3,8,8",
        "--compare-at",
        "nope",
    )
    assert bad.exit_code == 2 and "not a submodule" in bad.output and "body" in bad.output


# -- end to end: inspect / convert / verify -w 2 / revert ------------------------------------

#: factory, input flags, convert flags, BN classes in the source
END_TO_END = [
    pytest.param("unet_efficientnet", (), (), id="smp-unet-efficientnet-native"),
    pytest.param("deeplabv3plus_timm_universal", (), (), id="smp-deeplabv3plus-tu-regnety"),
    pytest.param("deeplabv3", (), (), id="torchvision-deeplabv3"),
    pytest.param("fasterrcnn_frozen", ("images",), ("--frozen", "unfreeze"), id="torchvision-fasterrcnn-frozen"),
    pytest.param("retinanet", ("images",), (), id="torchvision-retinanet"),
    pytest.param("ssdlite", ("images",), (), id="torchvision-ssdlite"),
]


@pytest.mark.distributed
@pytest.mark.parametrize("name, inputs, convert_flags", END_TO_END)
def test_real_model_end_to_end(in_tmp, name, inputs, convert_flags):
    import torch

    pytest.importorskip(
        "segmentation_models_pytorch",
        reason="segmentation_models_pytorch not installed (pip install 'bnsurgeon[test]')",
    ) if name.startswith(("unet", "deeplabv3plus")) else None
    factory = f"_real_models:{name}"
    flags = ["--input-shape", "2,3,32,32"]  # the smallest size the encoders take: float64 ranks stay cheap
    if "images" in inputs:  # a detector takes a list of images
        torch.save([torch.rand(3, 64, 64), torch.rand(3, 64, 64)], in_tmp / "images.pt")
        flags = ["--example-input", in_tmp / "images.pt"]

    listing = run("inspect", factory, "--json")
    assert listing.exit_code == 0, listing.output
    assert json.loads(listing.stdout)["totals"]["unhandled"] == 0
    source_classes = {g["cls"] for g in json.loads(listing.stdout)["groups"]}

    sync = in_tmp / "sync.safetensors"
    converted = run("convert", factory, "-o", sync, *flags, *convert_flags, "--json")
    assert converted.exit_code == 0, converted.output
    report = json.loads(converted.stdout)
    assert report["check"]["passed"] and not report["check"]["note"] and report["totals"]["changed"] > 0

    # the input recorded in sync; CONVERTED's factory confirmed like SOURCE's
    verified = run("verify", factory, sync, "--converted-model", factory, "-w", "2", "--no-perturb", "--json")
    assert verified.exit_code == 0, verified.output
    checks = {c["name"]: c for c in json.loads(verified.stdout)["checks"]}
    ranks = next(c for n, c in checks.items() if n.startswith("2 ranks"))
    assert ranks["passed"] is True and "per sample" in ranks["detail"]

    plain = in_tmp / "plain.safetensors"
    reverted = run("convert", sync, "--to", "plain", "--model", factory, "-o", plain)
    assert reverted.exit_code == 0, reverted.output
    if convert_flags:  # unfreeze made them trainable: plain BatchNorm2d now
        assert _classes(plain, factory) == {"torch.nn.modules.batchnorm.BatchNorm2d"}
    else:
        assert _classes(plain, factory) == source_classes


@pytest.mark.distributed
def test_frozen_round_trip_unfreeze_train_on_two_ranks_refreeze_load(in_tmp):
    """unfreeze -> 2-rank training -> --to frozen (and --to plain) -> load gives back torchvision's class."""
    import torch
    from torchvision.ops.misc import FrozenBatchNorm2d

    import bnsurgeon
    from bnsurgeon.checks.multiproc import run_world
    from bnsurgeon.surgery.walk import class_map

    factory = "_real_models:fasterrcnn_frozen"
    sync, trained = in_tmp / "sync.safetensors", in_tmp / "trained.safetensors"
    assert run("convert", factory, "--frozen", "unfreeze", "-o", sync, "--no-check").exit_code == 0
    stats = run_world(2, _train_worker(), str(sync), factory, str(trained), timeout=240)
    assert stats[0].keys() == stats[1].keys() and all(torch.equal(stats[0][k], stats[1][k]) for k in stats[0])

    refrozen, plain = in_tmp / "refrozen.safetensors", in_tmp / "plain.safetensors"
    result = run("convert", trained, "--to", "frozen", "--model", factory, "-o", refrozen, "--json")
    assert result.exit_code == 0, result.output
    assert "close" in json.loads(result.stdout)["check"]["mode"]  # x*scale+shift again
    assert run("convert", trained, "--to", "plain", "--model", factory, "-o", plain).exit_code == 0

    model = bnsurgeon.load(refrozen, model=factory)
    assert set(class_map(model).values()) == {"torchvision.ops.misc.FrozenBatchNorm2d"}
    learned = model.backbone.body.layer2[0].bn1
    assert type(learned) is FrozenBatchNorm2d
    key = "backbone.body.layer2.0.bn1.running_mean"
    assert torch.equal(learned.running_mean, stats[0][key])  # what it learned while thawed
    assert not torch.equal(stats[0][key], torch.zeros_like(stats[0][key]))
    assert set(class_map(bnsurgeon.load(plain, model=factory)).values()) == {"torch.nn.modules.batchnorm.BatchNorm2d"}


def _train_worker():
    import _real_models

    return _real_models.train_backbone_two_steps


def test_include_exclude_keep_torchvisions_frozen_stem_frozen_through_save_and_load(in_tmp):
    """Unfreeze is no longer all-or-nothing: the stem and layer1 torchvision keeps frozen stay frozen."""
    import bnsurgeon
    from bnsurgeon.surgery.walk import class_map

    factory = "_real_models:fasterrcnn_frozen"
    filters = ["--exclude", "backbone.body.bn1", "--exclude", "backbone.body.layer1.*"]
    listing = run("inspect", factory, *filters, "--json")
    assert listing.exit_code == 0, listing.output
    note = next(n for n in json.loads(listing.stdout)["notes"] if "--exclude" in n)
    assert "15 of 20 BN module names selected" in note and "backbone.body.bn1" in note

    out = in_tmp / "partial.safetensors"
    result = run("convert", factory, "--frozen", "unfreeze", *filters, "-o", out, "--no-check", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["options"]["exclude"] == ["backbone.body.bn1", "backbone.body.layer1.*"]
    assert {k["reason"] for k in report["kept"]} == {
        "excluded by --exclude backbone.body.bn1",
        "excluded by --exclude backbone.body.layer1.*",
    }
    classes = class_map(bnsurgeon.load(out, model=factory))  # the filters are replayed on load
    frozen = {p for p, c in classes.items() if c == "torchvision.ops.misc.FrozenBatchNorm2d"}
    assert frozen == {"backbone.body.bn1"} | {p for p in classes if p.startswith("backbone.body.layer1.")}
    assert len(frozen) == 5 and all(c.endswith("SyncBatchNorm") for p, c in classes.items() if p not in frozen)


# -- OpenMMLab and Lightning classes -----------------------------------------------------------


@pytest.mark.parametrize(
    "factory, cls, rule",
    [
        ("mmengine_syncbn", "mmengine.utils.dl_utils.parrots_wrapper.SyncBatchNorm", "mmengine-syncbn"),
        ("mmengine_reverted", "mmengine.model.utils._BatchNormXd", "mmengine-batchnorm-xd"),
        ("lightning_reverted", "lightning.pytorch.plugins.layer_sync._BatchNormXd", "lightning-batchnorm-xd"),
    ],
)
def test_openmmlab_and_lightning_classes_convert_and_plain_restores_dimensionality(in_tmp, factory, cls, rule):
    pytest.importorskip(
        "mmengine" if factory.startswith("mm") else "lightning",
        reason="optional: pip install 'bnsurgeon[openmmlab]' / 'bnsurgeon[lightning]'",
    )
    source = f"_real_models:{factory}"
    listing = run("inspect", source, "--json")
    assert listing.exit_code == 0, listing.output
    groups = json.loads(listing.stdout)["groups"]
    assert [(g["cls"], g["count"], g["rule"]) for g in groups] == [(cls, 2, rule)]

    sync = in_tmp / "sync.safetensors"
    converted = run("convert", source, "-o", sync, "--json")
    assert converted.exit_code == 0, converted.output
    assert json.loads(converted.stdout)["check"]["mode"] == "bit-identical"

    plain = in_tmp / "plain.safetensors"
    reverted = run("convert", sync, "--to", "plain", "--model", source, "-o", plain, "--json")
    assert reverted.exit_code == 0, reverted.output
    to_classes = {c["path"]: c["to_class"] for c in json.loads(reverted.stdout)["changed"]}
    assert to_classes == {
        "bn": "torch.nn.modules.batchnorm.BatchNorm2d",
        "bn1d": "torch.nn.modules.batchnorm.BatchNorm1d",
    }
    import bnsurgeon
    from bnsurgeon.surgery.walk import class_map

    assert class_map(bnsurgeon.load(plain, model=source)) == to_classes  # replayed with the recorded classes


USER_RULES = """
import torch
from torch import nn

from bnsurgeon.rules import Rule, keep_if, to_frozen, to_sync


class MyBN(nn.BatchNorm2d):
    pass


RULES = [Rule("my-bn", (MyBN,), {"sync": to_sync, "plain": keep_if("plain"), "frozen": to_frozen})]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), MyBN(4))
"""


def test_rules_named_on_the_command_line_and_confirmed_again_on_load(in_tmp, monkeypatch):
    import bnsurgeon.rules as rules_module
    from bnsurgeon.files.reading import read_checkpoint
    from bnsurgeon.loading.recorded import read_recorded

    (in_tmp / "my_rules.py").write_text(USER_RULES)
    monkeypatch.syspath_prepend(str(in_tmp))
    monkeypatch.setattr(rules_module, "_named_specs", {})
    sync = in_tmp / "sync.safetensors"
    refused = run("convert", "my_rules:model", "-o", sync)
    assert refused.exit_code == 7 and "MyBN" in refused.output
    converted = run("convert", "my_rules:model", "--rules", "my_rules:RULES", "-o", sync)
    assert converted.exit_code == 0, converted.output
    assert read_recorded(read_checkpoint(sync)).rules == ["my_rules:RULES"]

    monkeypatch.setattr(rules_module, "_named_specs", {})  # a new process: nothing named yet
    plain = in_tmp / "plain.safetensors"
    unconfirmed = run("convert", sync, "--to", "plain", "--model", "my_rules:model", "-o", plain)
    assert unconfirmed.exit_code == 10 and "confirm with --rules my_rules:RULES" in unconfirmed.output
    assert not plain.exists()
    confirmed = run(
        "convert", sync, "--to", "plain", "--model", "my_rules:model", "--rules", "my_rules:RULES", "-o", plain
    )
    assert confirmed.exit_code == 0, confirmed.output
    bad = run("convert", "my_rules:model", "--rules", "my_rules", "-o", in_tmp / "x.safetensors")
    assert bad.exit_code == 2 and "package.module:object" in bad.output
