"""Real segmentation and detection models (torchvision, segmentation_models_pytorch, and
OpenMMLab / ultralytics where installed) through inspect / convert / verify / revert.

Small inputs, no weights downloaded (weights=None, encoder_weights=None, seeded init).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bnsurgeon.cli import app

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
    result = run("inspect", "ultralytics.nn.tasks:DetectionModel", "--model-arg", "cfg=yolov8n.yaml",
                 "--model-arg", "verbose=False", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["totals"]["bn_modules"] == 57 and data["totals"]["unhandled"] == 0
