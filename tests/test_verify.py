"""`bnsurgeon verify`: passes for bnsurgeon conversions, fails (exit 1) naming the first
divergent module for torch's converter, and `convert --verify` records the checks."""

from __future__ import annotations

import json

import pytest
import torch
from _modules import install_module
from torch import nn
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.cli.commands import app

pytestmark = pytest.mark.distributed
runner = CliRunner()
SMALL = "2,3,64,64"

MODELS = """
import torch
import timm
from torch import nn


def source():
    torch.manual_seed(0)
    return timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=4)  # BatchNormAct2d, small


def torch_converted():
    return nn.SyncBatchNorm.convert_sync_batchnorm(source())


def bn1d3d():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU(), nn.Unflatten(2, (1, 1, -1)),
                         nn.Conv3d(8, 6, 1), nn.BatchNorm3d(6))
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    return install_module(tmp_path, monkeypatch, "vmodels", MODELS)


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_torch_converter_fails_and_names_first_divergent_module(models):
    result = run("verify", "vmodels:source", "vmodels:torch_converted", "--input-shape", SMALL, "-w", "2")
    assert result.exit_code == 1, result.output
    assert "eval failed" in result.output
    assert "first divergent module bn1 (SyncBatchNorm; in the source BatchNormAct2d)" in result.output


def test_bnsurgeon_conversion_passes_at_2_and_3_ranks_and_json_parses(models):
    out = models / "mnv3.sync.safetensors"
    assert run("convert", "vmodels:source", "-o", out).exit_code == 0
    result = runner.invoke(
        app,
        [
            "verify",
            "vmodels:source",
            str(out),
            "--converted-model",
            "vmodels:source",
            "--input-shape",
            SMALL,
            "-w",
            "2",
            "-w",
            "3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    names = [c["name"] for c in data["checks"]]
    assert {"eval", "train, one process", "2 ranks", "3 ranks", "2 ranks (perturbed)", "3 ranks (perturbed)"} <= set(
        names
    )
    assert data["passed"] and all(c["passed"] for c in data["checks"])


def test_1d_3d_model_with_explicit_input_shape(models):
    out = models / "m.sync.safetensors"
    assert run("convert", "vmodels:bn1d3d", "-o", out, "--input-shape", "4,4,10").exit_code == 0
    result = run(
        "verify",
        "vmodels:bn1d3d",
        out,
        "--converted-model",
        "vmodels:bn1d3d",
        "--input-shape",
        "4,4,10",
        "--no-perturb",
    )
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output


def test_frozen_target_checks_frozen_train_against_source_eval(models):
    out = models / "mnv3.frozen.safetensors"
    assert run("convert", "vmodels:source", "--to", "frozen", "-o", out).exit_code == 0
    result = runner.invoke(
        app,
        ["verify", "vmodels:source", str(out), "--converted-model", "vmodels:source", "--input-shape", SMALL, "--json"],
    )
    data = json.loads(result.stdout)
    assert result.exit_code == 0 and "frozen (train) == source (eval)" in [c["name"] for c in data["checks"]]


def test_bad_input_gets_the_same_exit_codes_as_convert(models):
    result = run("verify", "vmodels:source", "no_such.safetensors", "--input-shape", SMALL)
    assert result.exit_code == 3 and "no such file" in result.output and "Traceback" not in result.output


def test_convert_verify_records_checks_in_report(models):
    out = models / "v.sync.safetensors"
    result = run("convert", "vmodels:bn1d3d", "-o", out, "--input-shape", "4,4,10", "--verify")
    assert result.exit_code == 0, result.output
    report = json.loads((models / "v.sync.safetensors.report.json").read_text())
    assert report["verification"]["passed"] and any(c["name"] == "2 ranks" for c in report["verification"]["checks"])
    assert "Verification:" in (models / "v.sync.safetensors.report.md").read_text()


def test_perturbation_exposes_what_fresh_bn_hides():
    """At init BN is near the identity; perturbed identically, a lost activation cannot hide."""
    import copy

    import torch
    from timm.layers import BatchNormAct2d
    from torch import nn

    from bnsurgeon.checks.verify import check_eval, perturb_bn

    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4, act_layer=nn.Identity))
    broken = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    assert check_eval(model, broken, (2, 3, 4, 4)).passed, "with an identity act nothing is lost"
    a, b = perturb_bn(copy.deepcopy(model)), perturb_bn(copy.deepcopy(broken))
    assert torch.equal(a[1].weight, b[1].weight) and torch.equal(a[1].running_var, b[1].running_var)


def test_first_divergent_module_matches_a_module_called_twice_call_by_call():
    """torchvision's BasicBlock runs one ReLU twice: each call is compared with the same call, not the first."""
    import copy

    import torch
    from torchvision.models import resnet18

    from bnsurgeon.checks.verify import first_divergent_module

    torch.manual_seed(0)
    model = resnet18(num_classes=4).eval()
    x = torch.randn(2, 3, 32, 32)
    assert first_divergent_module(model, copy.deepcopy(model), x) is None
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.layer2[0].bn2.bias.add_(1.0)
    assert first_divergent_module(model, broken, x).startswith("layer2.0.bn2 ")


def test_a_failing_inexact_check_on_detections_points_at_compare_at():
    """A rounding-level difference flips a detector's top-k: the failure says where a comparison is meaningful."""
    import copy

    import torch
    from torch import nn

    from bnsurgeon.checks.verify import Tolerance, check_eval

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

        def forward(self, images):
            features = self.backbone(torch.stack(images)).flatten(1)
            scores = torch.remainder(features * 1e5, 1.0)  # like top-k/NMS: a tiny change, other boxes
            return [{"scores": row} for row in scores]

    torch.manual_seed(0)
    source = Detector().eval()
    converted = copy.deepcopy(source)
    with torch.no_grad():
        converted.backbone[1].weight.mul_(1 + 1e-6)
    outcome = check_eval(source, converted, CheckInputForTest.images(), Tolerance(rtol=1e-4))
    assert outcome.passed is False and "--compare-at backbone" in outcome.detail
    at = check_eval(source, converted, CheckInputForTest.images(), Tolerance(rtol=1e-4), compare_at="backbone")
    assert at.passed


class CheckInputForTest:
    @staticmethod
    def images():
        from bnsurgeon.checks.check_input import CheckInput

        return CheckInput("list", ((3, 8, 8), (3, 8, 8)))


class _Cancels(nn.Module):
    """Frozen BN, then sin(1e4 * y): the last bit of y (x*scale+shift against batch_norm arithmetic) moves the
    output by 1e-2 of its scale, as deformable attention's sampling at computed positions amplifies it."""

    def __init__(self):
        super().__init__()
        from torchvision.ops.misc import FrozenBatchNorm2d

        self.conv, self.bn = nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_var.uniform_(0.3, 3.0)
            self.bn.weight.uniform_(0.5, 2.0)
            self.bn.running_mean.uniform_(-1.0, 1.0)
            self.bn.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        return torch.sin(self.bn(self.conv(x)) * 1e4)


def test_an_inexact_conversion_that_only_float32_rounding_separates_is_judged_in_float64():
    from bnsurgeon.checks.verify import Tolerance, check_eval

    torch.manual_seed(0)
    source = _Cancels().eval()
    converted = bnsurgeon.convert(source, "plain", frozen="unfreeze").model.eval()
    outcome = check_eval(source, converted, (2, 3, 16, 16), Tolerance(rtol=1e-4))
    assert outcome.passed, outcome
    assert "in float64 the outputs agree" in outcome.detail and outcome.max_abs_diff > 1e-3
    converted.bn.bias = nn.Parameter(converted.bn.bias.detach() + 1e-3)  # a real difference, below float32's step
    wrong = check_eval(source, converted, (2, 3, 16, 16), Tolerance(rtol=1e-4))
    assert wrong.passed is False
