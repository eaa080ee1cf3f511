"""`verify` names the module whose own output differs, also when a later in-place op (a residual
`+=`, an in-place activation) rewrites the tensor a module returned. Issue 30: with an HF ResNet
whose shortcut BN differs, verify blamed the main branch's last `normalization`, because
`hidden_state += residual` added the divergent shortcut into the tensor its hook had kept."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bnsurgeon
from bnsurgeon.checks.verify import check_eval, first_divergent_module

SHORTCUT = "resnet.encoder.stages.1.layers.0.shortcut.normalization"


def _hf_resnet(layer_type: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, layer_type=layer_type
    )
    return transformers.ResNetForImageClassification(config).eval()


@pytest.mark.parametrize("layer_type", ["basic", "bottleneck"])
def test_hf_resnet_shortcut_bn_is_named_not_the_main_branch_bn_it_is_added_into(layer_type):
    source = _hf_resnet(layer_type)
    converted = copy.deepcopy(bnsurgeon.convert(source).model)  # a copy: the conversion shares the source's tensors
    with torch.no_grad():
        converted.get_submodule(SHORTCUT).bias.add_(0.5)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert first_divergent_module(source, converted, x) == f"{SHORTCUT} (SyncBatchNorm; in the source BatchNorm2d)"
    outcome = check_eval(source, converted, (2, 3, 32, 32))  # what `bnsurgeon verify` reports
    assert outcome.passed is False
    assert outcome.first_divergence == f"{SHORTCUT} (SyncBatchNorm; in the source BatchNorm2d)"


def test_hf_resnet_unchanged_conversion_has_no_divergent_module():
    source = _hf_resnet("basic")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert first_divergent_module(source, bnsurgeon.convert(source).model, x) is None


class Block(nn.Module):
    """A residual block that adds the shortcut into the main branch's BN output in place, then an
    in-place ReLU: both rewrite tensors that earlier modules returned."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += self.down(x)
        return self.act(out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.block = Block(4, 6)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 2))

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def _broken(model: nn.Module, path: str, **changes: float) -> nn.Module:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        for name, value in changes.items():
            getattr(broken.get_submodule(path), name).add_(value)
    return broken


def test_in_place_residual_add_blames_the_shortcut_bn():
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    assert first_divergent_module(model, copy.deepcopy(model), x) is None
    broken = _broken(model, "block.down.1", bias=0.5)
    assert first_divergent_module(model, broken, x) == "block.down.1 (BatchNorm2d; in the source BatchNorm2d)"


def test_in_place_relu_cannot_hide_a_difference_it_clamps_away():
    """The stem BN differs only in a channel the in-place ReLU then zeroes: the output the BN
    returned differs all the same, and it is the first difference, before the shortcut BN's."""
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.stem[1].bias[0] = -100.0  # channel 0 of the stem BN's output is negative everywhere
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.stem[1].bias[0] -= 1.0  # still negative everywhere: the same after the ReLU
        broken.block.down[1].bias.add_(0.5)
    assert not torch.equal(model(x), broken(x))
    assert first_divergent_module(model, broken, x) == "stem.1 (BatchNorm2d; in the source BatchNorm2d)"


def test_tuple_and_model_output_results_are_taken_when_returned():
    """A module returning a tuple holding a ModelOutput; the caller adds a later BN's output into
    the ModelOutput's tensor in place. The later BN is named, not the module that returned the tuple."""
    transformers = pytest.importorskip("transformers")

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            y = self.bn(x)
            return y, transformers.modeling_outputs.BaseModelOutput(last_hidden_state=y * 2)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()
            self.side = nn.BatchNorm2d(3)
            self.after = nn.BatchNorm2d(3)

        def forward(self, x):
            y, out = self.pair(x)
            out.last_hidden_state += self.side(x)
            return self.after(out.last_hidden_state + y)

    torch.manual_seed(0)
    model = Outer().eval()
    x = torch.randn(2, 3, 4, 4)
    assert first_divergent_module(model, copy.deepcopy(model), x) is None
    for path in ("side", "pair.bn", "after"):
        broken = _broken(model, path, bias=1.0)
        assert first_divergent_module(model, broken, x) == f"{path} (BatchNorm2d; in the source BatchNorm2d)"
