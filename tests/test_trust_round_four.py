"""Trust, round four (issue 38's leftovers): bad input is never an internal error (exit 70), a config.json
with a repeated key is refused, verify of a detector without weights compares where outputs are not empty,
recalibrate of a model directory writes a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_untrusted import one_line_failure
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1", **(env or {})})


SMALL = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))


def sparse_batches():
    return [torch.randn(2, 3, 8, 8).to_sparse()]


def nested_batches():
    return [(torch.nested.nested_tensor([torch.randn(3, 8, 8), torch.randn(3, 6, 6)]), 0)]
"""


@pytest.fixture
def small(tmp_path, monkeypatch):
    from _modules import install_module

    return install_module(tmp_path, monkeypatch, "small", SMALL)


# 1. bad input is a specific error, never "report it" (exit 70)


def odd_tensors():
    x = torch.randn(4, 3, 8, 8)
    return {
        "sparse": x.to_sparse(),
        "sparse-in-a-list": [x.to_sparse()],
        "csr": x[0, 0].to_sparse_csr(),
        "nested": torch.nested.nested_tensor([torch.randn(3, 8, 8), torch.randn(3, 6, 6)]),
        "meta": torch.empty(4, 3, 8, 8, device="meta"),
    }


@pytest.mark.parametrize("kind", list(odd_tensors()))
def test_data_of_sparse_nested_or_meta_tensors_is_refused_naming_the_kind(small, kind):
    torch.save(odd_tensors()[kind], small / "data.pt")
    result = run("recalibrate", "small:build", "--data", small / "data.pt", "-o", small / "out.safetensors")
    word = {"sparse-in-a-list": "sparse_coo", "sparse": "sparse_coo", "csr": "sparse_csr", "meta": "meta-device"}
    one_line_failure(result, 12, f"is a {word.get(kind, kind)} tensor", "dense")
    assert not (small / "out.safetensors").exists()


@pytest.mark.parametrize("function", ["sparse_batches", "nested_batches"])
def test_a_data_function_yielding_sparse_or_nested_tensors_is_refused(small, function):
    result = run("recalibrate", "small:build", "--data", f"small:{function}", "-o", small / "out.safetensors")
    one_line_failure(result, 12, f"batch 0 of --data small:{function}", "dense")
    assert not (small / "out.safetensors").exists()


LONG = "a" * 300


@pytest.mark.parametrize(
    "args, code, named",
    [
        (["inspect", LONG], 3, "SOURCE"),
        (["inspect", LONG + ".pt"], 3, "SOURCE"),
        (["convert", LONG, "-o", "out.safetensors"], 3, "SOURCE"),
        (["convert", "small:build", "-o", "out.safetensors", "--example-input", LONG + ".pt"], 2, "--example-input"),
        (["verify", "small:build", LONG + ".safetensors"], 3, "CONVERTED"),
        (["verify", "small:build", "small:build", "--example-input", LONG + ".pt"], 2, "--example-input"),
        (["recalibrate", "small:build", "--data", LONG, "-o", "out.safetensors"], 12, "--data"),
        (["recalibrate", LONG + ".safetensors", "--data", "x.pt", "-o", "out.safetensors"], 3, "SOURCE"),
    ],
)
def test_a_name_longer_than_the_filesystem_takes_is_named_not_a_crash(small, args, code, named):
    result = run(*args)
    one_line_failure(result, code, named, "cannot be used: File name too long")
    assert not (small / "out.safetensors").exists()


# 2. a config.json with a repeated key is refused, as bnsurgeon's own metadata is

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")


def tiny_resnet():
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return transformers.ResNetForImageClassification(config)


@pytest.fixture
def resnet_dir(tmp_path):
    directory = tmp_path / "resnet"
    tiny_resnet().save_pretrained(directory)
    return directory


def repeat_key(path: Path, key: str, value, inside: str | None = None) -> None:
    """Append ``"key": value`` to the object (or to its member ``inside``) as raw text: a second entry for a key."""
    text = path.read_text()
    entry = f'"{key}": {json.dumps(value)}'
    if inside is None:
        text = text.rstrip().rstrip("}") + f", {entry}}}"
    else:
        at = text.index(f'"{inside}"')
        at = text.index("{", at) + 1
        text = text[:at] + entry + ", " + text[at:]
    path.write_text(text)


@pytest.mark.parametrize("command", ["inspect", "convert", "recalibrate"])
@pytest.mark.parametrize("key, value, inside", [("hidden_sizes", [8, 16000], None), ("0", "LABEL_9", "id2label")])
def test_a_config_json_with_a_repeated_key_is_refused_naming_the_key(resnet_dir, tmp_path, command, key, value, inside):
    repeat_key(resnet_dir / "config.json", key, value, inside)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(4, 3, 32, 32), data)
    extra = {
        "inspect": [],
        "convert": ["-o", tmp_path / "out.safetensors"],
        "recalibrate": ["--data", data, "-o", tmp_path / "out.safetensors"],
    }[command]
    result = run(command, resnet_dir, *extra)
    one_line_failure(result, 4, "config.json repeats the key", repr(key), "keep one entry")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_shard_index_with_a_repeated_key_is_refused_naming_it(tmp_path):
    directory = tmp_path / "sharded"
    tiny_resnet().save_pretrained(directory, max_shard_size="4KB")
    index = directory / "model.safetensors.index.json"
    name = next(iter(json.loads(index.read_text())["weight_map"]))
    repeat_key(index, name, "model-00001-of-00002.safetensors", "weight_map")
    one_line_failure(run("inspect", directory), 4, "repeats the key", name)


def repeat_safetensors_entry(path: Path, dtype: str | None = None) -> str:
    """Rewrite a safetensors file's header with its first float32 tensor's entry given twice: the second with the
    same offsets and ``dtype`` (the same bytes read as another 4-byte dtype), or identical. Returns its name."""
    import struct

    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(key for key, entry in header.items() if key != "__metadata__" and entry["dtype"] == "F32")
    entry = dict(header[name], **({"dtype": dtype} if dtype else {}))
    text = json.dumps(header)
    text = text[:-1] + f", {json.dumps(name)}: {json.dumps(entry)}}}"
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    return name


@pytest.mark.parametrize("dtype", [None, "I32"], ids=["identical", "another-dtype"])
@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_safetensors_header_naming_a_tensor_twice_is_refused(small, tmp_path, command, dtype):
    """safetensors (and Python's json) keep the last of two entries for one name; other readers may keep the
    first. The file means different tensors to different tools, so it is refused, naming the tensor."""
    from safetensors.torch import save_file
    from small import build

    weights = tmp_path / "w.safetensors"
    save_file(build().state_dict(), str(weights))
    name = repeat_safetensors_entry(weights, dtype)
    out = tmp_path / "out.safetensors"
    extra = {"inspect": ["--model", "small:build"], "convert": ["--model", "small:build", "-o", out]}[command]
    one_line_failure(run(command, weights, *extra), 4, "names", repr(name), "twice", "re-export")
    assert not out.exists()


def test_a_model_directory_whose_weights_name_a_tensor_twice_is_refused(resnet_dir, tmp_path):
    name = repeat_safetensors_entry(resnet_dir / "model.safetensors")
    out = tmp_path / "out"
    one_line_failure(run("convert", resnet_dir, "-o", out), 4, repr(name), "twice")
    assert not out.exists()


# 3. verify of a detector whose outputs are empty compares where values exist, and says where

DETECTOR = """
import torch
from torch import nn


class Detector(nn.Module):
    '''Keeps the boxes scoring above a threshold untrained weights never reach: 0 boxes, as an untrained detector.'''

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        scores = self.head(self.backbone(x)).flatten(1)
        return [{"scores": s[s > 1e6]} for s in scores]


def build():
    torch.manual_seed(0)
    return Detector()
"""


@pytest.fixture
def detector(tmp_path, monkeypatch):
    from _modules import install_module

    install_module(tmp_path, monkeypatch, "detector", DETECTOR)
    converted = tmp_path / "detector.sync.safetensors"
    assert run("convert", "detector:build", "-o", converted).exit_code == 0
    return converted


def test_verify_of_a_detector_with_empty_outputs_compares_at_the_deepest_module_with_values(detector):
    result = run("verify", "detector:build", detector, "--converted-model", "detector:build", "--json", "-q")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["compare_at"] == "head"
    assert "outputs are empty" in data["compare_at_why"] and "compared at head" in data["compare_at_why"]
    assert [check["passed"] for check in data["checks"]] == [True] * 6
    assert all(check["values"] > 0 for check in data["checks"])


def test_verify_says_where_it_compared_in_its_human_output(detector):
    result = run("verify", "detector:build", detector, "--converted-model", "detector:build", "--no-perturb", "-w", 2)
    assert result.exit_code == 0, result.output
    assert "compared at head, the deepest module whose outputs hold values" in " ".join(result.output.split())


def test_verify_json_counts_the_values_each_check_compared(small):
    converted = small / "small.sync.safetensors"
    assert run("convert", "small:build", "-o", converted).exit_code == 0
    result = run("verify", "small:build", converted, "--converted-model", "small:build", "--json", "-q", "--no-perturb")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    by_name = {check["name"]: check["values"] for check in data["checks"]}
    assert by_name["eval"] == 2 * 4 * 62 * 62  # the output of (2, 3, 64, 64): every value
    assert by_name["train, one process"] == 2 * 4 * 62 * 62 + 4 * 4  # and the running statistics
    assert by_name["2 ranks"] > by_name["eval"]  # outputs, input and parameter gradients, statistics
    assert data["compare_at"] is None and data["compare_at_why"] is None


def test_a_named_compare_at_is_kept_and_not_explained(detector):
    result = run(
        "verify",
        "detector:build",
        detector,
        "--converted-model",
        "detector:build",
        "--json",
        "-q",
        "--no-perturb",
        "--compare-at",
        "backbone",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["compare_at"] == "backbone" and data["compare_at_why"] is None


@pytest.mark.parametrize(
    "build, expected",
    [
        ("fasterrcnn_mobilenet_v3_large_320_fpn", "rpn.head"),
        ("retinanet_resnet50_fpn", "head"),
    ],
)
def test_torchvision_detectors_without_weights_are_compared_where_values_exist(build, expected):
    torchvision = pytest.importorskip("torchvision")
    from bnsurgeon.checks.check_input import CheckInput
    from bnsurgeon.checks.verify import only_bn_trains, where_outputs_exist

    torch.manual_seed(0)
    model = getattr(torchvision.models.detection, build)(
        weights=None, weights_backbone=None, min_size=64, max_size=64
    ).eval()
    images = CheckInput("list", ((3, 64, 64), (3, 64, 64)))
    with torch.no_grad():
        assert not any(len(image["boxes"]) for image in model([torch.rand(3, 64, 64)] * 2))  # 0 boxes: vacuous
    import copy

    assert where_outputs_exist([model, only_bn_trains(copy.deepcopy(model))], images) == expected


# 4. recalibrate of a model directory writes a model directory; image folders use the model's own preprocessing


@pytest.fixture
def pixels(tmp_path):
    path = tmp_path / "data.pt"
    torch.save(torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), path)
    return path


def stats(state: dict) -> dict:
    return {key: value for key, value in state.items() if key.endswith(("running_mean", "running_var"))}


def test_recalibrate_of_a_model_directory_writes_a_directory_from_pretrained_loads(resnet_dir, pixels, tmp_path):
    from safetensors.torch import load_file

    before = load_file(resnet_dir / "model.safetensors")
    out = tmp_path / "recalibrated"
    result = run("recalibrate", resnet_dir, "--data", pixels, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in " ".join(result.output.split())
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    written = load_file(out / "model.safetensors")
    model, info = transformers.ResNetForImageClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in stats(written).items())
    assert any(not torch.equal(before[key], value) for key, value in stats(written).items())  # recalibrated
    assert load_file(resnet_dir / "model.safetensors").keys() == before.keys()  # the source is untouched


def test_recalibrate_of_a_directory_bnsurgeon_converted_stays_converted(resnet_dir, pixels, tmp_path):
    import bnsurgeon
    from bnsurgeon.runtime import SyncBatchNorm

    converted = tmp_path / "converted"
    assert run("convert", resnet_dir, "-o", converted).exit_code == 0
    out = tmp_path / "recalibrated"
    result = run("recalibrate", converted, "--data", pixels, "-o", out)
    assert result.exit_code == 0, result.output
    model = bnsurgeon.load(out)
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == 8


def test_recalibrate_of_a_timm_model_to_a_directory_is_refused(small, pixels):
    result = run("recalibrate", "small:build", "--data", pixels, "-o", small / "outdir")
    one_line_failure(result, 2, "names a directory", "write a file instead")
    assert not (small / "outdir").exists()


@pytest.fixture
def images(tmp_path):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for index in range(3):
        array = (torch.rand(40, 50, 3, generator=torch.Generator().manual_seed(index)) * 255).to(torch.uint8)
        Image.fromarray(array.numpy()).save(folder / f"{index}.png")
    return folder


def test_an_image_folder_is_read_with_the_model_directorys_own_preprocessor(resnet_dir, images, tmp_path):
    from PIL import Image
    from safetensors.torch import load_file

    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(resnet_dir)
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "from_images", "--json")
    assert result.exit_code == 0, result.output
    assert "images read with ViTImageProcessor" in result.output
    assert (tmp_path / "from_images" / "preprocessor_config.json").read_text() == (
        resnet_dir / "preprocessor_config.json"
    ).read_text()
    processor = transformers.AutoImageProcessor.from_pretrained(resnet_dir, local_files_only=True)
    pixels = processor(images=[Image.open(p).convert("RGB") for p in sorted(images.iterdir())], return_tensors="pt")[
        "pixel_values"
    ]
    torch.save(pixels, tmp_path / "pixels.pt")
    assert (
        run("recalibrate", resnet_dir, "--data", tmp_path / "pixels.pt", "-o", tmp_path / "from_pixels").exit_code == 0
    )
    ours, theirs = (
        load_file(tmp_path / "from_images" / "model.safetensors"),
        load_file(tmp_path / "from_pixels" / "model.safetensors"),
    )
    assert all(torch.equal(ours[key], theirs[key]) for key in stats(ours))


def test_an_image_folder_for_a_directory_without_a_preprocessor_says_what_was_used(resnet_dir, images, tmp_path):
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "images read with timm's data config of the model" in flat and "has no preprocessor_config.json" in flat


def test_a_preprocessor_config_asking_for_remote_code_is_refused(resnet_dir, images, tmp_path):
    (resnet_dir / "preprocessor_config.json").write_text(json.dumps({"auto_map": {"AutoImageProcessor": "x.Y"}}))
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 10, "preprocessor_config.json asks for remote code")
    assert not (tmp_path / "out").exists()
