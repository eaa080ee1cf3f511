"""`--to fused`: every producer and BN kind folds exactly; what cannot fold stays with its reason;
the checkpoint round trip; export without batch_norm; the CLI."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from _modules import install_module
from timm.layers import BatchNormAct2d, FrozenBatchNormAct2d, MixedConv2d
from timm.layers import Linear as TimmLinear
from timm.layers.conv2d_same import Conv2dSame
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.checks.verify import perturb_bn
from bnsurgeon.cli.commands import app
from bnsurgeon.core.anatomy import is_bn_like
from bnsurgeon.core.errors import CheckpointError, UsageError
from bnsurgeon.rules import Registry, Rule, builtin_rules, keep_if
from bnsurgeon.runtime import FrozenBatchNorm, FrozenBatchNormAct, SyncBatchNorm
from bnsurgeon.runtime.folded import FoldedNormAct


def fused(model: nn.Module, shape, **kwargs):
    return bnsurgeon.convert(model, "fused", example_input=shape, **kwargs)


def max_rel_error(source: nn.Module, converted: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        expected, actual = source.eval()(x), converted.eval()(x)
    return ((expected - actual).abs().max() / expected.abs().max()).item()


def bn_left(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules() if is_bn_like(module)]


def conv_bn(conv: nn.Module, bn: nn.Module) -> nn.Module:
    return nn.Sequential(conv, bn, nn.ReLU())


PRODUCERS = {
    "conv1d": (lambda: conv_bn(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)), (3, 4, 16)),
    "conv2d": (lambda: conv_bn(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6)), (3, 4, 12, 12)),
    "conv3d": (lambda: conv_bn(nn.Conv3d(4, 6, 3), nn.BatchNorm3d(6)), (3, 4, 6, 6, 6)),
    "conv2d-no-bias": (lambda: conv_bn(nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6)), (3, 4, 12, 12)),
    "groups-dilation-stride": (
        lambda: conv_bn(nn.Conv2d(4, 8, 3, groups=2, dilation=2, stride=2, padding=2), nn.BatchNorm2d(8)),
        (3, 4, 12, 12),
    ),
    "depthwise": (
        lambda: conv_bn(nn.Conv2d(6, 6, 3, groups=6, padding=1, bias=False), nn.BatchNorm2d(6)),
        (3, 6, 9, 9),
    ),
    **{
        f"padding-{mode}": (
            lambda mode=mode: conv_bn(nn.Conv2d(4, 6, 3, padding=1, padding_mode=mode), nn.BatchNorm2d(6)),
            (3, 4, 10, 10),
        )
        for mode in ("reflect", "replicate", "circular")
    },
    "conv-transpose2d-groups": (
        lambda: conv_bn(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.BatchNorm2d(6)),
        (3, 4, 7, 7),
    ),
    "conv-transpose1d-no-bias": (
        lambda: conv_bn(nn.ConvTranspose1d(4, 6, 3, bias=False), nn.BatchNorm1d(6)),
        (3, 4, 9),
    ),
    "linear-bn1d": (lambda: conv_bn(nn.Linear(5, 7), nn.BatchNorm1d(7)), (4, 5)),
    "no-affine": (lambda: conv_bn(nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6, affine=False)), (3, 4, 5, 5)),
    # timm's subclasses that use self.weight/self.bias unchanged, and MixedConv2d (a slice of channels per conv)
    "timm-conv2d-same": (lambda: conv_bn(Conv2dSame(4, 6, 3, stride=2, bias=False), nn.BatchNorm2d(6)), (3, 4, 9, 9)),
    "timm-linear": (lambda: conv_bn(TimmLinear(5, 7), nn.BatchNorm1d(7)), (4, 5)),
    "timm-mixed-conv2d": (
        lambda: conv_bn(MixedConv2d(6, 9, [3, 5, 7], padding="same", depthwise=False), nn.BatchNorm2d(9)),
        (3, 6, 11, 11),
    ),
}


@pytest.mark.parametrize("kind", list(PRODUCERS))
def test_each_producer_folds_exactly_in_float64(kind):
    """In float64 the fold equals conv + BN to rounding (1e-12): the arithmetic is exact, not approximate."""
    build, shape = PRODUCERS[kind]
    torch.manual_seed(0)
    model = perturb_bn(build()).double().eval()
    result = fused(model, shape)
    assert bn_left(result.model) == []
    assert [(f["bn"], f["producer"]) for f in result.report.fusion["folded"]] == [("1", "0")]
    assert type(result.model[1]) is nn.Identity
    assert all(conv.bias is not None for conv in result.model[0].modules() if "weight" in conv._parameters)
    x = torch.randn(shape, dtype=torch.float64)
    assert max_rel_error(model, result.model, x) < 1e-12
    source_weight, fused_weight = (next(m.parameters()) for m in (model[0], result.model[0]))
    assert type(model[1]).__name__.startswith("BatchNorm") and source_weight is not fused_weight  # source untouched


def test_channels_last_fp32_within_1e5():
    torch.manual_seed(0)
    model = perturb_bn(conv_bn(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16))).to(
        memory_format=torch.channels_last
    )
    x = torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last)
    result = fused(model, x)
    assert result.model[0].weight.is_contiguous(memory_format=torch.channels_last)  # the layout the user chose stays
    assert result.model.eval()(x).is_contiguous(memory_format=torch.channels_last)
    assert bn_left(result.model) == [] and max_rel_error(model, result.model, x) < 1e-5


def bn_kinds():
    return {
        "BatchNormAct2d": lambda: BatchNormAct2d(6, act_layer=nn.SiLU, drop_layer=None),
        "torchvision FrozenBatchNorm2d": lambda: FrozenBatchNorm2d(6),
        "timm FrozenBatchNormAct2d": lambda: FrozenBatchNormAct2d(6, act_layer=nn.ReLU),
        "bnsurgeon FrozenBatchNorm": lambda: FrozenBatchNorm(6),
        "bnsurgeon FrozenBatchNormAct": lambda: FrozenBatchNormAct.from_module(BatchNormAct2d(6, act_layer=nn.GELU)),
        "torch SyncBatchNorm": lambda: nn.SyncBatchNorm(6),
        "bnsurgeon SyncBatchNorm": lambda: SyncBatchNorm(6),
    }


@pytest.mark.parametrize("kind", list(bn_kinds()))
def test_each_bn_kind_folds_and_norm_act_keeps_its_act(kind):
    torch.manual_seed(0)
    bn = bn_kinds()[kind]()
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 6, 3), bn)).double()
    result = fused(model, (2, 3, 8, 8))
    assert bn_left(result.model) == [], result.report.fusion["left"]
    replacement = result.model[1]
    if "act" in bn._modules:
        assert type(replacement) is FoldedNormAct
        assert replacement.act is bn.act and replacement.drop is bn.drop  # the source's own modules
        assert type(bn.act) is not nn.Identity
    else:
        assert type(replacement) is nn.Identity
    assert max_rel_error(model, result.model, torch.randn(2, 3, 8, 8, dtype=torch.float64)) < 1e-12


class TwoConsumers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.side = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + self.side(y)


class PreActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(torch.relu(self.conv(x)))


class SharedProducer(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(self.conv(x)))


class LinearOnSequence(nn.Module):
    """Linear on (N, L, C) then BatchNorm1d over dim 1 = L: channel axes differ, never foldable."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.fc(x))


class Untraceable(nn.Module):
    """Control flow on the input's rank: torch.fx cannot trace it, hooks on the check input can. (A branch
    on tensor values would leave the BN after it: tests/test_fused_edge.py.)"""

    def __init__(self, inplace_add: bool = False):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.inplace_add = inplace_add

    def forward(self, x):
        if x.dim() == 4:
            x = self.bn(self.conv(x))
        y = self.conv2(x)
        if self.inplace_add:
            y += 1.0  # the BN's input is still y's object, but it is no longer the conv's output
        return self.bn2(y)


class TrainOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
        self.aux, self.aux_bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.training:
            out = out + self.aux_bn(self.aux(x))
        return out


@pytest.mark.parametrize(
    "model_cls, path, reason",
    [
        (TwoConsumers, "bn", "feeds 2 consumers"),
        (PreActivation, "bn", "not the output of a Conv"),
        (SharedProducer, "bn", "called 2 times"),
        (LinearOnSequence, "bn", "rank 3"),
        (TrainOnly, "aux_bn", "not called in eval"),
    ],
)
def test_what_cannot_fold_stays_with_its_reason(model_cls, path, reason):
    torch.manual_seed(0)
    model = perturb_bn(model_cls())
    shape = (2, 6, 6) if model_cls is LinearOnSequence else (2, 3, 5, 5)
    if model_cls in (SharedProducer,):
        shape = (2, 4, 5, 5)
    result = fused(model, shape)
    assert path in bn_left(result.model)
    assert reason in result.report.fusion["left"][path]
    assert any(k.path == path and reason in k.reason for k in result.report.kept)
    x = torch.randn(shape)
    assert max_rel_error(model, result.model, x) < 1e-5


def test_untraceable_model_found_with_hooks():
    torch.manual_seed(0)
    model = perturb_bn(Untraceable())
    result = fused(model, (2, 3, 7, 7))
    assert result.report.fusion["method"].startswith("hooks on the check input (not traceable by torch.fx")
    assert {f["bn"] for f in result.report.fusion["folded"]} == {"bn", "bn2"}
    assert max_rel_error(model, result.model, torch.randn(2, 3, 7, 7)) < 1e-5


def test_hooks_see_an_in_place_op_on_the_producer_output():
    torch.manual_seed(0)
    model = perturb_bn(Untraceable(inplace_add=True))
    result = fused(model, (2, 3, 7, 7))
    assert (
        "bn2" in bn_left(result.model)
        and "add_" in result.report.fusion["left"]["bn2"]
        or "consumers" in result.report.fusion["left"]["bn2"]
    )
    assert max_rel_error(model, result.model, torch.randn(2, 3, 7, 7)) < 1e-5


def test_fused_needs_an_example_input_and_rules_without_fused_builder_keep():
    with pytest.raises(UsageError, match="example input"):
        bnsurgeon.convert(conv_bn(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), "fused")

    class MyBN(nn.BatchNorm2d):
        pass

    registry = Registry(builtin_rules())
    registry.register(Rule("mine", (MyBN,), {t: keep_if(t) for t in ("sync", "plain", "frozen")}))
    result = fused(nn.Sequential(nn.Conv2d(3, 4, 1), MyBN(4)), (2, 3, 4, 4), registry=registry)
    assert "has no fused builder" in result.report.kept[0].reason


def test_export_has_no_batch_norm_for_folded_modules():
    torch.manual_seed(0)
    model = perturb_bn(
        nn.Sequential(nn.Conv2d(3, 6, 3), BatchNormAct2d(6, act_layer=nn.ReLU), nn.ReLU(), nn.BatchNorm2d(6))
    )  # the last BN has no conv before it
    result = fused(model, (2, 3, 8, 8))
    assert bn_left(result.model) == ["3"]
    x = torch.randn(2, 3, 8, 8)

    def batch_norms(module):
        graph = torch.export.export(module.eval(), (x,)).graph
        return [n for n in graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)]

    assert len(batch_norms(model)) == 2 and len(batch_norms(result.model)) == 1


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="the onnx package is not installed")
def test_onnx_has_no_batch_norm_for_folded_modules():
    """torch's exporter folds Conv->BN itself, so the control is a Linear->BN1d, which it leaves."""
    import io
    import warnings

    import onnx

    torch.manual_seed(0)
    model = perturb_bn(
        nn.Sequential(
            nn.Conv2d(3, 6, 3),
            nn.BatchNorm2d(6),
            nn.Flatten(),
            nn.Linear(216, 5),
            nn.BatchNorm1d(5),
            nn.ReLU(),
            nn.BatchNorm1d(5),
        )
    )  # the last: no producer
    result = fused(model, (2, 3, 8, 8))
    assert bn_left(result.model) == ["6"]

    def onnx_batch_norms(module):
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(module.eval(), (torch.randn(2, 3, 8, 8),), buffer, dynamo=False)
        return [n for n in onnx.load_from_string(buffer.getvalue()).graph.node if n.op_type == "BatchNormalization"]

    assert len(onnx_batch_norms(model)) == 2 and len(onnx_batch_norms(result.model)) == 1


FACTORY = (
    "import torch, torch.nn as nn\n"
    "from timm.layers import BatchNormAct2d\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), BatchNormAct2d(8, act_layer=nn.SiLU),\n"
    "                         nn.ReLU(), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 5), nn.BatchNorm1d(5))\n"
)


@pytest.fixture
def factory(tmp_path, monkeypatch):
    install_module(tmp_path, monkeypatch, "fuse_model", FACTORY)
    return "fuse_model:build"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_cli_convert_load_round_trip_and_verify(tmp_path, factory):
    out = tmp_path / "m.fused.safetensors"
    result = run("convert", factory, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {(f["bn"], f["producer"]) for f in report["fusion"]["folded"]} == {("1", "0"), ("6", "5")}
    assert "not the output of a Conv" in report["fusion"]["left"]["3"]
    assert report["check"]["passed"] and report["fusion"]["max_rel_error"]["perturbed"] < 1e-5

    model = bnsurgeon.load(out, model=factory)
    assert type(model[1]) is FoldedNormAct and type(model[1].act) is nn.SiLU and type(model[6]) is nn.Identity
    assert isinstance(model[3], nn.BatchNorm2d) and model[0].bias is not None
    from fuse_model import build

    from bnsurgeon.surgery.fusion import example_tensor

    source = build()
    x = example_tensor(source, (2, 3, 8, 8))
    reference = bnsurgeon.convert(source, "fused", example_input=x).model
    with torch.no_grad():
        assert torch.equal(model.eval()(x), reference.eval()(x))

    verified = run("verify", factory, out, "--converted-model", factory, "--input-shape", "2,3,8,8", "--json")
    assert verified.exit_code == 0, verified.output
    checks = {c["name"]: c for c in json.loads(verified.stdout)["checks"]}
    assert checks["eval"]["passed"] and checks["eval (perturbed, re-folded)"]["passed"]
    assert checks["train"]["passed"] is None and "not applicable" in checks["train"]["detail"]
    assert checks["eval"]["seconds"] > 0 and checks["eval (perturbed, re-folded)"]["seconds"] > 0

    human = run("verify", factory, out, "--converted-model", factory, "--input-shape", "2,3,8,8")
    assert human.exit_code == 0, human.output
    lines = [line.split() for line in human.output.splitlines()]
    assert [line[0] for line in lines if line and line[0] in ("eval", "train")] == ["eval", "eval", "train"], (
        human.output
    )
    at = run("verify", factory, out, "--converted-model", factory, "--input-shape", "2,3,8,8", "--compare-at", "0")
    assert at.exit_code == 2 and "does not apply to a fused checkpoint" in at.output


def _rewrite(path, metadata_change=None, tensor_change=None):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    if metadata_change:
        metadata_change(metadata)
    if tensor_change:
        tensor_change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def test_verify_fails_on_a_wrong_fold_and_load_refuses_bad_fold_records(tmp_path, factory):
    out = tmp_path / "m.fused.safetensors"
    assert run("convert", factory, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out).exit_code == 0

    def scale_bias(tensors):
        tensors["0.bias"] = tensors["0.bias"] + 0.1  # fresh BN folds to a zero bias: shift it

    _rewrite(out, tensor_change=scale_bias)
    failed = run("verify", factory, out, "--converted-model", factory, "--input-shape", "2,3,8,8")
    assert failed.exit_code == 1, failed.output

    def point_elsewhere(metadata):
        folds = json.loads(metadata["bnsurgeon.folds"])
        folds[0]["producer"] = "2"  # the ReLU: not a Conv/Linear
        metadata["bnsurgeon.folds"] = json.dumps(folds)

    _rewrite(out, metadata_change=point_elsewhere)
    with pytest.raises(CheckpointError, match="recorded fold .*must be a Conv"):
        bnsurgeon.load(out, model=factory)

    def not_a_list(metadata):
        metadata["bnsurgeon.folds"] = json.dumps({"bn": "1"})

    _rewrite(out, metadata_change=not_a_list)
    result = run("verify", factory, out, "--converted-model", factory, "--input-shape", "2,3,8,8")
    assert result.exit_code == 4 and "bnsurgeon.folds must be a JSON list" in result.output


class Cancelling(nn.Module):
    """conv -> BN -> sin(1e4 x): float32 rounding of x (~1e-7) becomes ~1e-3 of the output, float64's ~1e-12."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.sin(1e4 * self.bn(self.conv(x)))


class Chaotic(nn.Module):
    """conv -> BN -> sigmoid, then 80 steps of the logistic map: any rounding, even float64's, grows to O(1)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = torch.sigmoid(self.bn(self.conv(x)))
        for _ in range(80):
            y = 4 * y * (1 - y)
        return y


def test_float32_rounding_is_judged_in_float64_and_a_wrong_fold_still_fails():
    from bnsurgeon.checks.fused_check import check_fused

    torch.manual_seed(0)
    model = perturb_bn(Cancelling())
    x = torch.randn(2, 3, 8, 8)
    result = fused(model, x)
    as_converted, perturbed = check_fused(model, result.model, result.report.fusion["folded"], x)
    assert as_converted.max_rel_error > 1e-3  # float32 cannot tell at all ...
    assert as_converted.passed is True and "in float64 the fold errs" in as_converted.detail  # ... float64 can
    assert perturbed.passed is True
    with torch.no_grad():
        result.model.conv.bias.add_(1e-6)  # a fold off by about float32's own rounding here
    outcome = check_fused(model, result.model, result.report.fusion["folded"], x)[0]
    assert outcome.passed is False and "NOT the float64 fold" in outcome.detail


def test_a_chaotic_model_is_undecidable_and_never_passes_vacuously(tmp_path):
    from bnsurgeon.checks.fused_check import check_fused, fused_check_result, verify_fused

    torch.manual_seed(0)
    model = Chaotic()
    x = torch.randn(2, 3, 8, 8)
    result = fused(model, x)
    outcomes = check_fused(model, result.model, result.report.fusion["folded"], x)
    assert [o.passed for o in outcomes] == [None, None]
    assert all("undecidable: the source is chaotic" in o.detail for o in outcomes)
    assert fused_check_result(model, result, (2, 3, 8, 8)).passed is False
    verification = verify_fused(model, result.model, result.report.fusion["folded"], (2, 3, 8, 8))
    assert verification.passed is False and "no check could judge" in verification.first_failure.detail


def test_a_wrong_fold_fails_the_pre_write_check_and_writes_nothing(tmp_path, factory, monkeypatch):
    import bnsurgeon.rules.fold as fold

    right = fold.bn_scale_shift
    monkeypatch.setattr(fold, "bn_scale_shift", lambda fields: (right(fields)[0], right(fields)[1] * 0.5))
    out = tmp_path / "m.fused.safetensors"
    result = run("convert", factory, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out)
    assert result.exit_code == 1, result.output
    assert "differ" in result.output and not list(tmp_path.glob("m.fused*"))
