"""``bnsurgeon run`` and the torch ``nn.SyncBatchNorm`` layers a model builds itself (launch/built.py).

The 2-rank exactness of every way of building them is in test_run.py's one torchrun launch (section
``built``); these run in the test process: one process without a process group (torch's layer is plain BN
there, bit for bit, and stays torch's), and a world of one gloo rank, where torch's layer refuses CPU
tensors at DDP and bnsurgeon adopts it, refuses what it cannot adopt, and keeps what frameworks rely on.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import free_port, torchrun
from torch import nn
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app
from bnsurgeon.launch.converters import patched_converters
from bnsurgeon.launch.log import ConversionLog
from bnsurgeon.launch.script import put_back
from bnsurgeon.runtime.layers import SyncBatchNorm

CASES = Path(__file__).with_name("_run_cases.py")


def _case():
    import runpy

    return runpy.run_path(str(CASES), run_name="run_cases")


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        put_back()


def test_without_a_process_group_the_built_layers_stay_torchs_and_train_as_plain_bn():
    """One process, no torchrun (the configs users edit today): bit-identical to the model built with BatchNorm2d,
    outputs, gradients and statistics, and nothing adopted or said."""
    case = _case()
    x, g = case["data"]()
    log = ConversionLog(quiet=True)
    with patched_converters(log):
        for how in ["constructor", "registry", "get_norm"]:  # (unpickled: its class is not importable here)
            runs = []
            for model in (case["built_model"](how).train(), case["Built"]("plain").double().train()):
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                outputs = []
                for _ in range(2):
                    optimizer.zero_grad()
                    y = model(x)
                    (y * g).sum().backward()
                    optimizer.step()
                    outputs.append(y.detach())
                runs.append((outputs, model.state_dict()))
            (built_out, built_state), (plain_out, plain_state) = runs
            assert all(torch.equal(a, b) for a, b in zip(built_out, plain_out)), how
            assert built_state.keys() == plain_state.keys()
            assert all(torch.equal(built_state[k], plain_state[k]) for k in plain_state), how
            assert type(case["built_model"](how).bn1) is nn.SyncBatchNorm
    assert log.conversions == []


DDP_SCRIPT = """
    import sys
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    class MyBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    class OwnForward(nn.SyncBatchNorm):
        def forward(self, x):
            return super().forward(x) + 1

    extra = {"unhandled": MyBN(4), "own_forward": OwnForward(4), "none": nn.Identity()}[sys.argv[2]]
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4), extra)
    ddp = DistributedDataParallel(model)
    ddp(torch.randn(2, 3, 4, 4)).sum().backward()
    open(sys.argv[1], "w").write(type(model[1]).__module__)
"""


@pytest.mark.parametrize(
    "extra, words",
    [
        ("unhandled", ["no rule for", "2 (", "MyBN", "--allow-unhandled"]),
        ("own_forward", ["no rule for", "OwnForward"]),
    ],
)
def test_a_class_that_cannot_train_as_ours_stops_the_run_at_ddp(tmp_path, world_of_one, extra, words):
    """A BN class no rule claims beside a built SyncBatchNorm, or a SyncBatchNorm subclass with a forward of its
    own, stops the script where DDP wraps the model, in one line (exit 7), before it trains."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    marker = tmp_path / "trained"
    result = CliRunner().invoke(app, ["run", str(script), str(marker), extra])
    assert result.exit_code == 7, result.output
    assert "adopted at DistributedDataParallel (at train.py:" in result.output, result.output
    for word in words:
        assert word in result.output, (word, result.output)
    assert "Traceback" not in result.output and not marker.exists()


def test_a_subclass_whose_rule_builds_a_new_module_is_refused_not_adopted(monkeypatch):
    """A rule that claims a SyncBatchNorm subclass with a builder of its own cannot be honoured in place: the run
    refuses it (exit 7, the fix named) rather than running that class's layers as bnsurgeon's."""
    from bnsurgeon.core.errors import UnhandledModuleError
    from bnsurgeon.launch import built
    from bnsurgeon.rules import Registry, Rule, builtin_rules
    from bnsurgeon.rules.builders import to_frozen, to_plain

    class Custom(nn.SyncBatchNorm):
        pass

    rule = Rule("custom", (Custom,), {"sync": lambda m, c: m, "plain": to_plain, "frozen": to_frozen})
    monkeypatch.setattr("bnsurgeon.surgery.walk.default_registry", lambda: Registry([*builtin_rules(), rule]))
    log = ConversionLog(quiet=True)
    model = nn.Sequential(nn.SyncBatchNorm(2), Custom(2))
    with pytest.raises(UnhandledModuleError, match="1 \\(.*Custom") as raised:
        built.adopt_model(log, model, "train.py:3")
    assert "to_sync" in raised.value.hint and log.refusal is raised.value
    assert type(model[0]) is nn.SyncBatchNorm  # nothing changed


def test_a_world_of_one_trains_with_the_adopted_layer(tmp_path, world_of_one):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    marker = tmp_path / "trained"
    result = CliRunner().invoke(app, ["run", str(script), str(marker), "none"])
    assert result.exit_code == 0, result.output
    assert marker.read_text() == "bnsurgeon.runtime.layers"
    assert "adopted at DistributedDataParallel at train.py:" in result.output


CALLS: list[int] = []


def _count_call(*_: object) -> None:
    CALLS.append(1)


def test_an_adopted_layer_is_the_same_object_and_pickles_as_torchs_class():
    """Adoption keeps the object, its Parameters, buffers, hooks, requires_grad and keys; a whole model saved
    while it trains pickles torch's class (it loads without bnsurgeon); a deep copy (an EMA) stays adopted."""
    torch.manual_seed(0)
    layer = nn.SyncBatchNorm(3)
    layer.weight.requires_grad_(False)
    CALLS.clear()
    layer.register_forward_hook(_count_call)
    weight, mean, keys = layer.weight, layer.running_mean, list(layer.state_dict())
    adopted = SyncBatchNorm.adopt(layer, name="bn")
    assert adopted is layer and isinstance(layer, nn.SyncBatchNorm) and type(layer) is SyncBatchNorm
    assert layer.weight is weight and layer.running_mean is mean and list(layer.state_dict()) == keys
    assert not layer.weight.requires_grad
    layer(torch.randn(4, 3, 2, 2))
    assert CALLS == [1]
    data = pickle.dumps(layer)
    assert b"bnsurgeon" not in data
    back = pickle.loads(data)
    assert type(back) is nn.SyncBatchNorm and torch.equal(back.running_mean, layer.running_mean)
    buffer = io.BytesIO()
    torch.save(nn.Sequential(layer), buffer)
    assert b"bnsurgeon" not in buffer.getvalue()
    import copy

    assert type(copy.deepcopy(layer)) is SyncBatchNorm


def test_lightnings_revert_treats_an_adopted_layer_as_torchs():
    """After fit, Lightning's revert turns every nn.SyncBatchNorm into _BatchNormXd: an adopted layer too, as
    the original does with the layer the model built (the same Parameters)."""
    pytest.importorskip("lightning", reason="Lightning is in the test extra; absent here")
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4))
    weight = model[1].weight
    SyncBatchNorm.adopt(model[1])
    with patched_converters(ConversionLog(quiet=True)):
        reverted = TorchSyncBatchNorm().revert(model)
    assert type(reverted[1]).__name__ == "_BatchNormXd" and reverted[1].weight is weight


MMENGINE_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModel
from mmengine.runner import Runner

torch.cuda.set_device = lambda device: None  # mmengine's launcher pins a GPU: the one CPU patch


class Net(BaseModel):
    def __init__(self, norm_cfg):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn = build_norm_layer(norm_cfg, 4)[1]

    def forward(self, x, g, mode="loss"):
        world = int(os.environ.get("WORLD_SIZE", "1"))  # DDP averages: the whole batch's gradient
        return {"loss": (self.bn(self.conv(x)) * g).sum() * world}


def batches():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(8, 3, 6, 6, generator=generator, dtype=torch.float64)
    x[1::2] += 3
    g = torch.randn(8, 4, 4, 4, generator=generator, dtype=torch.float64)
    return [dict(x=x[i], g=g[i]) for i in range(8)]


runner = Runner(
    model=Net(dict(type=sys.argv[2])).double(),
    work_dir=sys.argv[1],
    train_dataloader=dict(dataset=batches(), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=4 // int(
        os.environ.get("WORLD_SIZE", "1")), collate_fn=dict(type="default_collate")),
    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
    train_cfg=dict(by_epoch=False, max_iters=2),
    launcher="pytorch" if "RANK" in os.environ else "none",
    env_cfg=dict(dist_cfg=dict(backend="gloo")),
    cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None, broadcast_buffers=False)),
    default_hooks=dict(logger=None, checkpoint=None),
)
runner.train()
bn = runner.model.module.bn if hasattr(runner.model, "module") else runner.model.bn
rank = dist.get_rank() if dist.is_initialized() else 0
torch.save({"mean": bn.running_mean, "var": bn.running_var, "cls": type(bn).__module__}, f"{sys.argv[1]}/rank{rank}.pt")
"""


@pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mmengine", "mmcv", "cv2")),
    reason="mmengine, mmcv and OpenCV are not installed (optional: pip install mmengine mmcv-lite)",
)
def test_mmengines_runner_trains_a_syncbn_norm_cfg_exactly_under_torchrun(tmp_path):
    """OpenMMLab's way: norm_cfg=dict(type='SyncBN') through mmcv's registry, trained by mmengine's Runner with its
    pytorch launcher on 2 gloo ranks (each half of the batch): the ranks' statistics are bit-identical and equal
    to one process of type='BN' on the whole batch. Without bnsurgeon run: torch's ValueError at DDP."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(MMENGINE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1")
    reference = tmp_path / "one"
    done = subprocess.run(
        [sys.executable, str(script), str(reference), "BN"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = tmp_path / "two"
    command = torchrun("-m", "bnsurgeon", "run", str(script), str(ranks), "SyncBN")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "adopted at DistributedDataParallel" in done.stderr
    one = torch.load(reference / "rank0.pt", weights_only=True)
    r0, r1 = (torch.load(ranks / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert r0["cls"] == "bnsurgeon.runtime.layers"
    for key in ("mean", "var"):
        assert torch.equal(r0[key], r1[key])
        torch.testing.assert_close(r0[key], one[key], rtol=1e-12, atol=1e-12)


DETECTRON2_SCRIPT = """
    import sys
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from detectron2.layers.batch_norm import FrozenBatchNorm2d

    model = nn.Sequential(nn.Conv2d(3, 4, 1), FrozenBatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.SyncBatchNorm(4))
    ddp = DistributedDataParallel(model)
    ddp(torch.randn(2, 3, 4, 4)).sum().backward()
    open(sys.argv[1], "w").write(type(model[3]).__module__ + " " + type(model[1]).__name__)
"""


def _detectron2_stand_in(monkeypatch) -> None:
    """detectron2's FrozenBatchNorm2d as detectron2 defines it (buffers, x*scale+shift), in its own module."""
    import types

    class FrozenBatchNorm2d(nn.Module):
        def __init__(self, num_features, eps=1e-5):
            super().__init__()
            self.num_features, self.eps = num_features, eps
            self.register_buffer("weight", torch.ones(num_features))
            self.register_buffer("bias", torch.zeros(num_features))
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features) - eps)

        def forward(self, x):
            scale = self.weight * (self.running_var + self.eps).rsqrt()
            bias = self.bias - self.running_mean * scale
            return x * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)

    names = ["detectron2", "detectron2.layers", "detectron2.layers.batch_norm"]
    modules = {name: types.ModuleType(name) for name in names}
    FrozenBatchNorm2d.__module__ = names[-1]
    modules[names[-1]].FrozenBatchNorm2d = FrozenBatchNorm2d
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_detectron2s_frozen_bn_beside_syncbn_trains_at_ddp(tmp_path, world_of_one, monkeypatch):
    """A detectron2 model freezes its first stages with detectron2's own FrozenBatchNorm2d (FREEZE_AT) beside
    SyncBN: its rule joins once detectron2 is imported, so DDP's adoption keeps it frozen instead of stopping the
    script as 'no rule' (exit 7, before)."""
    import sys

    _detectron2_stand_in(monkeypatch)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DETECTRON2_SCRIPT))
    marker = tmp_path / "trained"
    result = CliRunner().invoke(app, ["run", str(script), str(marker)])
    assert result.exit_code == 0, result.output
    assert marker.read_text() == "bnsurgeon.runtime.layers FrozenBatchNorm2d"
    assert "1 kept, 0 unhandled" in result.output, result.output
    assert "detectron2" in sys.modules  # (removed again by monkeypatch)


def test_an_adopted_layer_is_named_by_what_runs_it_not_by_when_or_where_it_was_adopted(world_of_one):
    """Adoption gives no name (a name from where or when a layer was made or adopted differed between ranks that
    built one more layer, or adopted at another moment): the name is fixed at the first synchronized call, by the
    layer's path in the outermost module running it, else by its place among the layers first synchronized over
    its group; a deep copy (an EMA) is named again by what runs it."""
    import copy

    from bnsurgeon.launch import built
    from bnsurgeon.runtime.identity import running_path

    log = ConversionLog(quiet=True)
    with patched_converters(log):
        layers = [nn.SyncBatchNorm(2) for _ in range(2)]
        extra = nn.SyncBatchNorm(2)  # made later, on this rank only
        built.adopt_remembered(log, "train.py:9", layers[1])
    assert all(type(layer) is SyncBatchNorm and not layer._identity.fixed for layer in [*layers, extra])
    assert not built._remembered  # put back with the run
    model = nn.Sequential(nn.Identity(), nn.Sequential(layers[0]))
    seen = []
    layers[0].register_forward_pre_hook(lambda module, args: seen.append(running_path(module, sys._getframe(0))))
    model(torch.randn(3, 2))
    assert seen == ["Sequential.1.0"]
    layers[0]._identity.fix(layers[0], None)  # called here, outside any module: its place over the group
    assert layers[0].layer_name.endswith("(the 1st layer to synchronize over ranks [0])"), layers[0].layer_name
    layers[1]._identity.fix(layers[1], None)
    assert "the 2nd layer" in layers[1].layer_name and layers[1]._identity.id != layers[0]._identity.id
    ema = copy.deepcopy(layers[0])
    assert not ema._identity.fixed and ema.layer_name == layers[0]._identity.own_name
    converted = SyncBatchNorm(2)
    converted.layer_name = "backbone.bn1"  # a path given at conversion: the same on every rank, fixed at once
    assert converted._identity.fixed and copy.deepcopy(converted).layer_name == "backbone.bn1"
