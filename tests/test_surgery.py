"""Every rule x target, and every property surgery must preserve."""

from __future__ import annotations

import pytest
import torch
from timm.layers import BatchNormAct2d, FrozenBatchNormAct2d
from timm.layers import SyncBatchNormAct as TimmSyncBatchNormAct
from torch import nn
from torchvision.ops.misc import FrozenBatchNorm2d

import bnsurgeon
from bnsurgeon.core.errors import LazyModuleError, UnhandledModuleError, UsageError
from bnsurgeon.runtime import FrozenBatchNorm, FrozenBatchNormAct, SyncBatchNorm, SyncBatchNormAct


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BN statistics and affine values: fresh BN is near identity and hides bugs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name in ("weight", "bias", "running_mean"):
                tensor = getattr(module, name, None)
                if isinstance(tensor, torch.Tensor) and "Norm" in type(module).__name__:
                    tensor.copy_(
                        torch.randn(tensor.shape, generator=generator) * 0.5 + (1.0 if name == "weight" else 0.0)
                    )
            running_var = getattr(module, "running_var", None)
            if isinstance(running_var, torch.Tensor):
                running_var.copy_(torch.rand(running_var.shape, generator=generator) + 0.5)
    return model


class Net(nn.Module):
    """Every BN flavour in one model: 1d/2d/3d, norm-act, frozen, shared, nested."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.bnact = BatchNormAct2d(8, act_layer=nn.SiLU)
        self.frozen = FrozenBatchNorm2d(8)
        self.shared = nn.BatchNorm2d(8)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 1), self.shared)  # same module reached twice
        self.bn3 = nn.BatchNorm3d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.bn1 = nn.BatchNorm1d(8)

    def forward(self, x):
        x = self.frozen(self.bnact(self.bn(self.conv(x))))
        x = self.shared(self.block(x))
        x = self.bn3(x.unsqueeze(2)).squeeze(2)
        return self.bn1(self.pool(x).flatten(1))


def _eval_out(model, x):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train(was)
    return out


@pytest.fixture
def net():
    torch.manual_seed(0)
    return randomize(Net())


X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def test_sync_targets_per_class(net):
    model = bnsurgeon.convert(net, "sync").model
    assert type(model.bn) is SyncBatchNorm and type(model.bn3) is SyncBatchNorm and type(model.bn1) is SyncBatchNorm
    assert type(model.bnact) is SyncBatchNormAct and isinstance(model.bnact.act, nn.SiLU)
    assert type(model.frozen) is FrozenBatchNorm2d, "frozen BN is kept frozen by default"
    assert torch.equal(_eval_out(net, X), _eval_out(model, X))


def test_source_is_untouched_and_tensors_are_shared(net):
    before = {k: v.clone() for k, v in net.state_dict().items()}
    result = bnsurgeon.convert(net, "sync")
    assert type(net.bn) is nn.BatchNorm2d and type(net.bnact) is BatchNormAct2d
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert result.model.conv is net.conv, "modules with no BN below them are shared, not copied"
    assert result.model.bn.weight is net.bn.weight and result.model.bn.running_var is net.bn.running_var


def test_parameter_identity_requires_grad_and_optimizer_refs_survive(net):
    net.bn.weight.requires_grad_(False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model = bnsurgeon.convert(net, "sync").model
    assert model.bn.weight is net.bn.weight and not model.bn.weight.requires_grad
    assert model.bnact.bias is net.bnact.bias
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in model.parameters() if p.requires_grad} <= in_optimizer


def test_dtype_device_and_buffer_values_preserved(net):
    net = net.to(torch.float64)
    model = bnsurgeon.convert(net, "sync").model
    assert model.bn.weight.dtype == torch.float64 and model.bn.running_mean.dtype == torch.float64
    assert model.bn.num_batches_tracked is net.bn.num_batches_tracked
    assert model.bn.weight.device == net.bn.weight.device


def test_training_flags_per_module_preserved(net):
    net.train()
    net.bn.eval()
    net.bnact.act.eval()
    model = bnsurgeon.convert(net, "sync").model
    assert model.training and not model.bn.training and model.bnact.training and not model.bnact.act.training


def test_hooks_preserved_and_handles_still_work(net):
    calls = []
    handle = net.bn.register_forward_hook(lambda m, i, o: calls.append("fwd"))
    net.bn.register_forward_pre_hook(lambda m, i: calls.append("pre"))
    model = bnsurgeon.convert(net, "sync").model
    _eval_out(model, X)
    assert calls == ["pre", "fwd"]
    handle.remove()
    calls.clear()
    _eval_out(model, X)
    assert calls == ["pre"]


def test_sharing_preserved(net):
    model = bnsurgeon.convert(net, "sync").model
    assert model.shared is model.block[1]
    change = next(c for c in bnsurgeon.convert(net, "sync").report.changed if c.path == "shared")
    assert change.aliases == ["block.1"]


def test_children_act_and_drop_kept_as_the_same_objects():
    module = BatchNormAct2d(4, act_layer=nn.Hardswish, drop_layer=lambda: nn.Dropout(0.1))
    converted = bnsurgeon.convert(nn.Sequential(module), "sync").model[0]
    assert converted.act is module.act and converted.drop is module.drop


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d])
def test_plain_restores_exact_original_class(cls):
    model = randomize(nn.Sequential(cls(6)))
    synced = bnsurgeon.convert(model, "sync").model
    assert type(synced[0]) is SyncBatchNorm
    restored = bnsurgeon.convert(synced, "plain").model
    assert type(restored[0]) is cls
    assert restored[0].weight is model[0].weight


def test_plain_restores_batchnormact_with_act_and_drop(net):
    restored = bnsurgeon.convert(bnsurgeon.convert(net, "sync").model, "plain").model
    assert type(restored.bnact) is BatchNormAct2d and isinstance(restored.bnact.act, nn.SiLU)
    assert type(restored.bn3) is nn.BatchNorm3d and type(restored.bn1) is nn.BatchNorm1d
    assert restored.state_dict().keys() == net.state_dict().keys()
    assert torch.equal(_eval_out(net, X), _eval_out(restored, X))


def test_frozen_target_is_bit_identical_to_source_eval_in_train_mode(net):
    frozen = bnsurgeon.convert(net, "frozen").model
    assert type(frozen.bn) is FrozenBatchNorm and type(frozen.bnact) is FrozenBatchNormAct
    assert not any(p is frozen.bn.weight for p in frozen.parameters())
    expected = _eval_out(net, X)
    frozen.train()
    with torch.no_grad():
        assert torch.equal(frozen(X), expected)
    back = bnsurgeon.convert(frozen, "plain").model
    assert type(back.bn) is nn.BatchNorm2d and type(back.bnact) is BatchNormAct2d
    assert back.state_dict().keys() == net.state_dict().keys(), "num_batches_tracked survives the round trip"


def test_frozen_unfreeze_gives_trainable_sync(net):
    result = bnsurgeon.convert(net, "sync", frozen="unfreeze")
    module = result.model.frozen
    assert type(module) is SyncBatchNorm and module.weight.requires_grad
    assert "frozen.num_batches_tracked" in result.report.keys_added
    assert not result.exact, "torchvision's x*scale+shift arithmetic is only close to batch_norm"
    torch.testing.assert_close(_eval_out(result.model, X), _eval_out(net, X), rtol=1e-4, atol=1e-5)


def test_timm_frozen_act_and_timm_sync_act_rules():
    frozen = FrozenBatchNormAct2d(4, act_layer=nn.ReLU)
    timm_sync = TimmSyncBatchNormAct(4)
    timm_sync.act, timm_sync.drop = nn.GELU(), nn.Identity()
    model = nn.Sequential(timm_sync, frozen)
    converted = bnsurgeon.convert(model, "sync", frozen="unfreeze").model
    assert type(converted[0]) is SyncBatchNormAct and isinstance(converted[0].act, nn.GELU)
    assert type(converted[1]) is SyncBatchNormAct and converted[1].act is frozen.act
    plain = bnsurgeon.convert(model, "plain", frozen="unfreeze").model
    assert type(plain[0]) is BatchNormAct2d and type(plain[1]) is BatchNormAct2d


def test_torch_syncbatchnorm_to_plain_notes_unknown_dimensionality():
    result = bnsurgeon.convert(nn.Sequential(nn.SyncBatchNorm(4)), "plain")
    assert type(result.model[0]) is nn.BatchNorm2d
    assert any("dimensionality unknown" in note for note in result.report.changed[0].notes)


def test_already_target_is_kept_not_rebuilt(net):
    synced = bnsurgeon.convert(net, "sync").model
    again = bnsurgeon.convert(synced, "sync")
    assert again.model is synced and not again.report.changed
    assert {k.reason for k in again.report.kept} >= {"already sync"}


def test_process_group_regroups_an_already_sync_model(net):
    synced = bnsurgeon.convert(net, "sync").model
    group = object()  # any process-group handle; only stored here
    regrouped = bnsurgeon.convert(synced, "sync", process_group=group).model
    assert regrouped.bn.process_group is group and regrouped.bnact.process_group is group
    assert regrouped.bn.weight is net.bn.weight and isinstance(regrouped.bnact.act, nn.SiLU)
    assert synced.bn.process_group is None, "copy-on-write: the input model keeps its group"


class MyBN(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 2


class LooksLikeBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))


def test_unknown_bn_subclass_refused_with_path_and_class():
    model = nn.Sequential(nn.BatchNorm2d(3), MyBN(3), nn.Sequential(LooksLikeBN()))
    with pytest.raises(UnhandledModuleError) as info:
        bnsurgeon.convert(model, "sync")
    assert "1 (MyBN)" in str(info.value) and "2.0 (LooksLikeBN)" in str(info.value)
    result = bnsurgeon.convert(model, "sync", allow_unhandled=True)
    assert type(result.model[0]) is SyncBatchNorm and type(result.model[1]) is MyBN
    assert [u.path for u in result.report.unhandled] == ["1", "2.0"]


def test_instance_norm_is_not_bn_like():
    model = nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True))
    assert bnsurgeon.convert(model, "sync").report.totals["unhandled"] == 0


def test_uninitialized_lazy_bn_refused_initialized_one_converts():
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    with pytest.raises(LazyModuleError, match="0 \\(LazyBatchNorm2d\\)"):
        bnsurgeon.convert(lazy, "sync")
    lazy(torch.randn(2, 3, 4, 4))
    assert type(bnsurgeon.convert(lazy, "sync").model[0]) is SyncBatchNorm


def test_root_module_itself_can_be_bn():
    bn = nn.BatchNorm2d(3)
    assert type(bnsurgeon.convert(bn, "sync").model) is SyncBatchNorm


def test_inplace_mutates_the_given_model(net):
    result = bnsurgeon.convert(net, "sync", inplace=True)
    assert result.model is net and type(net.bn) is SyncBatchNorm


def test_bad_target_and_policy_rejected(net):
    with pytest.raises(UsageError, match="unknown target 'sideways'"):
        bnsurgeon.convert(net, "sideways")
    with pytest.raises(UsageError, match="unknown frozen policy"):
        bnsurgeon.convert(net, "sync", frozen="melt")


def test_user_rule_from_python():
    from bnsurgeon.rules import Registry, Rule, builtin_rules, keep_if, to_frozen, to_sync

    registry = Registry(builtin_rules())
    registry.register(Rule("my-bn", (MyBN,), {"sync": to_sync, "plain": keep_if("plain"), "frozen": to_frozen}))
    result = bnsurgeon.convert(nn.Sequential(MyBN(3)), "sync", registry=registry)
    assert type(result.model[0]) is SyncBatchNorm and result.report.changed[0].rule == "my-bn"
    with pytest.raises(UsageError, match="no builder for target"):
        registry.register(Rule("half", (LooksLikeBN,), {"sync": to_sync}))


def test_user_rule_from_entry_point(monkeypatch):
    import bnsurgeon.rules as rules_module
    from bnsurgeon.rules import Rule, keep_if, to_sync

    class FakeEntryPoint:
        name = "mine"

        def load(self):
            return lambda: [
                Rule("entry-bn", (MyBN,), {"sync": to_sync, "plain": keep_if("plain"), "frozen": keep_if("frozen")})
            ]

    import importlib.metadata

    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group=None: [FakeEntryPoint()] if group == "bnsurgeon.rules" else []
    )
    monkeypatch.setattr(rules_module, "_default", None)
    try:
        assert rules_module.default_registry().lookup(MyBN).name == "entry-bn"
    finally:
        rules_module._default = None


def test_efficientnet_keeps_silu_where_torch_converter_drops_it():
    import timm

    torch.manual_seed(0)
    model = randomize(timm.create_model("efficientnet_b0", pretrained=False, num_classes=10))
    x = torch.randn(2, 3, 64, 64)
    ours = bnsurgeon.convert(model, "sync").model
    assert torch.equal(_eval_out(model, x), _eval_out(ours, x))
    import copy

    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))  # it mutates its argument
    assert not torch.allclose(_eval_out(model, x), _eval_out(theirs, x), atol=1e-3), "torch's converter loses the act"


class _ListHeld(nn.Module):
    """Children registered and also kept in a plain list the forward iterates (transformers' UperNet)."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)]
        self.by_name = {"norm": self.layers[1]}
        for index, layer in enumerate(self.layers):
            self.add_module(str(index), layer)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x + 0 * self.by_name["norm"].running_mean.sum()


@pytest.mark.parametrize("inplace", [False, True])
def test_modules_also_held_in_plain_containers_are_the_converted_ones(inplace):
    model = nn.Sequential(_ListHeld())
    source_list = model[0].layers
    converted = bnsurgeon.convert(model, "sync", inplace=inplace).model
    block = converted[0]
    assert isinstance(block.layers[1], SyncBatchNorm) and block.layers[1] is block._modules["1"]
    assert block.by_name["norm"] is block._modules["1"]
    if not inplace:  # the source keeps its own list and plain BN
        assert model[0].layers is source_list and type(source_list[1]) is nn.BatchNorm2d
    converted.train()(torch.randn(4, 3, 8, 8))
    assert int(block._modules["1"].num_batches_tracked) == 1  # the forward ran the converted BN
