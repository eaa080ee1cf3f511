"""Hooks and fused folds (issue 17), copies that do not share hook dicts with the source, and
messages and hints that stay bounded, singular where they count one, and true for Python
callers (issue 12)."""

from __future__ import annotations

import ast
import inspect
import json
import shlex

import pytest
import torch
from _modules import install_module
from torch import nn
from torch.nn.modules import module as torch_module
from typer.testing import CliRunner

import bnsurgeon
from bnsurgeon.checks.verify import perturb_bn
from bnsurgeon.cli.commands import app
from bnsurgeon.core.anatomy import is_bn_like
from bnsurgeon.core.errors import FLAG_KEYWORDS, MAX_TEXT, BnSurgeonError, ConfirmationError, HookedModelError, bounded
from bnsurgeon.loading.architecture import parse_model_args

FACTORY = """
import torch
from torch import nn


def build(width=4, note=None):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 1), nn.BatchNorm2d(width))
"""


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture
def factory(tmp_path, monkeypatch):
    install_module(tmp_path, monkeypatch, "hooks_model", FACTORY)
    return "hooks_model:build"


def conv_bn() -> nn.Module:
    torch.manual_seed(0)
    return perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).eval()


def fused(model: nn.Module, example=(2, 3, 8, 8), **kwargs):
    return bnsurgeon.convert(model, "fused", example_input=example, **kwargs)


def bn_left(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules() if is_bn_like(module)]


def _noop(*args):
    return None


def left_reason(model: nn.Module, bn: str) -> str:
    """Fold ``model``; the one BN ``bn`` must stay: its reason."""
    result = fused(model)
    assert bn_left(result.model) == [bn]
    return result.report.fusion["left"][bn]


# ------------------------------------------------------------------ hooks that a fold would change


BN_HOOKS = {
    "full backward hook": lambda bn: bn.register_full_backward_hook(_noop),
    "backward pre-hook": lambda bn: bn.register_full_backward_pre_hook(_noop),
    "state_dict hook": lambda bn: bn._register_state_dict_hook(_noop),
    "state_dict pre-hook": lambda bn: bn.register_state_dict_pre_hook(_noop),
    "load_state_dict pre-hook": lambda bn: bn._register_load_state_dict_pre_hook(_noop),
    "load_state_dict post-hook": lambda bn: bn.register_load_state_dict_post_hook(_noop),
}


@pytest.mark.parametrize("kind", sorted(BN_HOOKS))
def test_a_bn_with_backward_or_state_dict_hooks_is_left_with_the_reason(kind):
    """After a fold the BN's hooks would run on an Identity: other gradients, no BatchNorm keys."""
    model = conv_bn()
    handle = BN_HOOKS[kind](model[1])
    reason = left_reason(model, "1")
    assert "hooks" in reason and "what replaces it" in reason, reason
    handle.remove()
    assert bn_left(fused(model).model) == []


@pytest.mark.parametrize("register", ["register_full_backward_hook", "register_full_backward_pre_hook"])
def test_a_producer_with_backward_hooks_is_left_with_the_reason(register):
    """A backward hook on the conv would get the gradient of the BN's output instead of its own."""
    model = conv_bn()
    getattr(model[0], register)(_noop)
    reason = left_reason(model, "1")
    assert "its producer has backward" in reason, reason


def test_a_container_with_a_backward_hook_that_receives_the_producer_output_leaves_the_bn():
    """The container's backward hook sees the gradient at its input, the conv's output: folded, it
    would see the gradient at the BN's output."""
    torch.manual_seed(0)
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))).eval()
    model[1].register_full_backward_hook(_noop)
    reason = left_reason(model, "1.0")
    assert "(with hooks)" in reason, reason


class Wrap(nn.Module):
    """Returns its conv's output: its own forward and backward hooks see the producer's output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x)


class WrappedConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.wrap, self.bn = Wrap(), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.wrap(x))


@pytest.mark.parametrize(
    "register", ["register_forward_hook", "register_full_backward_hook", "register_full_backward_pre_hook"]
)
def test_a_hooked_wrapper_that_returns_the_producer_output_leaves_the_bn(register):
    """The wrapper's hook sees the conv's output (or its gradient); folded, it would see the BN's
    (a gradient 3x as large with running_var 9). A hook that reads nothing was not seen at all."""
    torch.manual_seed(0)
    model = WrappedConvBN().eval()
    getattr(model.wrap, register)(_noop)
    reason = left_reason(model, "bn")
    assert "module wrap returns it (with hooks)" in reason, reason


@pytest.mark.parametrize("where", ["weight", "bn.bias"])
def test_tensor_hooks_on_a_folded_parameter_leave_the_bn(where):
    """register_hook stays on the old Parameter: the fold's new ones would silently drop it."""
    model = conv_bn()
    parameter = model[0].weight if where == "weight" else model[1].bias
    parameter.register_hook(lambda grad: grad)
    reason = left_reason(model, "1")
    assert "tensor hooks" in reason, reason


@pytest.mark.parametrize("register", ["register_module_full_backward_hook", "register_module_full_backward_pre_hook"])
def test_global_module_backward_hooks_leave_every_bn(register):
    model = conv_bn()
    handle = getattr(torch_module, register)(_noop)
    try:
        result = fused(model)
    finally:
        handle.remove()
    assert bn_left(result.model) == ["1"]
    reason = result.report.fusion["left"]["1"]
    assert "global module backward hooks are registered" in reason and register in reason, reason
    assert bn_left(fused(model).model) == []


class TrainOnlyBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.extra = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.extra(y) if self.training else y


def test_a_global_hook_does_not_hide_a_bn_s_own_reason():
    """A BN that could never fold keeps its own reason; the global hook is the reason for the others."""
    torch.manual_seed(0)
    model = TrainOnlyBranch().eval()
    handle = torch_module.register_module_forward_hook(_noop)
    try:
        left = fused(model).report.fusion["left"]
    finally:
        handle.remove()
    assert "global module forward hooks" in left["bn"], left
    assert "not called in eval mode" in left["extra"], left


def test_loading_a_fused_file_into_a_hooked_model_is_a_usage_error_naming_the_hook(tmp_path, factory):
    """The file is fine: the model passed has a hook a fold would change (it was exit 4, blaming the file)."""
    out = tmp_path / "m.fused.safetensors"
    assert run("convert", factory, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out).exit_code == 0
    from hooks_model import build

    model = build()
    model[1].register_forward_hook(_noop)
    with pytest.raises(HookedModelError) as raised:
        bnsurgeon.load(out, model=model)
    assert raised.value.exit_code == 2 and "1 -> 0" in raised.value.message, raised.value.message
    assert "forward hooks" in raised.value.message and "RemovableHandle" in str(raised.value)
    handle = torch_module.register_module_full_backward_hook(_noop)
    try:
        with pytest.raises(HookedModelError, match="global module backward hooks"):
            bnsurgeon.load(out, model=build())
    finally:
        handle.remove()
    assert bn_left(bnsurgeon.load(out, model=build())) == []


def test_loading_a_fused_file_refuses_a_hooked_container_around_only_the_bn():
    """Its pre-hook is handed the conv's output; folded, the BN's. Loading has no dataflow to tell,
    so a hooked module holding one side of a fold is refused; a block holding both loads."""
    torch.manual_seed(0)
    model = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))).eval()
    folds = fused(model).report.fusion["folded"]
    hooked = perturb_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))).eval()
    hooked[1].register_forward_pre_hook(_noop)
    with pytest.raises(HookedModelError, match="holds the BN but not the other"):
        bnsurgeon.convert(hooked, "fused", folds=folds)
    block = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), nn.ReLU()).eval()
    block[0].register_forward_hook(_noop)
    block_folds = [{**fold, "bn": "0.1", "producer": "0.0"} for fold in folds]
    assert bn_left(bnsurgeon.convert(block, "fused", folds=block_folds).model) == []


# ------------------------------------------------------------------ copies do not share hook dicts


def test_a_hook_added_to_a_converted_copy_never_reaches_the_source():
    """copy.copy shares a module's hook dicts: a hook registered on the converted root (or a new
    sync layer) ran on the source model too."""
    torch.manual_seed(0)
    source = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), nn.ReLU())
    converted = bnsurgeon.convert(source, "sync").model
    assert converted is not source
    calls = []
    converted.register_forward_hook(lambda *args: calls.append("root"))
    converted[0].register_forward_pre_hook(lambda *args: calls.append("block"))
    converted[0][1].register_full_backward_hook(_noop)
    converted[0][1]._register_state_dict_hook(_noop)
    source(torch.randn(2, 3, 8, 8))
    assert calls == []
    assert not any(
        getattr(m, name)
        for m in source.modules()
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks")
    )


def test_a_folded_producer_copy_owns_its_hook_dicts():
    model = conv_bn()
    folded = fused(model).model
    folded[0].register_full_backward_hook(_noop)
    folded[0].register_load_state_dict_post_hook(_noop)
    assert not model[0]._backward_hooks and not model[0]._load_state_dict_post_hooks


def test_hooks_on_a_converted_bn_still_answer_to_their_handles():
    """The guard: a hook the user registered before converting moves with the BN, and its handle removes it."""
    model = conv_bn()
    calls = []
    handle = model[1].register_forward_hook(lambda *args: calls.append(1))
    converted = bnsurgeon.convert(model, "plain").model
    converted(torch.randn(2, 3, 8, 8))
    assert calls == [1]
    handle.remove()
    converted(torch.randn(2, 3, 8, 8))
    assert calls == [1]


# ------------------------------------------------------------------ bounded, true, singular messages


def test_messages_and_hints_are_bounded_and_the_cut_count_is_true():
    error = BnSurgeonError("m" * 5000, "h" * 3000)
    assert len(error.message) == MAX_TEXT and error.message.endswith("... (4,027 more characters)"), error.message[-40:]
    assert len(error.hint) <= MAX_TEXT
    once = bounded("x" * 5000)
    assert bounded(once) == once
    twice = bounded(once, 500)
    assert twice.count("x") + int(twice.rsplit("(", 1)[1].split()[0].replace(",", "")) == 5000


def _recorded(factory, tmp_path, note) -> object:
    out = tmp_path / "noted.safetensors"
    result = run(
        "convert", factory, "--to", "plain", "--input-shape", "2,3,8,8", "-o", out, "--model-arg", f"note={note!r}"
    )
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("note", ["10", "it's $HOME", "max"])
def test_the_confirmation_hint_retypes_each_value_exactly(tmp_path, factory, note):
    """Shell-quoted on the command line, a dict literal in Python: both give back the recorded value
    (``--model-arg note='10'`` reached the program as note=10, an int)."""
    out = _recorded(factory, tmp_path, note)
    result = run("convert", out, "--model", factory, "-o", tmp_path / "again.safetensors")
    assert result.exit_code == 10, result.output
    with pytest.raises(ConfirmationError) as raised:
        bnsurgeon.load(out, model=factory)
    words = shlex.split(raised.value.hint.split("confirm each with ", 1)[1].split(" (or all", 1)[0])
    assert words[0] == "--model-arg" and parse_model_args(words[1:]) == {"note": note}
    python = str(raised.value).split("pass model_args=", 1)[1].split(" (or all", 1)[0]
    assert ast.literal_eval(python) == {"note": note}
    assert bnsurgeon.load(out, model=factory, model_args=ast.literal_eval(python)) is not None


def test_a_recorded_value_too_long_to_retype_points_to_accept_recorded_args(tmp_path, factory):
    out = _recorded(factory, tmp_path, "n" * 100_000)
    result = run("convert", out, "--model", factory, "-o", tmp_path / "again.safetensors")
    assert result.exit_code == 10 and "Traceback" not in result.output, result.output[-500:]
    assert len(result.output) < 3 * MAX_TEXT, len(result.output)
    flat = " ".join(result.output.split())
    assert "--accept-recorded-args" in flat and "cannot be retyped" in flat, flat
    with pytest.raises(ConfirmationError, match="accept_recorded_args=True"):
        bnsurgeon.load(out, model=factory)


def test_many_recorded_values_too_long_together_give_a_whole_hint_not_a_cut_one(tmp_path, factory):
    """Each of 8 values fits 200 characters, together they do not fit a message: a cut
    --model-arg list would be a wrong command."""
    from bnsurgeon.loading.architecture import Architecture
    from bnsurgeon.loading.trust import confirm_architecture

    recorded = Architecture("factory", factory, {f"arg{i}": "v" * 150 for i in range(8)})
    with pytest.raises(ConfirmationError) as raised:
        confirm_architecture(recorded, "f.safetensors", factory)
    assert "more characters" not in raised.value.hint and "more characters" not in raised.value.python
    assert "--accept-recorded-args" in raised.value.hint and "accept_recorded_args=True" in str(raised.value)
    odd = Architecture("factory", factory, {"a=b": 1})
    with pytest.raises(ConfirmationError, match="cannot be retyped"):
        confirm_architecture(odd, "f.safetensors", factory)


def test_a_huge_recorded_key_is_bounded_in_the_description():
    from bnsurgeon.loading.architecture import Architecture

    text = Architecture("timm", "resnet18", {"k" * 100_000: 1}).describe()
    assert len(text) < 400, len(text)


def test_a_timm_checkpoint_with_a_huge_integer_arg_gets_a_line_not_a_traceback(tmp_path):
    """repr() of an int of more than 4300 digits raises ValueError: the message and the hint crashed."""
    import argparse

    import timm

    path = tmp_path / "train.pth"
    args = argparse.Namespace(num_classes=10**5000)
    torch.save({"arch": "resnet18", "args": args, "state_dict": timm.create_model("resnet18").state_dict()}, path)
    result = run("inspect", path, "--trust-pickle")
    assert result.exit_code == 4 and "Traceback" not in result.output, result.output[-800:]
    assert "<int of 16,610 bits>" in result.output and "num_classes" in result.output, result.output


def test_every_cli_option_has_its_python_keyword():
    """Hints name flags; str(error) names the keyword a Python caller passes. Each keyword must
    exist on the function the command calls."""
    from bnsurgeon import pipeline
    from bnsurgeon.loading.sources import load_source

    output_only = {"--json", "--quiet", "--verbose", "--output", "--version", "--rules"}
    takes = {
        "convert": set(inspect.signature(pipeline.convert_source).parameters),
        "verify": set(inspect.signature(pipeline.verify).parameters),
        "inspect": set(inspect.signature(pipeline.inspect).parameters) | set(inspect.signature(load_source).parameters),
    }
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        for parameter in inspect.signature(command.callback).parameters.values():
            flags = [d for d in getattr(parameter.default, "param_decls", None) or () if d.startswith("--")]
            for flag in flags:
                if flag in output_only or name not in takes:
                    continue
                assert flag in FLAG_KEYWORDS, f"{name} {flag}"
                keyword = FLAG_KEYWORDS[flag].split("=")[0]
                assert keyword in takes[name] | takes["inspect"], f"{name} {flag} -> {keyword}"


def test_counts_of_one_are_singular():
    from bnsurgeon.cli.render import fusion_summary

    model = conv_bn()
    summary = fusion_summary(fused(model).report.fusion)
    assert "1 BN folded into its producer," in summary, summary
    result = run("inspect", "resnet18")
    assert result.exit_code == 0 and "BN-family modules in 1 class" in result.output, result.output
    with pytest.raises(BnSurgeonError, match="keep all 1 BatchNorm module: nothing"):
        bnsurgeon.convert(model, "plain", exclude=("*",))


def test_verify_takes_example_input_as_a_path_like_the_cli(tmp_path, factory):
    out = tmp_path / "m.fused.safetensors"
    assert run("convert", factory, "--to", "fused", "--input-shape", "2,3,8,8", "-o", out).exit_code == 0
    example = tmp_path / "x.pt"
    torch.save(torch.randn(3, 3, 9, 9), example)
    from bnsurgeon import api

    result = api.verify(factory, str(out), converted_model=factory, example_input=str(example))
    assert result.passed, result.to_dict()
    assert "3, 3, 9, 9" in json.dumps(result.to_dict()), result.to_dict()
