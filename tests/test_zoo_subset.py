"""A fixed small subset of the zoo sweep (scripts/zoo_sweep.py) runs in the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zoo():
    spec = importlib.util.spec_from_file_location("zoo_sweep", ROOT / "scripts" / "zoo_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["efficientnet_b0", "cspresnet50", "resnet18", "regnetx_002"])
def test_bnsurgeon_preserves_eval_where_torch_converter_does_not(zoo, name):
    row = zoo.sweep_one("timm", name)
    norm_act = "BatchNormAct2d" in row["bn_classes"]
    assert row["status"] == "exact" and row["bnsurgeon_exact"], row
    assert row["converted"] > 0 and row["unhandled"] == 0
    assert row["torch_exact"] is (not norm_act), "torch's converter drops BatchNormAct2d's activation"
    assert row["timm_exact"], "timm's own converter keeps act/drop"


def test_torchvision_detection_backbone_keeps_frozen_bn(zoo):
    row = zoo.sweep_one("torchvision", "fasterrcnn_resnet50_fpn")
    assert set(row["bn_classes"]) == {"FrozenBatchNorm2d"}
    assert row["status"] == "exact" and row["converted"] == 0, "frozen BN stays frozen under --to sync by default"
