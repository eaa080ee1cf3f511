"""`--to fused`, second review: a check that passed NaN outputs, a float64 judgement that passed far-off
float32 outputs, folds that overflow or underflow in the model's own dtype, compiled models whose copy ran
the source, and further attacks. Small hand-built models, seeded."""

from __future__ import annotations

import json

import pytest
import torch
from _modules import install_module
from torch import nn
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.checks.fused_check import check_fused, compare
from bnsurgeon.checks.verify import perturb_bn
from bnsurgeon.cli.commands import app
from bnsurgeon.core.anatomy import is_bn_like


def fused(model: nn.Module, example, **kwargs):
    return bnsurgeon.convert(model, "fused", example_input=example, **kwargs)


def bn_left(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules() if is_bn_like(module)]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


FACTORY = (
    "import torch, torch.nn as nn\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),\n"
    "                         nn.Linear(8 * 6 * 6, 5), nn.BatchNorm1d(5))\n"
)


@pytest.fixture
def factory(tmp_path, monkeypatch):
    install_module(tmp_path, monkeypatch, "fuse_more_model", FACTORY)
    return "fuse_more_model:build"


def _rewrite(path, tensor_change):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    tensor_change(tensors)
    save_file(tensors, str(path), metadata=metadata)


# ------------------------------------------------------------------ 1. NaN in the fused outputs


def test_nan_in_the_fused_outputs_fails_the_check_and_says_so():
    """max(0.0, nan) is 0.0: a fused model with NaN outputs measured 'max relative error 0' and passed."""
    torch.manual_seed(0)
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    x = torch.randn(2, 3, 8, 8)
    result = fused(model, x)
    folds = result.report.fusion["folded"]
    with torch.no_grad():
        result.model[0].bias[1] = float("nan")  # one channel: most outputs stay right
    outcome = compare(model, result.model, x, "as converted", folds=folds)
    assert outcome.passed is False and outcome.max_rel_error == float("inf")
    assert "fused model's outputs hold 72 NaN/inf" in outcome.detail, outcome.detail
    with torch.no_grad():
        result.model[0].bias[1] = float("inf")
    outcome = compare(model, result.model, x, "as converted", folds=folds)
    assert outcome.passed is False and "NaN/inf" in outcome.detail, outcome.detail


def test_verify_fails_a_tampered_fused_file_whose_outputs_are_nan(tmp_path, factory):
    """Finite weights (so load accepts them) that overflow to +inf and -inf, summed to NaN."""
    out = tmp_path / "m.fused.safetensors"
    assert run("convert", factory, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out).exit_code == 0

    def huge(tensors):
        weight = torch.full_like(tensors["4.weight"], 3e38)
        weight[:, 1::2] = -3e38
        tensors["4.weight"] = weight

    _rewrite(out, huge)
    result = run("verify", factory, out, "--converted-model", factory, "--input-shape", "2,3,8,8", "--json")
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["eval"]["passed"] is False and "NaN/inf" in checks["eval"]["detail"], checks["eval"]


# ------------------------------------------------------------------ 2. the float64 judgement and the low-precision model


def fp16_underflowing_fold() -> nn.Module:
    """An fp16 net whose BN scale (2**-23) is fine in the source (conv outputs ~1e3, BN outputs ~1e-4,
    normal fp16) but whose folded weights (2**-23 * w) are fp16 subnormals: ~0.3 rounds up to 0.5, ~1 stays.
    Not a whole channel lost (each keeps nonzero weights): a partial underflow the fold itself allows."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1, bias=False), nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1)
    )
    with torch.no_grad():
        model[0].weight.mul_(1e3)
        magnitude = torch.where(torch.rand_like(model[1].weight) < 0.5, 1.0, 0.3)
        model[1].weight.copy_(magnitude * torch.randn_like(magnitude).sign())
        model[2].weight.fill_(2.0**-23)
        model[2].bias.zero_()
        model[3].bias.zero_()
    return model.half().eval()


def test_float64_judgement_does_not_pass_a_fused_fp16_model_far_from_the_source():
    """The float64 re-fold is exact and the fp16 weights are it rounded, so the fold 'passed' at 13% error."""
    from bnsurgeon.checks.fused_check import fused_check_result

    model = fp16_underflowing_fold()
    x = torch.randn(2, 3, 8, 8).half()
    result = fused(model, x)
    assert [f["bn"] for f in result.report.fusion["folded"]] == ["2"]
    folded = result.model[1].weight
    assert bool((folded != 0).flatten(1).any(1).all())  # every channel keeps weights: not the dtype reason
    as_converted = check_fused(model, result.model, result.report.fusion["folded"], x)[0]
    assert as_converted.max_rel_error > 0.05
    assert as_converted.passed is False, as_converted.detail
    assert "in float64 the fold errs" in as_converted.detail and "more than 10x the source's own" in as_converted.detail
    assert fused_check_result(model, result, (2, 3, 8, 8)).passed is False


def test_the_drift_rule_judges_the_models_own_state_not_the_perturbed_one(monkeypatch):
    """The perturbed check re-folds a random state, which can be ill-conditioned beyond what one float32
    run of the source shows: there the drift is reported, not failed. Before, a random-init
    efficientnetv2_rw_m whose float64 fold was exact failed ``convert --to fused`` on it."""
    import bnsurgeon.checks.verify

    model = fp16_underflowing_fold()
    x = torch.randn(2, 3, 8, 8).half()
    result = fused(model, x)
    folds = result.report.fusion["folded"]
    monkeypatch.setattr(bnsurgeon.checks.verify, "perturb_bn", lambda module, **kwargs: module)  # "perturbed" = as is
    as_converted, perturbed = check_fused(model, result.model, folds, x)
    assert as_converted.passed is False and "more than 10x the source's own" in as_converted.detail
    assert perturbed.max_rel_error > 0.05
    assert perturbed.passed is True, perturbed.detail
    assert "float16 rounding amplified by a random state, reported, not judged" in perturbed.detail, perturbed.detail


def test_global_module_forward_hooks_leave_every_bn_with_the_reason():
    """A hook on one BN or producer leaves that pair; a global module hook runs on every module, so it
    would see every folded output: nothing folds while one is registered, and folds again once removed."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    torch.manual_seed(0)
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).eval()
    for register in (register_module_forward_hook, register_module_forward_pre_hook):
        handle = register(lambda *args: None)
        try:
            result = fused(model, (2, 3, 8, 8))
        finally:
            handle.remove()
        assert bn_left(result.model) == ["1"]
        assert "global module forward hooks are registered" in result.report.fusion["left"]["1"]
    assert bn_left(fused(model, (2, 3, 8, 8)).model) == []


# ------------------------------------------------------------------ 3. folds the model's own dtype cannot hold


def _fp16_conv_bn(conv: nn.Module, channel: int, gamma: float, var: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(conv, nn.BatchNorm2d(conv.out_channels), nn.ReLU())
    with torch.no_grad():
        model[1].weight[channel] = gamma
        model[1].running_var[channel] = var
    return model.half().eval()


def test_a_fold_that_overflows_float16_is_left_with_the_dtype_reason():
    """gamma/sqrt(var+eps) = 1e4/sqrt(1e-5) = 3.2e6: the source's BN outputs fit float16 (small inputs),
    the folded weights (~0.1 * 3.2e6) do not: the fold wrote inf weights."""
    model = _fp16_conv_bn(nn.Conv2d(3, 4, 3, bias=False), channel=1, gamma=1e4, var=0.0)
    x = (torch.randn(2, 3, 8, 8) * 1e-4).half()
    with torch.no_grad():
        assert bool(model(x).isfinite().all())
    result = fused(model, x)
    assert bn_left(result.model) == ["1"]
    reason = result.report.fusion["left"]["1"]
    assert "overflows float16" in reason and "folded weights" in reason, reason
    assert all(bool(p.isfinite().all()) for p in result.model.parameters())
    assert [o.passed for o in check_fused(model, result.model, result.report.fusion["folded"], x)] == [True, True]


@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv2d(3, 4, 3),
        lambda: nn.ConvTranspose2d(4, 4, 3, groups=2),  # weight (in, out/groups, k, k): channel 2 is group 1, row 0
    ],
    ids=["conv2d", "conv-transpose2d-groups"],
)
def test_a_fold_that_zeroes_a_channel_in_float16_is_left_with_the_dtype_reason(conv):
    """gamma = 2**-23: the source's BN scales channel 2 to small but normal float16 values; folded into the
    weights (~0.1 * 2**-23, below float16's smallest subnormal / 2) the whole channel became zeros."""
    from bnsurgeon.checks.fused_check import fused_check_result

    module = conv()
    model = _fp16_conv_bn(module, channel=2, gamma=2.0**-23, var=1.0)
    with torch.no_grad():
        model[0].weight.clamp_(-0.2, 0.2)
    shape = (2, module.in_channels, 8, 8)
    result = fused(model, shape)
    assert bn_left(result.model) == ["1"]
    reason = result.report.fusion["left"]["1"]
    assert "underflows float16: 1 output channel (2)" in reason, reason
    assert fused_check_result(model, result, shape).passed is True


def test_a_float32_fold_of_the_same_model_folds():
    model = _fp16_conv_bn(nn.Conv2d(3, 4, 3), channel=2, gamma=2.0**-23, var=1.0).float()
    result = fused(model, (2, 3, 8, 8))
    assert bn_left(result.model) == [] and result.report.fusion["left"] == {}


# ------------------------------------------------------------------ 4. torch.compile'd models


def _compiled(where: str) -> tuple[nn.Module, nn.Module]:
    """(the model to convert, the inner module torch.compile wrapped); backend 'eager': no code generation."""
    torch.manual_seed(0)
    inner = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).eval()
    wrapped = torch.compile(inner, backend="eager")
    return (wrapped if where == "model" else nn.Sequential(wrapped, nn.Flatten())), inner


@pytest.mark.parametrize("to", ["fused", "sync", "plain", "frozen"])
@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_copy_of_a_compiled_model_is_refused_with_the_fix(where, to):
    """The copy kept the compiled wrapper, whose forward is bound to the source's module: the
    'converted' model ran the source's conv and BN (a fused copy was the source, unfolded)."""
    from bnsurgeon.core.errors import UsageError

    model, inner = _compiled(where)
    with pytest.raises(UsageError, match=r"copy of a torch.compile'd model or submodule \((<root>|0)\)") as raised:
        bnsurgeon.convert(model, to, example_input=(2, 3, 8, 8))
    assert "_orig_mod" in raised.value.hint and "inplace=True" in raised.value.hint
    assert isinstance(inner[1], nn.BatchNorm2d)  # nothing changed


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_compiled_model_converted_in_place_runs_the_folded_modules(where):
    model, inner = _compiled(where)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x).clone()  # compiled and run once before the conversion
    result = fused(model, x, inplace=True)
    assert result.model is model and bn_left(model) == []
    ran = []
    inner[0].register_forward_pre_hook(lambda *args: ran.append("folded conv"))
    with torch.no_grad():
        actual = model(x)
    assert ran == ["folded conv"]
    assert not torch.equal(actual, expected)  # the folded arithmetic ran, not the source's graph ...
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5)  # ... and computes the same


def test_cli_a_factory_returning_a_compiled_model_exits_2(tmp_path, monkeypatch):
    install_module(
        tmp_path,
        monkeypatch,
        "compiled_model",
        "import torch, torch.nn as nn\n"
        "def build():\n"
        "    return torch.compile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), backend='eager')\n",
    )
    for to in ("fused", "sync"):
        result = run(
            "convert", "compiled_model:build", "--to", to, "--input-shape", "2,3,8,8", "-o", tmp_path / "o.safetensors"
        )
        assert result.exit_code == 2, result.output
        assert "torch.compile'd" in result.output and "Traceback" not in result.output
        assert "from Python, convert it in place" in result.output  # the CLI has no in-place conversion
        assert not list(tmp_path.glob("o.safetensors*"))


# ------------------------------------------------------------------ the float64 judgement proves the folds only


class CancellingHead(nn.Module):
    """conv -> BN -> sin(1e4 x) -> Linear: float32 rounding reaches ~1e-3 of the output, so the float64
    judgement decides; the head is no producer."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 5)

    def forward(self, x):
        return self.head(torch.sin(1e4 * self.bn(self.conv(x))))


def test_float64_judgement_fails_a_changed_tensor_outside_the_folds():
    """It checked the folded producers' weights against the float64 fold and nothing else: a head weight
    changed by 0.2% (a tampered file, verified against its source) hid under the net's float32 drift."""
    import copy

    torch.manual_seed(0)
    model = perturb_bn(CancellingHead())
    x = torch.randn(2, 3, 8, 6)
    result = fused(model, x)
    folds = result.report.fusion["folded"]
    assert [o.passed for o in check_fused(model, result.model, folds, x)] == [True, True]
    result.model.head = copy.deepcopy(result.model.head)  # the fused copy shares the source's head
    with torch.no_grad():
        result.model.head.weight.mul_(1.002)
    outcome = compare(model, result.model, x, "as converted", folds=folds)
    assert outcome.passed is False, outcome.detail
    assert "tensors outside the folds are NOT the source's: head.weight" in outcome.detail
