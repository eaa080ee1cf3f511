"""Trust, round three (issue 38): model directories as SOURCE, recalibrate's DATA and outputs, environment
variables. Tiny transformers models built from their config classes, nothing downloaded."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

from test_untrusted import one_line_failure  # noqa: E402

from bnsurgeon.cli.commands import app  # noqa: E402

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1", **(env or {})})


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def tiny_resnet(**overrides):
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, **overrides)
    return transformers.ResNetForImageClassification(config)


@pytest.fixture
def resnet_dir(tmp_path):
    directory = tmp_path / "resnet"
    tiny_resnet().save_pretrained(directory)
    return directory


@pytest.fixture
def sharded_dir(tmp_path):
    directory = tmp_path / "sharded"
    tiny_resnet().save_pretrained(directory, max_shard_size="4KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


@pytest.fixture
def pixels(tmp_path):
    path = tmp_path / "data.pt"
    torch.save(torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), path)
    return path


# 1. no file a SOURCE reads is ever an output, --force or not


@pytest.mark.parametrize("as_source", ["directory", "config"])
@pytest.mark.parametrize("command", ["convert", "recalibrate"])
def test_an_output_over_a_model_directorys_weights_is_refused_even_with_force(resnet_dir, pixels, as_source, command):
    before = digests(resnet_dir)
    source = resnet_dir if as_source == "directory" else resnet_dir / "config.json"
    extra = ["--no-check"] if command == "convert" else ["--data", pixels]
    result = run(command, source, "-o", resnet_dir / "model.safetensors", "--force", *extra)
    one_line_failure(result, 8, "model.safetensors", "never overwrites an input")
    assert digests(resnet_dir) == before


@pytest.mark.parametrize("target", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
def test_an_output_over_one_shard_of_a_sharded_source_is_refused(sharded_dir, pixels, target):
    before = digests(sharded_dir)
    result = run("recalibrate", sharded_dir, "--data", pixels, "-o", sharded_dir / target, "--force")
    one_line_failure(result, 8, target, "never overwrites an input")
    assert digests(sharded_dir) == before


def test_a_hard_link_to_a_sources_weights_is_an_input_too(resnet_dir, tmp_path):
    link = tmp_path / "linked.safetensors"
    os.link(resnet_dir / "model.safetensors", link)
    before = digests(resnet_dir)
    result = run("convert", resnet_dir, "-o", link, "--force", "--no-check")
    one_line_failure(result, 8, "never overwrites an input")
    assert digests(resnet_dir) == before


SMALL = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
"""


@pytest.fixture
def small(tmp_path, monkeypatch):
    from _modules import install_module

    return install_module(tmp_path, monkeypatch, "small", SMALL)


def test_an_output_over_a_data_folders_file_is_refused(small):
    folder = small / "batches"
    folder.mkdir()
    for index in range(2):
        torch.save(torch.randn(2, 3, 8, 8), folder / f"{index}.pt")
    before = digests(folder)
    result = run("recalibrate", "small:build", "--data", folder, "-o", folder / "1.pt", "--force")
    one_line_failure(result, 8, "1.pt", "never overwrites an input")
    assert digests(folder) == before


# 3. statistics the file's dtype cannot hold are refused, naming the layer


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 1000.0), (torch.float32, 1e20)])
def test_statistics_a_half_precision_file_cannot_hold_are_refused_naming_the_layer(small, dtype, scale):
    import small as module
    from safetensors.torch import save_file

    source = small / "half.safetensors"
    save_file(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in module.build().state_dict().items()}, str(source)
    )
    torch.save(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * scale, small / "pixels.pt")
    before = digests(small)
    result = run(
        "recalibrate", source, "--model", "small:build", "--data", small / "pixels.pt", "-o", small / "out.safetensors"
    )
    one_line_failure(result, 14, "running_var of 1", str(dtype)[6:])
    assert digests(small) == before


def test_the_library_refuses_statistics_a_float16_model_cannot_hold_and_keeps_its_buffers(small):
    import small as module

    import bnsurgeon

    model = module.build().half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)).half() * 1000
    from bnsurgeon.core.errors import StatisticsOverflowError

    with pytest.raises(StatisticsOverflowError, match="running_var of 1"):
        bnsurgeon.recalibrate(model, data)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# 4. --weights state_dict_ema changes only the chosen entry, whatever tensors it shares


@pytest.mark.parametrize("sharing", ["same-dict", "aliased-buffers"])
def test_recalibrating_one_entry_leaves_an_entry_sharing_its_tensors_as_it_was(small, sharing):
    import small as module

    state = module.build().state_dict()
    ema = (
        state
        if sharing == "same-dict"
        else {k: (v if k.endswith(("running_mean", "running_var")) else v.clone()) for k, v in state.items()}
    )
    source = small / "train.pth.tar"
    torch.save({"state_dict": state, "state_dict_ema": ema, "epoch": 1}, source)
    raw = {k: v.clone() for k, v in state.items()}
    torch.save(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 + 1, small / "pixels.pt")
    out = small / "out.pth.tar"
    result = run(
        "recalibrate",
        source,
        "--model",
        "small:build",
        "--weights",
        "state_dict_ema",
        "--data",
        small / "pixels.pt",
        "-o",
        out,
    )
    assert result.exit_code == 0, result.output
    written = torch.load(out, weights_only=True)
    for key, value in raw.items():
        assert torch.equal(written["state_dict"][key], value), key
    assert not torch.equal(written["state_dict_ema"]["1.running_var"], raw["1.running_var"])


# 10. every environment variable bnsurgeon reads: a bad value is exit 2 naming it


@pytest.mark.parametrize(
    "env,name",
    [
        ({"BNSURGEON_MAX_BATCH_BYTES": "abc"}, "BNSURGEON_MAX_BATCH_BYTES"),
        ({"BNSURGEON_MAX_BATCH_BYTES": "-1"}, "BNSURGEON_MAX_BATCH_BYTES"),
        ({"BNSURGEON_MAX_BATCH_BYTES": "1.5e9"}, "BNSURGEON_MAX_BATCH_BYTES"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-3"}, "LOCAL_RANK"),
    ],
)
def test_a_bad_environment_variable_is_exit_2_naming_it_and_nothing_is_written(small, env, name):
    torch.save(torch.randn(4, 3, 8, 8), small / "pixels.pt")
    before = digests(small)
    result = run("recalibrate", "small:build", "--data", small / "pixels.pt", "-o", small / "out.safetensors", env=env)
    one_line_failure(result, 2, f"{name}=", "whole number")
    assert digests(small) == before


def test_a_valid_batch_bytes_variable_still_bounds_each_batch(small):
    torch.save(torch.randn(4, 3, 8, 8), small / "pixels.pt")
    result = run(
        "recalibrate",
        "small:build",
        "--data",
        small / "pixels.pt",
        "-o",
        small / "out.safetensors",
        env={"BNSURGEON_MAX_BATCH_BYTES": "1000"},
    )
    one_line_failure(result, 12, "more than 1,000 bytes (BNSURGEON_MAX_BATCH_BYTES)")


# 8. a named pipe in DATA is refused, never read (it would block forever)


@pytest.mark.parametrize("where", ["file", "tensor-folder", "image-folder"])
def test_a_named_pipe_in_data_is_refused_without_blocking(small, where):
    if where == "file":
        data = pipe = small / "pixels.pt"
    else:
        data = small / "folder"
        data.mkdir()
        if where == "tensor-folder":
            torch.save(torch.randn(2, 3, 8, 8), data / "0.pt")
            pipe = data / "1.pt"
        else:
            from PIL import Image

            Image.new("RGB", (8, 8)).save(data / "0.png")
            pipe = data / "1.png"
    os.mkfifo(pipe)
    result = run("recalibrate", "small:build", "--data", data, "-o", small / "out.safetensors")
    one_line_failure(result, 12, f"{pipe.name} is not a regular file")
    assert not (small / "out.safetensors").exists()


# 11. messages that say what happened


@pytest.mark.parametrize("named", ["config.json", "model.safetensors.index.json"])
def test_a_shard_index_naming_a_file_that_is_not_weights_says_so_not_pickle(sharded_dir, named):
    index_path = sharded_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = named
    index_path.write_text(json.dumps(index))
    result = run("convert", sharded_dir, "-o", sharded_dir.parent / "out.safetensors", "--no-check")
    one_line_failure(result, 4, f"names '{named}', which is not a .safetensors weights file")
    assert "pickle" not in result.output


def test_counts_are_in_the_right_number():
    from bnsurgeon.core.layout import counted

    assert [counted(1, "batch"), counted(10, "batch"), counted(2, "tensor"), counted(3, "box")] == [
        "1 batch",
        "10 batches",
        "2 tensors",
        "3 boxes",
    ]


def test_recalibrates_summary_says_one_batch_not_one_batches(small):
    torch.save(torch.randn(4, 3, 8, 8), small / "pixels.pt")
    result = run("recalibrate", "small:build", "--data", small / "pixels.pt", "-o", small / "out.safetensors")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "on 4 samples (1 batch, 1 rank," in flat and "2 BN modules" in flat


# 2. a model directory's weights load as stored, whatever config.json's dtype says, or are refused


def stored_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (directory / "model.safetensors").exists():
        return load_file(directory / "model.safetensors")
    return torch.load(directory / "pytorch_model.bin", weights_only=True)


def with_bfloat16_config(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layout", ["two-float-dtypes", "pytorch_model.bin"])
def test_config_dtype_never_rounds_the_stored_weights(tmp_path, layout):
    directory = tmp_path / "resnet"
    model = tiny_resnet()
    if layout == "pytorch_model.bin":
        model.save_pretrained(directory, safe_serialization=False)
    else:
        model.save_pretrained(directory)
        from safetensors.torch import load_file, save_file

        tensors = load_file(directory / "model.safetensors")
        key = next(k for k in tensors if k.endswith("running_var"))
        tensors[key] = tensors[key].double()  # float32 values, stored as float64: nothing is lost either way
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with_bfloat16_config(directory)
    stored = stored_weights(directory)
    out = tmp_path / "out.safetensors"
    result = run("convert", directory, "-o", out, "--to", "plain")
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    written = load_file(out)
    for key, value in stored.items():
        if value.is_floating_point():
            assert torch.equal(written[key].double(), value.double()), key


def test_a_tensor_that_the_other_weights_dtype_would_round_is_refused(tmp_path):
    directory = tmp_path / "resnet"
    tiny_resnet().save_pretrained(directory)
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    key = next(k for k in tensors if k.endswith("running_var"))
    tensors[key] = tensors[key].double() + 1e-12  # float64 values float32 cannot hold
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    result = run("convert", directory, "-o", tmp_path / "out.safetensors")
    one_line_failure(result, 6, key, "float64 -> float32")
    assert not (tmp_path / "out.safetensors").exists()


# 9. inspect DIR checks that the weights fit, as convert does


@pytest.mark.parametrize("edit", ["missing", "shape", "unexpected"])
def test_inspect_refuses_a_directory_whose_weights_do_not_fit_as_convert_does(resnet_dir, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(resnet_dir / "model.safetensors")
    key = "classifier.1.weight"
    if edit == "missing":
        del tensors[key]
    elif edit == "shape":
        tensors[key] = torch.zeros(5, tensors[key].shape[1])
    else:
        tensors["extra.weight"] = torch.zeros(3)
    save_file(tensors, resnet_dir / "model.safetensors", metadata={"format": "pt"})
    named = "extra.weight" if edit == "unexpected" else key
    one_line_failure(run("inspect", resnet_dir), 6, named)
    one_line_failure(run("convert", resnet_dir, "-o", resnet_dir.parent / "out.safetensors"), 6, named)


def test_inspect_of_a_directory_whose_weights_fit_lists_its_bn(resnet_dir, sharded_dir):
    for directory in (resnet_dir, sharded_dir):
        result = run("inspect", directory)
        assert result.exit_code == 0, result.output
        assert "BatchNorm2d" in result.output


# round two, still open: an --example-input goes through the same bounds as every file bnsurgeon reads


def test_an_example_input_whose_pickle_record_inflates_is_refused_before_it_is_read(small, monkeypatch):
    import zipfile

    stored = small / "stored.pt"
    torch.save({"x": torch.zeros(1, 3, 8, 8), "pad": "a" * (8 << 20)}, stored)  # an 8 MiB pickle record
    bomb = small / "x.pt"
    with zipfile.ZipFile(stored) as src, zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    assert bomb.stat().st_size < 200_000
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("the records were read"))
    result = run("convert", "small:build", "--example-input", bomb, "-o", small / "out.safetensors")
    one_line_failure(result, 2, "--example-input", "compressed record", "expands")
    assert not (small / "out.safetensors").exists()


# 6. what a config.json can make bnsurgeon build is bounded before it is built


def edit_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def test_labels_are_bounded_in_every_nested_config(tmp_path):
    directory = tmp_path / "upernet"
    from test_transformers import hooked_family

    hooked_family("upernet").save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["backbone_config"]["num_labels"] = 2_000_000
    (directory / "config.json").write_text(json.dumps(config))
    for command in (["inspect", directory], ["convert", directory, "-o", tmp_path / "out.safetensors"]):
        one_line_failure(run(*command), 4, "2000000 labels in backbone_config", "at most 100,000")


@pytest.mark.parametrize(
    "depths,phrase",
    [([3000, 1], "3,001 layers in all (at most 2,000)"), ([200, 1], "more than its weights files hold tensors")],
)
def test_layers_are_bounded_before_the_model_is_built(resnet_dir, monkeypatch, depths, phrase):
    edit_config(resnet_dir, depths=depths)
    monkeypatch.setattr(
        transformers.ResNetForImageClassification, "__init__", lambda *a, **k: pytest.fail("the model was built")
    )
    one_line_failure(run("inspect", resnet_dir), 4, phrase)


# 7. a directory SOURCE is local files only: no network, whatever its config says


@pytest.mark.parametrize("edit", ["hub-backbone", "pretrained-timm-backbone"])
def test_a_config_cannot_make_bnsurgeon_contact_the_hub(tmp_path, monkeypatch, edit):
    import socket

    import huggingface_hub.constants
    from test_transformers import detr_dir

    directory = detr_dir.__wrapped__(tmp_path_factory=type("F", (), {"mktemp": lambda self, name: tmp_path})())
    config = json.loads((directory / "config.json").read_text())
    if edit == "hub-backbone":
        config.update(
            backbone_config=None,
            use_timm_backbone=False,
            backbone="someone/some-backbone",
            use_pretrained_backbone=True,
        )
    else:
        config["backbone_config"] = {
            "model_type": "timm_backbone",
            "backbone": "test_resnet",
            "features_only": True,
            "use_pretrained_backbone": True,
            "out_indices": [4],
            "num_channels": 3,
        }
    (directory / "config.json").write_text(json.dumps(config))
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    result = run("inspect", directory)
    assert attempts == []
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 4, 6), result.output


def test_a_recorded_config_with_integer_keys_is_bounded_without_error():
    from bnsurgeon.loading.transformers_source import check_config, layer_count

    config = tiny_resnet().config.to_dict()  # id2label has int keys in memory
    config["architectures"] = ["ResNetForImageClassification"]
    check_config(config, "the recorded config")
    assert layer_count(config) == 2


# 5. the Trainer callback syncs the model that trains, however it was added


@pytest.mark.parametrize("how", ["add_callback", "model_init"])
def test_the_trainer_callback_syncs_the_model_that_trains(tmp_path, how):
    from _transformers_cases import Net, dataset
    from transformers import Trainer, TrainingArguments

    from bnsurgeon.integrations.transformers import BNSurgeonCallback
    from bnsurgeon.runtime import SyncBatchNorm

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callback = BNSurgeonCallback()
    if how == "add_callback":
        trainer = Trainer(model=Net(), args=args, train_dataset=dataset())
        trainer.add_callback(callback)
    else:
        trainer = Trainer(model_init=Net, args=args, train_dataset=dataset(), callbacks=[callback])
    trainer.train()
    kinds = {type(m) for m in trainer.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    assert kinds == {SyncBatchNorm}, kinds
    assert callback.converted >= 1
