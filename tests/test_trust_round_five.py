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
