"""Trust, round five (issue 47, findings 3, 4 and 7): image preprocessing is bounded before anything is decoded
or made, images of every kind are read one way or refused in one line, a preprocessor_config.json is checked
field by field before any image is read, and every JSON document bnsurgeon writes is strict JSON.

Images are tiny; a size that would take gigabytes is only ever declared (a config's size, a PNG header), never
made: where the old code would have decoded and resized, Pillow's decoder is replaced by one that fails the test,
so a test shows that nothing was decoded without allocating what the old code would have."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from test_untrusted import one_line_failure
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1", **(env or {})})


def strict_json(text: str):
    """``text`` read as strict JSON: Infinity and NaN, which Python's reader takes, are refused as jq refuses them."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def no_decoding(monkeypatch):
    """Pillow's decoder fails the test: whatever is refused with this in place was refused before it was decoded."""
    from PIL import ImageFile

    def decoded(self, *args, **kwargs):
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)


def save_images(folder: Path, count: int = 4, size: tuple[int, int] = (48, 40)) -> Path:
    from PIL import Image

    folder.mkdir(exist_ok=True)
    for index in range(count):
        pixels = (torch.rand(size[1], size[0], 3, generator=torch.Generator().manual_seed(index)) * 255).to(torch.uint8)
        Image.fromarray(pixels.numpy()).save(folder / f"{index:02d}.png")
    return folder


def png_declaring(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares ``width`` x ``height`` pixels (its data is one row of one pixel): Pillow learns the
    size from the header alone, so only a reader that decodes before checking would try to make it."""
    from PIL import Image

    Image.new("RGB", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(header))
    path.write_bytes(bytes(data))
    return path


# a timm-path model (no preprocessor_config.json): timm's data config of the model decides the preprocessing

SMALL = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
"""


@pytest.fixture
def small(tmp_path, monkeypatch):
    from _modules import install_module

    return install_module(tmp_path, monkeypatch, "small", SMALL)


# finding 4: every JSON document written is strict JSON, non-finite floats as strings, through one writer


def test_json_output_writes_non_finite_numbers_as_strings_that_strict_readers_take(capsys):
    from bnsurgeon.cli.render import emit_json

    emit_json({"max_abs_diff": float("inf"), "checks": [{"low": float("-inf"), "diff": float("nan")}], "ok": 1.5})
    document = strict_json(capsys.readouterr().out)
    assert document == {"max_abs_diff": "Infinity", "checks": [{"low": "-Infinity", "diff": "NaN"}], "ok": 1.5}
    assert float(document["max_abs_diff"]) == float("inf")  # the documented strings read back as the number


def test_numpy_numbers_are_written_as_numbers_and_their_infinities_by_the_convention(capsys):
    """A numpy float32 is no Python float: it went to str() ("inf", "1.5"), neither a number nor the convention."""
    import numpy as np

    from bnsurgeon.cli.render import emit_json

    emit_json({"diff": np.float32("inf"), "mean": np.float32(1.5), "count": np.int64(3)})
    assert strict_json(capsys.readouterr().out) == {"diff": "Infinity", "mean": 1.5, "count": 3}


def test_a_file_name_that_is_not_utf8_is_written_as_well_formed_unicode(small, tmp_path):
    """A name's undecodable byte is a lone surrogate in Python (U+DCFF); written as a \\udcff escape, serde and
    jiter refused the whole document and jq replaced it. It is written as the byte escaped, in --json, the
    report and the checkpoint's metadata."""
    import os

    from safetensors import safe_open

    from bnsurgeon.core.json_text import well_formed

    assert well_formed("a\udcffb") == "a\\xffb" and well_formed("plain é") == "plain é"
    name = os.fsdecode(b"src\xff.pt")
    torch.save(__import__("small").build().state_dict(), tmp_path / name)
    output = tmp_path / "out.safetensors"
    result = run(
        "convert", tmp_path / name, "--model", "small:build", "-o", output, "--json", "--input-shape", "2,3,8,8"
    )
    assert result.exit_code == 0, result.output
    documents = [result.stdout, (tmp_path / "out.safetensors.report.json").read_text(encoding="utf-8")]
    with safe_open(str(output), "pt") as opened:
        documents += [v for k, v in opened.metadata().items() if k.startswith("bnsurgeon.")]
    for text in documents:
        assert "\\udc" not in text.lower(), text[:300]
        strict_json(text) if text.lstrip().startswith(("{", "[")) else None
    assert any("src\\\\xff.pt" in text for text in documents), documents[0][:300]


def test_the_convert_report_is_strict_json_when_a_check_saw_infinity():
    from bnsurgeon.surgery.report import CheckResult, Report

    report = Report(source="x", target="sync", output=None)
    report.check = CheckResult(passed=False, mode="close", max_abs_diff=float("inf"), input_shape=[1], seed=0)
    assert strict_json(report.to_json())["check"]["max_abs_diff"] == "Infinity"


def test_the_recalibrate_report_is_strict_json_when_a_value_is_not_finite():
    from bnsurgeon.calibration.recalibrate import RecalibrationReport

    report = RecalibrationReport(seconds=float("nan"))
    assert strict_json(report.to_json())["seconds"] == "NaN"


def test_no_json_document_is_written_but_through_the_strict_writer():
    """Every json.dumps/json.dump in bnsurgeon passes allow_nan=False (the one writer, bnsurgeon.core.json_text.dumps,
    does, after writing non-finite floats as strings): any other could write Infinity."""
    import ast

    import bnsurgeon

    package = Path(bnsurgeon.__file__).parent
    loose = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("dump", "dumps")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "json"
                and not any(
                    k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                )
            ):
                loose.append(f"{path.relative_to(package)}:{node.lineno}")
    assert loose == []


# finding 7: a preprocessor_config.json's fields are checked before any image is read, and named

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")


@pytest.fixture
def resnet_dir(tmp_path):
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    directory = tmp_path / "resnet"
    transformers.ResNetForImageClassification(config).save_pretrained(directory)
    return directory


@pytest.fixture
def images(tmp_path):
    return save_images(tmp_path / "imgs")


def preprocessor(directory: Path, **fields) -> Path:
    path = directory / "preprocessor_config.json"
    path.write_text(json.dumps({"image_processor_type": "ViTImageProcessor", **fields}))
    return path


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"size": 0}, "size is 0"),
        ({"size": -5}, "size is -5"),
        ({"size": {"height": 0, "width": 32}}, "size is {'height': 0, 'width': 32}"),
        ({"crop_pct": -1}, "crop_pct is -1"),
        ({"image_mean": [0.5, 0.5]}, "image_mean is [0.5, 0.5]"),
        ({"image_mean": "abc"}, "image_mean is 'abc'"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std is [0.5, 0, 0.5]"),
        ({"rescale_factor": -1}, "rescale_factor is -1"),
        ({"do_resize": "yes"}, "do_resize is 'yes'"),
        # valid numbers whose preprocessed pixels no statistic holds: was exit 14, blamed on the data
        ({"rescale_factor": 1e308}, "rescale_factor is 1e+308"),
        ({"image_std": [5e-324, 5e-324, 5e-324]}, "image_std is [5e-324, 5e-324, 5e-324]"),
    ],
)
def test_a_bad_preprocessor_field_is_named_with_its_file_not_blamed_on_an_image(
    resnet_dir, images, tmp_path, no_decoding, fields, named
):
    preprocessor(resnet_dir, **fields)
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 4, f"{resnet_dir / 'preprocessor_config.json'}: {named}", "fix ")
    assert "00.png" not in result.output and not (tmp_path / "out").exists()


def test_a_preprocessor_config_holding_nan_is_refused(resnet_dir, images, tmp_path):
    (resnet_dir / "preprocessor_config.json").write_text(
        '{"image_processor_type": "ViTImageProcessor", "image_mean": NaN}'
    )
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 4, "preprocessor_config.json holds NaN, which is not a JSON value")


def test_a_deeply_nested_preprocessor_config_is_refused_before_it_is_parsed(resnet_dir, images, tmp_path):
    nested = "[" * 60 + "]" * 60  # far inside Python's recursion limit: only a bound on nesting refuses it
    (resnet_dir / "preprocessor_config.json").write_text(
        f'{{"image_processor_type": "ViTImageProcessor", "x": {nested}}}'
    )
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 4, "preprocessor_config.json nests 61 levels deep", "it was not parsed")


def test_a_preprocessor_config_that_is_a_link_to_a_device_is_refused_not_ignored(resnet_dir, images, tmp_path):
    (resnet_dir / "preprocessor_config.json").symlink_to("/dev/zero")
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 4, "preprocessor_config.json is not a regular file")


# finding 3: what the preprocessing makes is bounded before it is made


def test_a_preprocessor_size_too_large_for_one_image_is_refused_before_decoding(
    resnet_dir, images, tmp_path, no_decoding
):
    preprocessor(resnet_dir, size={"height": 20000, "width": 20000})
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(
        result,
        12,
        "into 3 x 20,000 x 20,000 float32 (4,577.6 MiB)",
        "BNSURGEON_MAX_BATCH_BYTES",
        "nothing was decoded",
        f"check the sizes in {resnet_dir / 'preprocessor_config.json'}",
    )


def test_a_crop_pct_of_the_smallest_float_is_refused_as_too_large_not_a_crash(
    resnet_dir, images, tmp_path, no_decoding
):
    """32 / 5e-324 is no float: the plan is worked out in whole numbers (it was an OverflowError, exit 70).
    ConvNeXt crops what it resized to 32 x 32; the resize itself is past what bnsurgeon works out, said as such."""
    preprocessor(resnet_dir, image_processor_type="ConvNextImageProcessor", size={"shortest_edge": 32}, crop_pct=5e-324)
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 12, "would take over ", "into 3 x 32 x 32 float32", "nothing was decoded")
    preprocessor(resnet_dir, size={"shortest_edge": 32}, crop_pct=5e-324)  # a processor that keeps the resize
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(
        result, 12, "into up to 3 x over 1,099,511,627,775 x over 1,099,511,627,775", "nothing was decoded"
    )


def test_a_batch_is_bounded_before_its_first_image_is_decoded(resnet_dir, images, tmp_path, no_decoding):
    preprocessor(resnet_dir, size={"height": 64, "width": 64})  # 49,152 bytes an image, 196,608 a batch of 4
    result = run(
        "recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out", env={"BNSURGEON_MAX_BATCH_BYTES": "150000"}
    )
    one_line_failure(result, 12, "a batch of 4 images", "196,608 bytes", "nothing was decoded", "--batch-size 3")


def test_a_thin_image_under_timms_preprocessing_is_refused_before_decoding(small, no_decoding):
    """timm resizes the shortest side to 256 keeping the ratio: a 20,000 x 1 image would become 256 x 5,120,000."""
    folder = save_images(small / "thin", count=1, size=(20000, 1))
    result = run("recalibrate", "small:build", "--data", folder, "-o", small / "out.safetensors")
    one_line_failure(result, 12, "00.png (20,000 x 1 pixels)", "timm's data config of the model", "nothing was decoded")


@pytest.mark.parametrize("pillow_limit", ["default", "switched off"])
def test_a_decompression_bomb_is_refused_before_decoding(small, no_decoding, monkeypatch, pillow_limit):
    """10,000 x 9,000 pixels: past Pillow's limit (89 million) but under twice it, where Pillow only warns; and
    bnsurgeon's limit holds where another library switched Pillow's off."""
    from PIL import Image

    if pillow_limit == "switched off":
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    folder = small / "bomb"
    folder.mkdir()
    png_declaring(folder / "bomb.png", 10000, 9000)
    result = run("recalibrate", "small:build", "--data", folder, "-o", small / "out.safetensors")
    one_line_failure(result, 12, "bomb.png", "decompression bomb", "not decoded")


def test_images_whose_outputs_differ_in_size_are_refused_in_one_line(resnet_dir, tmp_path):
    """Without a crop, a shortest-edge resize keeps each image's ratio: a batch cannot hold two sizes (was exit 70)."""
    preprocessor(
        resnet_dir, image_processor_type="CLIPImageProcessor", size={"shortest_edge": 16}, do_center_crop=False
    )
    folder = save_images(tmp_path / "mixed", count=1, size=(48, 40))
    save_images(tmp_path / "other", count=1, size=(80, 40))
    (tmp_path / "other" / "00.png").rename(folder / "01.png")
    result = run("recalibrate", resnet_dir, "--data", folder, "-o", tmp_path / "out")
    one_line_failure(result, 12, "00.png into 3 x 16 x 19", "01.png into 3 x 16 x 32", "must come out the same size")


@pytest.mark.parametrize(
    "fields, exact",
    [
        ({"size": {"height": 12, "width": 20}}, True),
        ({"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 12}, "crop_pct": 0.875}, True),
        ({"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 400}}, True),
        (
            {
                "image_processor_type": "ConvNextImageProcessor",
                "size": {"shortest_edge": 12},
                "do_center_crop": True,
                "crop_size": {"height": 8, "width": 6},
            },
            True,
        ),
        (
            {
                "image_processor_type": "CLIPImageProcessor",
                "size": {"shortest_edge": 14},
                "crop_size": {"height": 10, "width": 10},
            },
            True,
        ),
        ({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 9}, "do_center_crop": False}, False),
        ({"do_resize": False}, True),
    ],
    ids=[
        "exact",
        "convnext-crop-pct",
        "convnext-warp",
        "convnext-crop-size",
        "clip-crop",
        "shortest-edge",
        "no-resize",
    ],
)
@pytest.mark.parametrize("size", [(48, 40), (17, 300), (300, 17)])
def test_what_a_processor_makes_is_never_more_than_bnsurgeon_foresaw(tmp_path, fields, exact, size):
    """The plan is an upper bound of each real processor's output (else the image is refused after it is made),
    and a message names the output exactly where the plan knows it, else as a bound ("up to"). ConvNeXt crops
    inside its resize below 384 and squashes from 384: before, its plan kept the ratio and found no crop, and a
    message named 3 x 258 x 387 for its 3 x 224 x 224."""
    from bnsurgeon.loading.data import image_transform

    directory = tmp_path / "processor"
    directory.mkdir()
    preprocessor(directory, **fields)
    transform, _, plan = image_transform(None, directory)
    folder = save_images(tmp_path / "one", count=1, size=size)
    batch, _ = first_batch(folder, directory)
    (mid_h, mid_w), (out_h, out_w) = plan.sizes(size[1], size[0])
    assert batch.shape[2] <= out_h and batch.shape[3] <= out_w and out_h <= mid_h and out_w <= mid_w
    made = tuple(batch.shape[1:])
    if exact:
        assert plan.exact_output(size[1], size[0]) == made[1:]
        assert plan.describe(size[1], size[0]) == " x ".join(str(side) for side in made)
    else:
        assert plan.exact_output(size[1], size[0]) is None
        assert plan.describe(size[1], size[0]) == f"up to 3 x {out_h} x {out_w}"


def test_an_output_larger_than_foreseen_is_refused(tmp_path):
    from bnsurgeon.core.errors import DataError
    from bnsurgeon.loading.data import ImagePlan, _image_batches

    folder = save_images(tmp_path / "one", count=1, size=(12, 10))
    plan = ImagePlan(("exact", 8, 8), origin="the test's processor")
    with pytest.raises(DataError, match="the test's processor made .*00.png into 3 x 100 x 100, larger than"):
        next(_image_batches(sorted(folder.iterdir()), lambda image: torch.zeros(3, 100, 100), 4, plan))


# the kinds of image: read one way, said, or refused


@pytest.fixture
def plain_processor(tmp_path):
    """A model directory's preprocessing that only scales: a batch holds each pixel / 255."""
    directory = tmp_path / "plain"
    directory.mkdir()
    preprocessor(directory, size={"height": 8, "width": 8}, do_normalize=False, rescale_factor=1 / 255)
    return directory


def first_batch(folder: Path, directory: Path):
    from bnsurgeon.loading.data import open_data

    stream = open_data(str(folder), model_directory=directory)
    return next(iter(stream)), stream


def test_a_16_bit_image_is_scaled_to_8_bits_not_clipped_to_white(plain_processor, tmp_path):
    import numpy as np
    from PIL import Image

    folder = tmp_path / "deep"
    folder.mkdir()
    Image.fromarray(np.full((10, 12), 32768, np.uint16)).save(folder / "a.png")
    assert Image.open(folder / "a.png").mode.startswith("I;16")
    batch, _ = first_batch(folder, plain_processor)
    assert torch.allclose(batch, torch.full_like(batch, 128 / 255))  # Pillow's own conversion gives 1.0 (255)


def test_a_32_bit_float_image_is_refused_naming_its_samples(plain_processor, tmp_path, no_decoding):
    import numpy as np
    from PIL import Image

    from bnsurgeon.core.errors import DataError

    folder = tmp_path / "float"
    folder.mkdir()
    Image.fromarray(np.full((10, 12), 3.5, np.float32)).save(folder / "a.tif")
    with pytest.raises(DataError, match="a.tif holds 32-bit floating-point samples"):
        first_batch(folder, plain_processor)


@pytest.mark.parametrize("suffix", [".gif", ".png"])
def test_an_animated_image_gives_its_first_frame_and_says_so(plain_processor, tmp_path, suffix):
    from PIL import Image

    folder = tmp_path / "animated"
    folder.mkdir()
    frames = [Image.new("RGB", (12, 10), color) for color in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(folder / f"a{suffix}", save_all=True, append_images=frames[1:])
    assert Image.open(folder / f"a{suffix}").n_frames == 2
    batch, stream = first_batch(folder, plain_processor)
    assert batch[0, :, 0, 0].tolist() == [1.0, 0.0, 0.0]  # red, the first frame
    assert "several frames (animated, multi-page) gives its first frame" in stream.preprocessing


def test_a_truncated_image_is_refused_even_where_pillow_was_told_to_pad_it(plain_processor, tmp_path, monkeypatch):
    from PIL import Image, ImageFile

    from bnsurgeon.core.errors import DataError

    folder = save_images(tmp_path / "cut", count=1, size=(64, 64))
    data = (folder / "00.png").read_bytes()
    (folder / "00.png").write_bytes(data[: len(data) // 2])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)  # as a library imported earlier may have set it
    with pytest.raises(DataError, match="00.png is not a readable image .*truncated"):
        first_batch(folder, plain_processor)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # Pillow's setting is the caller's again
    assert Image.open  # (Pillow still usable)


def test_an_image_is_read_only_as_a_format_pillow_decodes_itself(plain_processor, tmp_path):
    """A .png that is PostScript: Pillow would hand it to Ghostscript (a program run on a file someone else wrote)."""
    from bnsurgeon.core.errors import DataError

    folder = tmp_path / "eps"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    with pytest.raises(DataError, match="a.png is not a PNG, JPEG, BMP, WEBP, PPM, TIFF, GIF image"):
        first_batch(folder, plain_processor)


def test_held_before_a_cmyk_jpeg_and_a_link_to_dev_zero(plain_processor, tmp_path):
    """Checked again, not changed: a CMYK JPEG is converted to RGB; an image that is a link to /dev/zero is refused
    as not a regular file."""
    from PIL import Image

    from bnsurgeon.core.errors import DataError

    folder = tmp_path / "cmyk"
    folder.mkdir()
    Image.new("CMYK", (12, 10), (0, 255, 255, 0)).save(folder / "a.jpg")
    batch, _ = first_batch(folder, plain_processor)
    assert batch[0, :, 0, 0].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=0.02)
    (folder / "b.png").symlink_to("/dev/zero")
    with pytest.raises(DataError, match="b.png is not a regular file"):
        first_batch(folder, plain_processor)


# left from round five (issue 53, "Also"): each small, each with a test that fails on the code before


def test_a_directory_named_like_an_image_is_named_not_skipped_unsaid(small):
    folder = save_images(small / "imgs", count=1)
    (folder / "holiday.png").mkdir()
    result = run("recalibrate", "small:build", "--data", folder, "-o", small / "out.safetensors")
    one_line_failure(result, 12, "holiday.png is a directory named like a png file", "rename it")


def test_a_preprocessor_number_of_thousands_of_digits_is_named_not_called_invalid_json(resnet_dir, images, tmp_path):
    path = resnet_dir / "preprocessor_config.json"
    path.write_text('{"image_processor_type": "ViTImageProcessor", "size": {"shortest_edge": ' + "9" * 5000 + "}}")
    result = run("recalibrate", resnet_dir, "--data", images, "-o", tmp_path / "out")
    one_line_failure(result, 4, "holds a number of 5,000 digits", "save the image processor again")
    assert "not valid JSON" not in result.output


def test_past_twice_pillows_limit_the_message_quotes_bnsurgeons_limit(small, no_decoding):
    """Past twice Pillow's setting Pillow raises its own error, which quoted its own (changeable) number."""
    folder = small / "bomb"
    folder.mkdir()
    png_declaring(folder / "bomb.png", 20000, 10000)  # 200 million pixels: past 2 x 89,478,485
    result = run("recalibrate", "small:build", "--data", folder, "-o", small / "out.safetensors")
    one_line_failure(result, 12, "bomb.png declares more than the 89,478,485 pixels", "not decoded")
    assert "178,956,970" not in result.output and "178956970" not in result.output


@pytest.mark.parametrize("value", ["1_000", "+1000", "１０００"])
def test_an_environment_number_takes_digits_only_as_its_hint_says(small, value):
    torch.save(torch.randn(4, 3, 8, 8), small / "pixels.pt")
    result = run(
        "recalibrate",
        "small:build",
        "--data",
        small / "pixels.pt",
        "-o",
        small / "out.safetensors",
        env={"BNSURGEON_MAX_BATCH_BYTES": value},
    )
    one_line_failure(result, 2, "BNSURGEON_MAX_BATCH_BYTES=", "without separators")
