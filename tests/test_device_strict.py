"""The crashes only a GPU shows, caught on CPU through the strict stand-in device (issue 45).

``_cuda_standin.StrictDevice`` refuses what CUDA refuses and the CPU accepts: device-assert
messages of 255 bytes or more (on every call), any op after a failed device assert (the
context is dead), and, in its stand-in capture, host traffic, with garbage until a replay and
a replay that reads a tensor freed after capture. Each test here failed on the code before
its fix. Two identical ranks are simulated (``identical_ranks``), so the reference is plain
BN, in float64, on the batch concatenated with itself.
"""

from __future__ import annotations

import copy

import _cuda_standin
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bnsurgeon.core.errors import GraphCaptureError
from bnsurgeon.runtime import device_checks, sync_function
from bnsurgeon.runtime.layers import SyncBatchNorm

LONG_NAME = "encoder." + ".".join(f"stages{i}.layers.conv_module" for i in range(9)) + ".batch_norm"


@pytest.fixture
def device(monkeypatch):
    """The stand-in kernels on a strict device, every sync layer in a world of two identical ranks."""
    _cuda_standin.identical_ranks(monkeypatch)
    monkeypatch.setattr(
        sync_function, "all_gather_rows", lambda local, world_size, group, *_: torch.stack([local, local])
    )
    monkeypatch.setattr(sync_function, "all_reduce_sum", lambda local, world_size, group, *_: local * 2)
    monkeypatch.setattr(SyncBatchNorm, "_sync_group", lambda self: (None, 2))
    with _cuda_standin.installed() as strict:
        yield strict
    assert strict.poisoned is None, f"the stand-in device was left poisoned: {strict.poisoned}"


class Net(nn.Module):
    """conv -> BN -> ReLU, the BN named ``name``."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = bn
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _pair(momentum=0.1, name: str = "backbone.bn"):
    """(ours: a sync layer on the stand-in device path, reference: plain BN), float64, same weights."""
    torch.manual_seed(3)
    reference = Net(nn.BatchNorm2d(4, momentum=momentum)).double()
    with torch.no_grad():
        reference.bn.weight.uniform_(0.5, 1.5)
        reference.bn.bias.uniform_(-0.5, 0.5)
    ours = copy.deepcopy(reference)
    ours.bn = SyncBatchNorm.from_module(ours.bn)
    ours.bn.layer_name = name
    return ours, reference


def _batch(seed: int, n: int = 3, size: int = 5):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=generator, dtype=torch.float64) * 2 + 1


def _twice(x):
    return torch.cat([x, x])


def _assert_state_equal(ours, reference):
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-12, atol=1e-12, msg=key)


def _assert_grads_match(ours, reference):
    """Parameter gradients stay local on each rank: the reference (both ranks' batches) holds twice ours."""
    for (name, mine), theirs in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(2 * mine.grad, theirs.grad, rtol=1e-10, atol=1e-10, msg=name)


# ---- the stand-in itself is strict ----


def test_standin_refuses_long_assert_messages_even_when_the_condition_holds(device):
    holds = torch.ones((), dtype=torch.bool)
    torch._assert_async(holds, "x" * 254)
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        torch._assert_async(holds, "x" * 255)
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        torch._assert_async(torch.empty((), dtype=torch.bool, device="meta"), "é" * 128)  # 256 bytes, meta too


def test_standin_failed_assert_poisons_every_later_op(device):
    with pytest.raises(RuntimeError, match="device-side assert triggered: boom"):
        torch._assert_async(torch.zeros((), dtype=torch.bool), "boom")
    with pytest.raises(_cuda_standin.DevicePoisoned):
        torch.ones(2) + 1
    device.poisoned = None  # the fixture checks that nothing else poisoned it


def test_standin_capture_records_instead_of_running_and_refuses_host_reads(device):
    a = torch.ones(3)
    with device.capture() as graph:
        b = a * 2
        a.add_(1)
        with pytest.raises(RuntimeError, match="stream is capturing"):
            float(b.sum())
    assert torch.isnan(b).all()  # not computed until a replay
    assert torch.equal(a, torch.ones(3))  # the in-place add was recorded, not run
    graph.replay()
    assert torch.equal(b, torch.full((3,), 2.0)) and torch.equal(a, torch.full((3,), 2.0))
    graph.replay()
    assert torch.equal(b, torch.full((3,), 4.0)) and torch.equal(a, torch.full((3,), 3.0))


# ---- defect 1: assert messages CUDA refuses ----


def test_fit_assert_message_keeps_start_and_end_within_cudas_limit():
    for message in ["short", "a" * 254, "a" * 255, "é" * 300, "start " + "ü" * 500 + " end"]:
        fitted = device_checks.fit_assert_message(message)
        assert len(fitted.encode("utf-8")) <= 254, len(fitted.encode("utf-8"))
        if len(message.encode("utf-8")) <= 254:
            assert fitted == message
        else:
            assert fitted[:3] == message[:3] and fitted[-3:] == message[-3:] and " ... " in fitted


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_a_200_character_layer_name_trains_through_the_device_path(device, reentrant):
    """Header check, one-value check and the recompute of activation checkpointing: every device
    assert's message fits, so a long module path no longer raises on every training call."""
    assert len(LONG_NAME) > 200
    ours, reference = _pair(name=LONG_NAME)
    x = _batch(0).requires_grad_()
    y = ours(x) if reentrant is None else checkpoint(ours, x, use_reentrant=reentrant)
    y.square().sum().backward()
    reference(_twice(x)).square().sum().backward()
    _assert_grads_match(ours, reference)
    _assert_state_equal(ours, reference)
    assert device.asserts > 0


def test_a_200_character_layer_name_through_the_generic_device_branch(device):
    """The generic path off the CPU (any non-CUDA device) asserts on the device too."""
    forced = sync_function.uses_device_path  # set by the fixture, which restores the original
    sync_function.uses_device_path = lambda x: False
    ours, reference = _pair(name=LONG_NAME)
    x = _batch(1)
    try:
        ours(x).square().sum().backward()
    finally:
        sync_function.uses_device_path = forced
    reference(_twice(x)).square().sum().backward()
    _assert_grads_match(ours, reference)
    assert device.asserts > 0


# ---- defect 2: checkpoint recompute, several views and stale forwards ----


@pytest.mark.parametrize("reentrant", [True, False])
def test_one_layer_on_two_checkpointed_views(device, reentrant):
    """The backbone once per view (BYOL, SimSiam, MoCo v3): the engine recomputes view 2 first.
    The device path took the oldest stashed forward and asserted it matched: a dead context."""
    ours, reference = _pair()
    views = [_batch(10).requires_grad_(), _batch(11).requires_grad_()]
    ref_views = [_twice(v.detach()).requires_grad_() for v in views]
    weights = [1.0, -0.5]
    loss = sum(w * checkpoint(ours, v, use_reentrant=reentrant).square().sum() for w, v in zip(weights, views))
    loss.backward()
    ref_loss = sum(w * reference(v).square().sum() for w, v in zip(weights, ref_views))
    ref_loss.backward()
    for view, ref_view in zip(views, ref_views, strict=True):
        torch.testing.assert_close(view.grad, ref_view.grad[: len(view)], rtol=1e-10, atol=1e-10)
    _assert_grads_match(ours, reference)
    _assert_state_equal(ours, reference)  # running statistics: two updates, none from the recomputes


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_no_grad_train_forward_before_a_checkpointed_step(device, reentrant):
    """A train-mode forward whose backward never runs (update_bn, pseudo-labels under no_grad)
    left a stash entry the next recompute took and asserted on."""
    ours, reference = _pair()
    with torch.no_grad():
        ours(_batch(20))
        reference(_twice(_batch(20)))
    x = _batch(21).requires_grad_()
    checkpoint(ours, x, use_reentrant=reentrant).square().sum().backward()
    reference(_twice(x)).square().sum().backward()
    _assert_grads_match(ours, reference)
    _assert_state_equal(ours, reference)


# ---- defect 3: momentum=None ----


def test_momentum_none_reads_nothing_on_the_host(device):
    """``float(num_batches_tracked)`` was a host read on every forward: on meta tensors (no data) it raised."""
    ours, _ = _pair(momentum=None)
    ours = ours.to("meta")
    x = torch.empty(3, 3, 5, 5, dtype=torch.float64, device="meta", requires_grad=True)
    with _cuda_standin.OpCounter() as counter:
        ours(x).sum().backward()
    assert counter.host_reads == [] and counter.host_copies == [], (counter.host_reads, counter.host_copies)


def test_momentum_none_matches_plain_bn_over_steps(device):
    """The cumulative average kept on the device equals plain BN's, step after step."""
    ours, reference = _pair(momentum=None)
    for step in range(3):
        x = _batch(30 + step)
        ours(x).square().sum().backward()
        reference(_twice(x)).square().sum().backward()
        _assert_state_equal(ours, reference)


# ---- defect 4: device constants and CUDA graphs ----


def _captured_step(device, model, x_static):
    """One training step captured on the stand-in device: (graph, output)."""
    for parameter in model.parameters():
        parameter.grad = None
    with device.capture() as graph:
        y = model(x_static)
        y.square().sum().backward()
    return graph, y


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_warmed_up_step_replays_exactly_in_a_captured_graph(device, momentum):
    """One eager step, then the step captured and replayed twice: outputs, gradients, running
    statistics and the call counter as three eager steps of plain BN (momentum=None read the host)."""
    ours, reference = _pair(momentum=momentum)
    x_static = _batch(40)
    ours(x_static).square().sum().backward()  # warm-up
    reference(_twice(x_static)).square().sum().backward()
    graph, y = _captured_step(device, ours, x_static)
    for step in range(2):
        new = _batch(41 + step)
        x_static.copy_(new)
        graph.replay()
        reference.zero_grad(set_to_none=True)
        expected = reference(_twice(new))
        expected.square().sum().backward()
        torch.testing.assert_close(y, expected[: len(new)], rtol=1e-12, atol=1e-12)
        _assert_grads_match(ours, reference)
        _assert_state_equal(ours, reference)
    eager = ours(_batch(50))  # the header's call count advanced in every replay: eager calls still agree
    torch.testing.assert_close(eager, reference(_twice(_batch(50)))[:3], rtol=1e-12, atol=1e-12)


def test_a_first_call_inside_capture_is_refused_by_name(device):
    """Without warm-up the layer's header and count were made inside the capture: recorded, not
    run, so the next eager call read garbage (NaN header: a failed device assert) and every
    replay re-made them. Now: a clear error naming the layer, and nothing poisoned."""
    ours, _ = _pair(name="stem.bn1")
    with pytest.raises(GraphCaptureError, match="'stem.bn1'.*eager training step"):
        _captured_step(device, ours, _batch(60))
    ours(_batch(61)).sum().backward()  # the device still works, the layer still trains


def test_multi_scale_training_with_a_captured_step(device):
    """A graph captured at one scale, then eager steps at hundreds of other sizes (ragged last
    batches, multi-scale): the count cache was cleared at 256 entries while the graph still read
    the tensor it recorded (on a GPU, memory freed and reused)."""
    ours, reference = _pair()
    x_static = _batch(70)
    ours(x_static).square().sum().backward()
    reference(_twice(x_static)).square().sum().backward()
    graph, y = _captured_step(device, ours, x_static)
    with torch.no_grad():
        for size in range(2, 300):
            ours.bn(torch.randn(size, 4, 1, 1, dtype=torch.float64))
            reference.bn(_twice(torch.randn(size, 4, 1, 1, dtype=torch.float64)))
    graph.replay()
    reference.zero_grad(set_to_none=True)
    expected = reference(_twice(x_static))
    expected.square().sum().backward()
    torch.testing.assert_close(y, expected[:3], rtol=1e-12, atol=1e-12)
    _assert_grads_match(ours, reference)


# ---- the class: every device assert goes through one door ----


def direct_device_asserts(package) -> list[str]:
    """``torch._assert_async`` named anywhere in ``package`` outside ``runtime/device_checks.py``."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "device_checks.py" and path.parent.name == "runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = (isinstance(node, ast.Attribute) and node.attr == "_assert_async") or (
                isinstance(node, ast.alias) and node.name == "_assert_async"
            )
            if named:
                found.append(f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', '?')}")
    return found


def test_every_device_assert_goes_through_device_checks():
    """A direct ``torch._assert_async`` can carry a message CUDA refuses; ``device_assert`` fits it."""
    from pathlib import Path

    import bnsurgeon

    assert direct_device_asserts(Path(bnsurgeon.__file__).parent) == []


def test_the_device_assert_scan_finds_one(tmp_path):
    package = tmp_path / "bnsurgeon"
    (package / "runtime").mkdir(parents=True)
    (package / "runtime" / "device_checks.py").write_text("import torch\ntorch._assert_async(x, 'fine here')\n")
    (package / "runtime" / "other.py").write_text("import torch\n\ntorch._assert_async(x, 'm')\n")
    (package / "third.py").write_text("from torch import _assert_async\n")
    assert direct_device_asserts(package) == ["bnsurgeon/runtime/other.py:3", "bnsurgeon/third.py:1"]


def test_standin_capture_shapes_ops_whose_keyword_names_a_device(device):
    """A cast with ``device=`` among its keywords (autocast's copies) is shaped on meta like any other op."""
    a = torch.ones(3, dtype=torch.float64)
    with device.capture() as graph:
        b = a.to(dtype=torch.float32, device="cpu", copy=True)
    graph.replay()
    assert b.dtype == torch.float32 and torch.equal(b, torch.ones(3))
