"""`inspect`'s column for what transformers' `replace_batch_norm` (DETR family: every nn.BatchNorm2d
becomes a <Model>FrozenBatchNorm2d holding copies of weight, bias and running stats, eps hard-coded
1e-5) would break. The column is read from module anatomy without transformers; each claim is
checked here against the real function applied to a copy."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from _forked import run_python
from torch import nn
from typer.testing import CliRunner

from bnsurgeon.checks.verify import perturb_bn
from bnsurgeon.cli.commands import app
from bnsurgeon.surgery.inspection import TRANSFORMERS_OK, inspect_model

runner = CliRunner()


def _replace_batch_norm():
    pytest.importorskip("transformers")
    from transformers.models.detr.modeling_detr import replace_batch_norm

    return replace_batch_norm


class Doubled(nn.BatchNorm2d):
    """A BN subclass with a forward of its own."""

    def forward(self, x):
        return super().forward(x) * 2


class Renamed(nn.BatchNorm2d):
    """A BN subclass that keeps BatchNorm2d's forward."""


def _bn_act(**kwargs):
    from timm.layers import BatchNormAct2d

    return BatchNormAct2d(4, **kwargs)


def _hooked():
    bn = nn.BatchNorm2d(4)
    bn.register_forward_hook(lambda m, args, out: out + 1)
    return bn


# name -> (the BN module under test, the exact column text for a model holding just that one)
CASES = {
    "plain": (lambda: nn.BatchNorm2d(4), TRANSFORMERS_OK),
    "subclass keeping forward": (lambda: Renamed(4), TRANSFORMERS_OK),
    "eps 1e-3": (lambda: nn.BatchNorm2d(4, eps=1e-3), "eps 0.001 -> 1e-05"),
    "BatchNormAct2d SiLU": (lambda: _bn_act(act_layer=nn.SiLU), "drops act=SiLU"),
    "BatchNormAct2d SiLU eps 1e-3": (
        lambda: _bn_act(act_layer=nn.SiLU, eps=1e-3),
        "drops act=SiLU; eps 0.001 -> 1e-05",
    ),
    "BatchNormAct2d identity act": (lambda: _bn_act(apply_act=False), TRANSFORMERS_OK),
    "BatchNormAct2d dropout": (
        lambda: _bn_act(apply_act=False, drop_layer=nn.Dropout),
        "drops drop=Dropout (train only)",
    ),
    "own forward": (lambda: Doubled(4), "drops Doubled.forward"),
    "forward hook": (_hooked, "drops 1 hook"),
    "bfloat16": (lambda: nn.BatchNorm2d(4).to(torch.bfloat16), "float32 buffers (was bfloat16)"),
    "affine off": (lambda: nn.BatchNorm2d(4, affine=False), "fails (affine=False: it reads weight.device)"),
    "no running stats": (lambda: nn.BatchNorm2d(4, track_running_stats=False), "fails (no running stats to copy)"),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), "not replaced (not a BatchNorm2d)"),
    "torch SyncBatchNorm": (lambda: nn.SyncBatchNorm(4), "not replaced (not a BatchNorm2d)"),
    "torchvision FrozenBatchNorm2d": (
        lambda: __import__("torchvision").ops.FrozenBatchNorm2d(4),
        "not replaced (not a BatchNorm2d)",
    ),
}


def _model(make) -> nn.Module:
    torch.manual_seed(0)
    bn = make()
    dtype = next(iter(bn.buffers()), torch.zeros(())).dtype
    model = nn.Sequential()
    model.bn = bn
    return perturb_bn(model).to(dtype).eval()  # BN state away from the identity, so a lost piece shows


def _column(model: nn.Module) -> str:
    (group,) = inspect_model(model).groups
    return group.transformers_replace


def _input(model: nn.Module) -> torch.Tensor:
    dims = 2 if isinstance(model.bn, nn.BatchNorm1d) else 4
    shape = (3, 4, 5, 5)[:dims]
    dtype = next(iter(model.bn.buffers()), torch.zeros(())).dtype
    return (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_column_text_and_what_replace_batch_norm_really_does(case):
    """The column's claim, then the real function on a copy: "ok" = the eval output within float32
    rounding; a defect that acts in eval = the output moves (or changes dtype); "fails" = it raises;
    "not replaced" = the module is the same object; "train only" = the eval output does not move."""
    replace_batch_norm = _replace_batch_norm()
    make, expected = CASES[case]
    model = _model(make)
    column = _column(model)
    assert column == expected
    x = _input(model)
    with torch.no_grad():
        before = model(x.clone())
        replaced = copy.deepcopy(model)
        if column.startswith("fails"):
            with pytest.raises((AttributeError, TypeError)):
                replace_batch_norm(replaced)
            return
        replace_batch_norm(replaced)
        if column.startswith("not replaced"):
            assert type(replaced.bn) is type(model.bn) and torch.equal(replaced(x.clone()), before)
            return
        assert type(replaced.bn).__name__ == "DetrFrozenBatchNorm2d"
        after = replaced(x.clone())
    if column == TRANSFORMERS_OK or column.endswith("(train only)"):
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    elif column.startswith("float32 buffers"):
        assert after.dtype == torch.float32 and before.dtype == torch.bfloat16
    else:
        assert (after - before).abs().max() > 1e-3, "the column says broken but the output did not move"


def test_a_class_whose_members_differ_counts_each_defect():
    model = nn.Sequential(
        nn.BatchNorm2d(4), nn.BatchNorm2d(4, eps=1e-3), nn.BatchNorm2d(4, eps=1e-3), nn.BatchNorm2d(4, affine=False)
    )
    assert _column(model) == (
        f"eps 0.001 -> 1e-05 (2/4); fails (affine=False: it reads weight.device) (1/4); {TRANSFORMERS_OK} (1/4)"
    )


def test_the_root_is_not_replaced():
    """replace_batch_norm walks children: a BN handed to it as the model stays."""
    replace_batch_norm = _replace_batch_norm()
    bn = nn.BatchNorm2d(4)
    assert _column(bn) == "not replaced (the root: only children are)"
    replace_batch_norm(bn)
    assert type(bn) is nn.BatchNorm2d


def test_efficientnet_b0_loses_its_activations_and_the_outputs_move():
    replace_batch_norm = _replace_batch_norm()
    import timm

    torch.manual_seed(0)
    model = perturb_bn(timm.create_model("efficientnet_b0", pretrained=False, num_classes=4)).eval()
    column = _column(model)
    assert column.startswith("drops act=SiLU (") and "eps" not in column  # the bn3 of each block has no act
    assert re.fullmatch(r"drops act=SiLU \((\d+)/49\); ok \(frozen; eval within rounding\) \((\d+)/49\)", column)
    replaced = copy.deepcopy(model)
    replace_batch_norm(replaced)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (replaced(x) - model(x)).abs().max() > 1e-2


def test_cli_table_and_json_carry_the_column():
    result = runner.invoke(app, ["inspect", "tf_efficientnet_b3"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    # off a terminal every column keeps its full header (HF replace_bn is the header shortened for a terminal)
    assert (
        "transformers replace_batch_norm" in result.output
        and "drops act=SiLU (52/78); eps 0.001 -> 1e-05" in result.output
    )
    result = runner.invoke(app, ["inspect", "resnet18", "--json", "-q"])
    (group,) = json.loads(result.stdout)["groups"]
    assert group["cls"] == "torch.nn.modules.batchnorm.BatchNorm2d" and group["transformers_replace"] == TRANSFORMERS_OK


def test_the_column_needs_no_transformers():
    """In a process where importing transformers fails, the column is still there."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ImportError('transformers is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from timm.layers import BatchNormAct2d\n"
        "from bnsurgeon.surgery.inspection import inspect_model\n"
        "model = torch.nn.Sequential(BatchNormAct2d(4, act_layer=torch.nn.SiLU, eps=1e-3))\n"
        "print(inspect_model(model).groups[0].transformers_replace)\n"
        "assert not any(m == 'transformers' or m.startswith('transformers.') for m in sys.modules)\n"
    )
    done = run_python(code, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "drops act=SiLU; eps 0.001 -> 1e-05"


def test_every_replace_batch_norm_in_transformers_is_the_one_the_column_describes():
    """The column is computed without transformers, for the function every DETR-family module has:
    read their source (no import), the same function modulo the class name, and 1e-5 hard-coded."""
    transformers = pytest.importorskip("transformers")
    found = 0
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        match = re.search(r"^def replace_batch_norm\(model\):\n(?:(?:    .*)?\n)+", text, re.M)
        if match is None:
            continue
        found += 1
        body = match.group(0)
        frozen = re.search(r"new_module = (\w+FrozenBatchNorm2d)\(module\.num_features\)", body)
        assert frozen, path
        assert "isinstance(module, nn.BatchNorm2d)" in body and "model.named_children()" in body, path
        copied = set(re.findall(r"new_module\.(\w+)\.copy_\(module\.\1\)", body))
        assert copied == {"weight", "bias", "running_mean", "running_var"}, path
        cls = re.search(rf"^class {frozen.group(1)}\(nn\.Module\):\n(?:(?:    .*)?\n)+", text, re.M)
        assert cls and "epsilon = 1e-5" in cls.group(0) and "def __init__(self, n):" in cls.group(0), path
    assert found >= 10, "transformers' DETR family was not found"
