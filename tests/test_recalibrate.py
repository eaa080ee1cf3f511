"""bnsurgeon.recalibrate: exact population BN statistics, one process and N gloo ranks.

Every expected value is computed here, independently, from the activations themselves
(captured with forward pre-hooks in float64), never hard-coded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bnsurgeon
from tests import _recalibrate_cases as cases
from bnsurgeon.checks.multiproc import RankPool


def closed_form(activations: list[torch.Tensor]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(n, mean, population var) per channel of every activation concatenated, in float64."""
    flat = torch.cat([a.to(torch.float64).transpose(0, 1).reshape(a.shape[1], -1) for a in activations], 1)
    return flat.shape[1], flat.mean(1), flat.var(1, unbiased=False)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-300)).max())


def assert_population(statistics, seen, rtol=1e-10):
    for path, activations in seen.items():
        n, mean, var = closed_form(activations)
        got_n, got_mean, got_var = statistics[path]
        assert got_n == n, path
        assert relative(got_mean, mean) < rtol, (path, relative(got_mean, mean))
        assert relative(got_var, var) < rtol, (path, relative(got_var, var))


def test_one_process_closed_form_and_state():
    torch.set_num_threads(1)
    model = cases.make_model()
    before = cases.buffers(model)
    model.train()
    model[3].training = False  # a mixed set of flags, restored exactly
    flags = [m.training for m in model.modules()]
    reference = cases.make_model()
    seen = cases.capture(reference)
    data = cases.shard(0, (5,)) + cases.shard(1, (0, 3))
    torch.set_grad_enabled(True)
    report = bnsurgeon.recalibrate(model, data)
    assert torch.is_grad_enabled()
    assert [m.training for m in model.modules()] == flags
    # the reference run: the same semantics written out (BN in train, everything else in eval)
    reference.eval()
    for path in cases.BN_PATHS:
        reference.get_submodule(path).training = True
    with torch.no_grad():
        for x in data:
            reference(x)
    assert_population(report.statistics, seen)
    after = cases.buffers(model)
    for key, value in before.items():
        module_path, name = key.rsplit(".", 1)
        if module_path in cases.BN_PATHS and name in ("running_mean", "running_var"):
            n, mean, var = closed_form(seen[module_path])
            expected = mean if name == "running_mean" else var * n / (n - 1)
            assert torch.equal(after[key], expected.to(value.dtype)), key
            assert not torch.equal(after[key], value), key
        else:  # weights, num_batches_tracked: byte-identical
            assert torch.equal(after[key], value), key
    assert report.batches == 8 and report.samples == sum(len(x) for x in data)
    assert report.collectives == 0 and report.unreached == []
    assert [m.path for m in report.modules] == list(cases.BN_PATHS)
    assert all(m.calls == 8 and m.mean_change_max > 0 for m in report.modules)


def test_stable_when_mean_dwarfs_std():
    """1e4 + N(0, 1): E[x^2] - E[x]^2 in float32 would have no correct digit; float64 moments must."""
    torch.manual_seed(3)
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(bn)
    data = [torch.randn(int(n), 4) + 1e4 for n in (7, 2, 13, 4)]
    report = bnsurgeon.recalibrate(model, data)
    exact = torch.cat(data).to(torch.float64)
    n, mean, var = report.statistics["0"]
    assert relative(mean, exact.mean(0)) < 1e-12
    assert relative(var, exact.var(0, unbiased=False)) < 1e-10
    unbiased = exact.var(0, unbiased=True)
    assert torch.equal(bn.running_var, unbiased.float())
    assert relative(bn.running_var.double(), unbiased) < 1e-6  # float32 storage of the exact value


def test_shared_module_called_twice_and_unreached_and_frozen():
    from torchvision.ops.misc import FrozenBatchNorm2d

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.shared = nn.BatchNorm2d(3)
            self.unused = nn.BatchNorm2d(3)
            self.frozen = FrozenBatchNorm2d(3)

        def forward(self, x):
            return self.frozen(self.shared(self.conv(self.shared(x))))

    torch.manual_seed(0)
    net = Net()
    before = cases.buffers(net)
    seen = {"shared": []}
    net.shared.register_forward_pre_hook(lambda m, a: seen["shared"].append(a[0].double().clone()))
    data = [torch.randn(2, 3, 5, 5) * 3 - 7 for _ in range(3)]
    report = bnsurgeon.recalibrate(net, data)
    assert_population(report.statistics, seen)
    assert report.unreached == ["unused"] and report.called_several_times == ["shared"]
    assert [s["path"] for s in report.skipped] == ["frozen"]
    for key in before:
        if not key.startswith("shared.running_"):
            assert torch.equal(before[key], net.state_dict()[key]), key
    report = bnsurgeon.recalibrate(net, data, include_frozen=True)
    assert "frozen" in [m.path for m in report.modules]
    assert not torch.equal(before["frozen.running_mean"], net.frozen.running_mean)


@pytest.fixture(scope="module")
def ranks():
    """Three gloo rank processes, started once for every multi-rank test here (imports paid once)."""
    with RankPool(3, collective_timeout=60) as pool:
        yield pool


def check_world(pool: RankPool, world: int, counts: tuple[int, ...]):
    results = pool.run(world, cases.rank_plain_and_sync, counts, timeout=150)
    torch.set_num_threads(1)
    # plain model under DDP: each rank normalises its own batches; one process runs them all in rank order
    reference = cases.make_model()
    seen = cases.capture(reference)
    one = bnsurgeon.recalibrate(reference, [x for rank in range(world) for x in cases.shard(rank, counts)])
    expected = cases.buffers(reference)
    for rank, result in enumerate(results):
        plain = result["plain"]
        assert plain["collectives"] == 1  # one all_gather for the whole pass
        assert plain["rank_batches"] == list(counts)
        assert plain["batches"] == sum(counts) and plain["samples"] == one.samples
        for path in cases.BN_PATHS:
            n, mean, var = one.statistics[path]
            got_n, got_mean, got_var = plain["statistics"][path]
            assert got_n == n and relative(got_mean, mean) < 1e-12 and relative(got_var, var) < 1e-12, (rank, path)
        for key, value in expected.items():
            # float32 storage of statistics that agree to float64 round-off: equal, or one float32 step apart
            assert torch.allclose(plain["buffers"][key], value, rtol=2.5e-7, atol=0), (rank, key)
            assert torch.equal(plain["buffers"][key], results[0]["plain"]["buffers"][key]), (rank, key)  # every rank
        assert_population(plain["statistics"], seen)
        # what the ranks themselves saw, concatenated: the closed form
        assert_population(plain["statistics"], {p: [a for r in results for a in r["plain"]["seen"][p]]
                                                for p in cases.BN_PATHS})
    # sync-converted: each step normalises the global batch (the union of the ranks' step batches)
    union = cases.global_batch_reference(counts)
    for rank, result in enumerate(results):
        sync = result["sync"]
        assert sync["rank_batches"] == list(counts)
        assert sync["collectives"] == max(counts) + 1 + 1  # a step header per step (+ the last, empty), one merge
        assert_population(sync["statistics"], {p: [a for r in results for a in r["sync"]["seen"][p] if a.numel()]
                                               for p in cases.BN_PATHS})
        for key, value in sync["buffers"].items():
            assert torch.equal(value, results[0]["sync"]["buffers"][key]), (rank, key)
        # against one process normalising the same global batches (its normalisation is float32: 1e-5)
        assert_population(sync["statistics"], union, rtol=1e-5)
    # and the two normalisations really differ (the test would notice a sync model normalising locally)
    assert relative(results[0]["sync"]["statistics"]["9"][2], results[0]["plain"]["statistics"]["9"][2]) > 1e-3


@pytest.mark.parametrize("world,counts", [(2, (3, 1)), (3, (2, 0, 3))])
def test_ranks_equal_one_process(ranks, world, counts):
    """Uneven shards (one rank with none), a different image size per rank: N ranks = one process."""
    check_world(ranks, world, counts)
