"""`--to fused` edge cases found in review: each a fold that changed what the model computes, a
crash, a misreport, or a file that could not be loaded back. Small hand-built models, seeded."""

from __future__ import annotations

import json

import pytest
import torch
from _modules import install_module
from torch import nn
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.checks.verify import perturb_bn
from bnsurgeon.cli.commands import app
from bnsurgeon.core.anatomy import is_bn_like
from bnsurgeon.core.errors import ModelCannotRunError


def fused(model: nn.Module, example, **kwargs):
    return bnsurgeon.convert(model, "fused", example_input=example, **kwargs)


def bn_left(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules() if is_bn_like(module)]


def eval_out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)


def close(source: nn.Module, converted: nn.Module, x: torch.Tensor) -> bool:
    expected, actual = eval_out(source, x), eval_out(converted, x)
    return bool(((expected - actual).abs().max() <= 1e-5 * expected.abs().max()).item())


# ------------------------------------------------------------------ hooks on the BN


@pytest.mark.parametrize(
    "hook",
    [
        lambda module, args, output: output + args[0],  # reads the BN's input: the fold would hand it the folded one
        lambda module, args, output: (
            output * module.weight.view(1, -1, 1, 1)
        ),  # reads the BN's state: gone after a fold
    ],
)
def test_a_bn_with_forward_hooks_is_left_with_its_reason(hook):
    torch.manual_seed(0)
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    model[1].register_forward_hook(hook)
    result = fused(model, (2, 3, 6, 6))
    assert bn_left(result.model) == ["1"]
    assert "forward hooks" in result.report.fusion["left"]["1"]
    assert close(model, result.model, torch.randn(2, 3, 6, 6))


def test_a_bn_pre_hook_is_named_as_the_reason():
    """The pre-hook replaces the input: the reason is the hook, not 'not the output of a Conv'."""
    torch.manual_seed(0)
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    result = fused(model, (2, 3, 6, 6))
    assert "pre-hooks" in result.report.fusion["left"]["1"]


# ------------------------------------------------------------------ value-dependent paths (hooks only)


class ValueBranch(nn.Module):
    """Which conv feeds the BN depends on the input's values: fx cannot trace it, and the hooks run
    sees one path only. Folding into the conv the check input happened to take breaks the other."""

    def __init__(self):
        super().__init__()
        self.conv, self.other, self.bn = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x) if x.mean() > 0 else self.other(x)
        return self.bn(y)


class ShapeOnlyUntraceable(nn.Module):
    """Not traceable by torch.fx (a branch on the input's rank), but reads no tensor value: folds."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        if x.dim() == 3:
            x = x.unsqueeze(0)
        out = self.bn(self.conv(x))
        return out * (out.abs().max().item() > 0)  # a value read once the conv's output is gone: harmless


def test_a_value_dependent_branch_is_not_folded_from_one_path():
    torch.manual_seed(0)
    model = perturb_bn(ValueBranch())
    x = torch.randn(2, 3, 5, 5).abs()  # takes self.conv
    result = fused(model, x)
    assert result.report.fusion["method"].startswith("hooks on the check input")
    assert bn_left(result.model) == ["bn"] and "tensor values" in result.report.fusion["left"]["bn"]
    assert close(model, result.model, x) and close(model, result.model, -x)  # both paths unchanged


def test_an_untraceable_model_without_value_branches_still_folds():
    torch.manual_seed(0)
    model = perturb_bn(ShapeOnlyUntraceable())
    result = fused(model, (2, 3, 6, 6))
    assert result.report.fusion["method"].startswith("hooks on the check input")
    assert bn_left(result.model) == [], result.report.fusion["left"]
    assert close(model, result.model, torch.randn(2, 3, 6, 6))


# ------------------------------------------------------------------ a BN inside a container


class Nested(nn.Module):
    """The conv's output goes into a container whose first module is the BN: one consumer."""

    def __init__(self, traceable: bool = True):
        super().__init__()
        self.conv, self.post = nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU())
        self.traceable = traceable

    def forward(self, x):
        if not self.traceable and x.dim() != 4:
            raise ValueError("4-d input only")
        return self.post(self.conv(x))


@pytest.mark.parametrize("traceable", [True, False])
def test_a_bn_first_in_a_container_folds(traceable):
    torch.manual_seed(0)
    model = perturb_bn(Nested(traceable))
    result = fused(model, (2, 3, 6, 6))
    assert result.report.fusion["method"].startswith("torch.fx" if traceable else "hooks")
    assert bn_left(result.model) == [], result.report.fusion["left"]
    assert close(model, result.model, torch.randn(2, 3, 6, 6))


def test_a_container_with_hooks_that_would_see_the_folded_input_keeps_its_bn():
    torch.manual_seed(0)
    model = perturb_bn(Nested(traceable=False))
    seen = []
    model.post.register_forward_pre_hook(lambda module, args: seen.append(args[0].sum()))
    result = fused(model, (2, 3, 6, 6))
    assert bn_left(result.model) == ["post.0"]
    assert "post" in result.report.fusion["left"]["post.0"]


# ------------------------------------------------------------------ models that cannot run, NaN


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, inputs):
        return self.bn(self.conv(inputs["image"]))


def test_a_forward_that_raises_while_finding_producers_is_reported_not_a_crash():
    with pytest.raises(ModelCannotRunError, match="cannot run on the input"):
        fused(DictInput(), (2, 3, 4, 4))


FACTORY = (
    "import torch, torch.nn as nn\n"
    "from timm.layers import BatchNormAct2d\n"
    "class DictInput(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)\n"
    "    def forward(self, inputs):\n"
    "        return self.bn(self.conv(inputs['image']))\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), BatchNormAct2d(8, act_layer=nn.SiLU),\n"
    "                         nn.ReLU(), nn.BatchNorm2d(8))\n"
    "def dict_input():\n"
    "    return DictInput()\n"
    "def nan_out():\n"
    "    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, eps=0.0))\n"
    "    model[1].running_var.zero_()  # finite weights, x / sqrt(0): inf and NaN outputs\n"
    "    return model\n"
)


@pytest.fixture
def factory(tmp_path, monkeypatch):
    install_module(tmp_path, monkeypatch, "fuse_edge_model", FACTORY)
    return "fuse_edge_model"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_cli_model_that_cannot_run_and_nan_outputs_exit_9(tmp_path, factory):
    out = tmp_path / "x.safetensors"
    raised = run("convert", f"{factory}:dict_input", "--to", "fused", "--input-shape", "2,3,4,4", "-o", out)
    assert raised.exit_code == 9 and "cannot run on the input" in raised.output, raised.output
    assert "Traceback" not in raised.output
    nan = run("convert", f"{factory}:nan_out", "--to", "fused", "--input-shape", "2,3,4,4", "-o", out)
    assert nan.exit_code == 9 and "not finite" in nan.output, nan.output
    assert not list(tmp_path.glob("x.safetensors*"))


# ------------------------------------------------------------------ a fused checkpoint as SOURCE


def test_a_fused_checkpoint_is_refused_as_a_source_with_the_fix(tmp_path, factory):
    """Folded BN no longer exist: a conversion of a fused file wrote a file that could not be loaded
    ("metadata edited or damaged"), and verify with it as SOURCE blamed its fold records."""
    source = f"{factory}:build"
    out = tmp_path / "m.fused.safetensors"
    assert run("convert", source, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out).exit_code == 0
    for to in ("plain", "sync", "frozen", "fused"):
        again = tmp_path / f"again.{to}.safetensors"
        result = run("convert", out, "--model", source, "--to", to, "--input-shape", "2,3,8,8", "-o", again)
        assert result.exit_code == 2, (to, result.output)
        assert "fused checkpoint" in result.output and "convert the model it was folded from" in result.output
        assert not list(tmp_path.glob("again*"))
    verified = run("verify", out, out, "--model", source, "--converted-model", source, "--input-shape", "2,3,8,8")
    assert verified.exit_code == 2 and "SOURCE" in verified.output and "fused checkpoint" in verified.output
    report = run("verify", source, out, "--converted-model", source, "--input-shape", "2,3,8,8", "--json")
    assert report.exit_code == 0 and json.loads(report.stdout)["passed"]


class Stash(nn.Module):
    """Keeps the conv's output for a feature-extraction caller: a fold would hand it the BN's output."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
        self.features: list[torch.Tensor] = []

    def forward(self, x):
        y = self.conv(x)
        self.features = [y]
        return self.bn(y)


def test_a_producer_output_kept_after_the_forward_is_not_folded():
    torch.manual_seed(0)
    model = perturb_bn(Stash())
    result = fused(model, (2, 3, 4, 4))
    assert bn_left(result.model) == ["bn"] and "still held after the forward" in result.report.fusion["left"]["bn"]
    x = torch.randn(2, 3, 4, 4)
    eval_out(model, x)
    expected = model.features[0]
    eval_out(result.model, x)
    assert torch.equal(result.model.features[0], expected)


# ------------------------------------------------------------------ reasons that name the real cause


def test_a_parametrized_producer_is_named_as_the_reason():
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight):
            return 2 * weight

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    parametrize.register_parametrization(model[0], "weight", Doubled())
    result = fused(model, (2, 3, 8, 8))
    assert bn_left(result.model) == ["1"]
    assert "parametrized weights" in result.report.fusion["left"]["1"], result.report.fusion["left"]


def test_a_fold_record_naming_a_non_bn_module_says_so():
    from bnsurgeon.core.errors import CheckpointError
    from bnsurgeon.surgery.fusion import plan_from_records

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    record = {
        "bn": "1",
        "producer": "0",
        "bn_class": "torch.nn.modules.activation.ReLU",
        "producer_class": "torch.nn.modules.conv.Conv2d",
    }
    with pytest.raises(CheckpointError, match="not a BatchNorm-family module"):
        plan_from_records(model, [record])


def test_hooks_only_second_consumer_is_listed_not_overcounted():
    class Branching(nn.Module):  # untraceable (branches on the input's rank), conv output also fed to a container
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.side = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.Identity())

        def forward(self, x):
            if x.dim() == 4:
                y = self.conv(x)
                return self.bn(y) + self.side(y)
            return x

    result = fused(Branching(), (2, 3, 8, 8))
    reason = result.report.fusion["left"]["bn"]
    assert result.report.fusion["method"].startswith("hooks"), result.report.fusion["method"]
    assert "feeds other consumers besides it" in reason and "side" in reason, reason
    assert "feeds 3" not in reason, reason  # the container and the module inside it are one hand-over
