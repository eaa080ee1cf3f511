"""nn.DataParallel: bnsurgeon's sync layers synchronize across the replicas of each forward.

CI has no GPU, so the replicas are made and run the way DataParallel makes and runs them:
torch's own ``torch.nn.parallel.replicate`` (with its two CUDA-only helpers swapped for
CPU ones: device indices pass through, and the broadcast gives replica 0 the original
tensors, as CUDA's broadcast does on the source device, and the others copies), then
one thread per replica for the forward, and one thread per replica for the backward (the
autograd engine runs each device's part of the backward in that device's thread). The
reference is one module of plain BN on the whole batch, in float64: outputs, input
gradients, parameter gradients summed over the replicas, running statistics.
With two GPUs or more the same runs through the real ``nn.DataParallel``.
"""

from __future__ import annotations

import copy
import importlib
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import bnsurgeon
from bnsurgeon.core.errors import DistributedMismatchError, ReplicaFailedError, UsageError

JOIN_S = 60  # a bound on every thread of these tests: a deadlock fails instead of hanging
EXACT = dict(rtol=1e-12, atol=1e-12)

_replicate_module = importlib.import_module("torch.nn.parallel.replicate")


def _cpu_broadcast(tensors, devices, detach=False):
    """replicate's broadcast on CPU: replica 0 gets the originals (views of parameters), the others copies."""
    copies = []
    for j in range(len(devices)):
        if detach:
            copies.append([t if j == 0 else t.detach().clone() for t in tensors])
        else:
            copies.append([t.view_as(t) if j == 0 else t.clone() for t in tensors])
    return copies


@pytest.fixture
def cpu_replicate(monkeypatch):
    """torch's replicate, runnable on CPU: the devices are just replica numbers here."""
    monkeypatch.setattr(_replicate_module, "_get_device_index", lambda device, optional=False, allow_cpu=False: device)
    monkeypatch.setattr(_replicate_module, "_broadcast_coalesced_reshape", _cpu_broadcast)
    return _replicate_module.replicate


def _in_threads(function, items):
    """``function(i, item)`` in one thread per item, like parallel_apply: results, or the exception raised."""
    results = [None] * len(items)

    def worker(i, item):
        torch.set_grad_enabled(grad_enabled)
        try:
            results[i] = function(i, item)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            results[i] = error

    grad_enabled = torch.is_grad_enabled()
    threads = [threading.Thread(target=worker, args=(i, item), daemon=True) for i, item in enumerate(items)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a replica thread is still waiting"
    return results


def _raise_first(results):
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def data_parallel_step(module, x, grad, sizes, replicate):
    """One DataParallel forward and backward of ``module`` on ``x`` split into ``sizes``."""
    replicas = replicate(module, list(range(len(sizes))))
    slices = x.split(list(sizes))
    outputs = _raise_first(_in_threads(lambda i, piece: replicas[i](piece), slices))
    _raise_first(
        _in_threads(
            lambda i, pair: torch.autograd.backward(pair[0], pair[1]), list(zip(outputs, grad.split(list(sizes))))
        )
    )
    return torch.cat(outputs)


def reference_step(module, x, grad):
    y = module(x)
    y.backward(grad)
    return y


def _model(dims: int = 2):
    if dims == 2:
        return nn.Sequential(
            nn.Conv2d(3, 5, 3, padding=1),
            nn.BatchNorm2d(5),
            nn.ReLU(),
            nn.Conv2d(5, 4, 1),
            nn.BatchNorm2d(4, momentum=None),
        )
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 4), nn.BatchNorm1d(4))


def _pair(dims: int = 2, seed: int = 0, wrap_first: bool = False):
    """(plain reference, converted model to replicate), same weights, float64."""
    torch.manual_seed(seed)
    plain = _model(dims).double()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if wrap_first:  # convert a model already wrapped in DataParallel (no GPU needed to wrap)
        converted = bnsurgeon.convert(nn.DataParallel(copy.deepcopy(plain)), "sync").model.module
    else:
        converted = bnsurgeon.convert(copy.deepcopy(plain), "sync").model
    return plain.train(), converted.train()


def _batch(dims: int, n: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    shape = (n, 3, 4, 4) if dims == 2 else (n, 6)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 3 + 5
    return x, torch.randn((n, 4, 4, 4) if dims == 2 else (n, 4), generator=generator, dtype=torch.float64)


def _assert_same_state(reference, converted):
    for (name, a), b in zip(reference.named_parameters(), converted.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **EXACT, msg=f"grad of {name}")
    for (name, a), b in zip(reference.named_buffers(), converted.buffers()):
        torch.testing.assert_close(b, a, **EXACT, msg=f"buffer {name}")


SPLITS = {
    "even": (2, 2, 2),
    "uneven": (3, 2, 1),  # and a slice of one sample
    "empty": (4, 0, 2),  # a replica with no samples: it drops out of the merge by its count
    "one_device": (6,),
}


@pytest.mark.parametrize("dims", [2, 1], ids=["conv_bn2d", "linear_bn1d"])
@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_replicas_match_one_module_on_the_whole_batch(cpu_replicate, dims, split):
    """Outputs, input grads, summed parameter grads and running statistics of 2 steps: plain BN on all 6 samples.

    With BatchNorm1d a one-sample slice has one value per channel: plain BN per replica would
    refuse it; synchronized, the layer sees the whole batch."""
    sizes = SPLITS[split]
    reference, converted = _pair(dims)
    for step in range(2):
        x, grad = _batch(dims, sum(sizes), seed=step)
        x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
        reference.zero_grad()
        converted.zero_grad()
        expected = reference_step(reference, x_ref, grad)
        got = data_parallel_step(converted, x_dp, grad, sizes, cpu_replicate)
        torch.testing.assert_close(got, expected, **EXACT)
        torch.testing.assert_close(x_dp.grad, x_ref.grad, **EXACT)
        _assert_same_state(reference, converted)
    assert int(converted[1].num_batches_tracked) == 2


def test_a_model_converted_while_wrapped_synchronizes_too(cpu_replicate):
    """bnsurgeon.convert(nn.DataParallel(model), 'sync') converts the wrapped module, and its replicas sync."""
    reference, converted = _pair(2, wrap_first=True)
    assert type(converted[1]).__name__ == "SyncBatchNorm"
    x, grad = _batch(2, 5)
    x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference_step(reference, x_ref, grad)
    got = data_parallel_step(converted, x_dp, grad, (3, 2), cpu_replicate)
    torch.testing.assert_close(got, expected, **EXACT)
    torch.testing.assert_close(x_dp.grad, x_ref.grad, **EXACT)
    _assert_same_state(reference, converted)


def _assert_replicas_match(plain, converted, cpu_replicate) -> None:
    """One step of ``converted`` over 2 + 3 replicas equals one step of ``plain`` on the whole batch of 5."""
    x, _ = _batch(2, 5)
    grad = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference_step(plain, x_ref, grad)
    got = data_parallel_step(converted, x_dp, grad, (2, 3), cpu_replicate)
    torch.testing.assert_close(got, expected, **EXACT)
    torch.testing.assert_close(x_dp.grad, x_ref.grad, **EXACT)
    _assert_same_state(plain, converted)


def test_replicas_of_a_layer_used_twice_meet_call_by_call(cpu_replicate):
    """A layer shared by two places in the model is one replica per device, called twice: call k meets call k."""
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 3, 1).double()
    bn = nn.BatchNorm2d(3).double()
    plain = nn.Sequential(conv, bn, nn.ReLU(), conv, bn).train()
    converted = bnsurgeon.convert(copy.deepcopy(plain), "sync").model.train()
    _assert_replicas_match(plain, converted, cpu_replicate)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointed_replicas_reuse_their_statistics(cpu_replicate, reentrant):
    """Activation checkpointing inside each replica: the recompute meets no one and updates nothing twice."""
    reference, converted = _pair(2)

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=reentrant)

    wrapped = Checkpointed(converted)
    x, grad = _batch(2, 5)
    x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference_step(reference, x_ref, grad)
    got = data_parallel_step(wrapped, x_dp, grad, (3, 2), cpu_replicate)
    torch.testing.assert_close(got, expected, **EXACT)
    torch.testing.assert_close(x_dp.grad, x_ref.grad, **EXACT)
    _assert_same_state(reference, converted)
    assert int(converted[1].num_batches_tracked) == 1


def test_eval_mode_replicas_run_plain_batch_norm(cpu_replicate):
    reference, converted = _pair(2)
    reference.eval()
    converted.eval()
    x, _ = _batch(2, 4)
    replicas = cpu_replicate(converted, [0, 1])
    outputs = _raise_first(_in_threads(lambda i, piece: replicas[i](piece), x.split([3, 1])))
    assert torch.equal(torch.cat(outputs), reference(x))


class _RaisesOnFlag(nn.Module):
    """Raises in the replica whose slice starts with a NaN: a replica that fails before the BN layer."""

    def forward(self, x):
        if torch.isnan(x.flatten()[0]):
            raise RuntimeError("this replica's data is bad")
        return x


def test_a_replica_that_raises_before_the_layer_stops_the_others_at_once(cpu_replicate, monkeypatch):
    """A replica that fails before its first sync layer (an out-of-memory in the stem) stops the replicas
    waiting for it at once, naming it and its error; before, they waited the whole collective timeout."""
    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", "600")  # if they waited, JOIN_S would fail the test
    reference, converted = _pair(2)
    model = nn.Sequential(_RaisesOnFlag(), converted)
    x, _ = _batch(2, 4)
    x[2, 0, 0, 0] = float("nan")
    replicas = cpu_replicate(model, [0, 1])
    results = _in_threads(lambda i, piece: replicas[i](piece), x.split([2, 2]))
    assert isinstance(results[1], RuntimeError) and "bad" in str(results[1])
    assert isinstance(results[0], ReplicaFailedError), results[0]
    message = str(results[0])
    assert "replica 1 failed in its forward" in message and "this replica's data is bad" in message
    # the next forward replicates again: a fresh group, unaffected
    x, grad = _batch(2, 4)
    got = data_parallel_step(model, x, grad, (2, 2), cpu_replicate)
    torch.testing.assert_close(got, reference(x), **EXACT)


def _renamed(function, name: str):
    """``function`` under another name: what the replicas module must not depend on (it read torch's frames)."""
    import types

    return types.FunctionType(
        function.__code__.replace(co_name=name), function.__globals__, name, function.__defaults__, function.__closure__
    )


def test_replicas_are_found_without_torchs_frames_after_a_replicate_that_never_ran(cpu_replicate, monkeypatch):
    """The copies of a ``replicate`` whose forward never ran (scatter failed, dropped) do not join the next
    call's group, and nothing depends on torch's ``replicate`` being called that or on its local names:
    before, such copies made a group of four that waited for replicas that never came."""
    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", "600")  # if they waited, JOIN_S would fail the test
    replicate = _renamed(cpu_replicate, "replicate_v3")
    reference, converted = _pair(2)
    abandoned = replicate(converted, [0, 1])
    del abandoned
    x, grad = _batch(2, 5)
    x_ref = x.clone().requires_grad_()
    got = data_parallel_step(converted, x, grad, (3, 2), replicate)
    torch.testing.assert_close(got, reference_step(reference, x_ref, grad), **EXACT)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], value, **EXACT, msg=name)


def test_a_replica_that_fails_inside_the_layer_stops_the_others_at_once(cpu_replicate, monkeypatch):
    """One replica gives the layer the wrong number of channels: every replica raises, none waits for the timeout."""
    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", "600")  # if they waited, JOIN_S would fail the test
    _, converted = _pair(2)
    layer = converted[1]
    replicas = cpu_replicate(layer, [0, 1, 2])
    inputs = [
        torch.randn(2, 5, 3, 3, dtype=torch.float64),
        torch.randn(2, 6, 3, 3, dtype=torch.float64),
        torch.randn(2, 5, 3, 3, dtype=torch.float64),
    ]
    results = _in_threads(lambda i, piece: replicas[i](piece), inputs)
    assert all(isinstance(r, DistributedMismatchError) for r in results), results
    assert "'1'" in str(results[0]) and "replica 1: 13" in str(results[0])


def test_an_error_in_one_replica_breaks_the_meeting_for_all(cpu_replicate, monkeypatch):
    """A replica whose own statistics raise (here: a kernel error) stops the waiting replicas with ReplicaFailedError."""
    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", "600")
    from bnsurgeon.runtime import kernels

    original = kernels.GenericKernels.local_stats
    bad = threading.Event()

    def local_stats(x, eps=1e-5):
        if x.shape[0] == 1:
            bad.set()
            raise RuntimeError("kernel exploded")
        return original(x, eps)

    monkeypatch.setattr(kernels.GenericKernels, "local_stats", staticmethod(local_stats))
    _, converted = _pair(2)
    replicas = cpu_replicate(converted[1], [0, 1])
    inputs = [torch.randn(3, 5, 2, 2, dtype=torch.float64), torch.randn(1, 5, 2, 2, dtype=torch.float64)]
    results = _in_threads(lambda i, piece: replicas[i](piece), inputs)
    assert bad.is_set()
    assert isinstance(results[1], RuntimeError) and "kernel exploded" in str(results[1])
    assert (
        isinstance(results[0], ReplicaFailedError) and "'1'" in str(results[0]) and "kernel exploded" in str(results[0])
    )


def test_data_parallel_inside_a_distributed_job_is_refused(cpu_replicate, monkeypatch):
    """Replicas in each of several ranks: syncing only the replicas would be a silent half, so it refuses."""
    import torch.distributed as dist

    _, converted = _pair(2)
    replicas = cpu_replicate(converted, [0, 1])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    x, _ = _batch(2, 4)
    results = _in_threads(lambda i, piece: replicas[i](piece), x.split([2, 2]))
    assert all(isinstance(r, UsageError) for r in results), results
    assert "torchrun" in str(results[0]) and "DistributedDataParallel" in str(results[0])


def test_compiled_replicas_synchronize_through_a_graph_break(cpu_replicate):
    """torch.compile (without fullgraph) of each replica: the layers run eagerly between graphs and still meet."""
    reference, converted = _pair(2)
    x, grad = _batch(2, 5)
    x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference_step(reference, x_ref, grad)
    compiled = [torch.compile(replica, backend="eager") for replica in cpu_replicate(converted, [0, 1])]
    outputs = _raise_first(_in_threads(lambda i, piece: compiled[i](piece), x_dp.split([3, 2])))
    _raise_first(
        _in_threads(lambda i, pair: torch.autograd.backward(pair[0], pair[1]), list(zip(outputs, grad.split([3, 2]))))
    )
    torch.testing.assert_close(torch.cat(outputs), expected, **EXACT)
    torch.testing.assert_close(x_dp.grad, x_ref.grad, **EXACT)
    _assert_same_state(reference, converted)


def test_fullgraph_compile_of_a_replica_names_the_alternative(cpu_replicate):
    """Under torch.compile the replica path is a graph break; fullgraph=True refuses, naming torchrun + DDP (a torch
    whose compiler.disable takes no reason, 2.4, names the function it would not trace)."""
    import inspect

    takes_reason = "reason" in inspect.signature(torch.compiler.disable).parameters
    _, converted = _pair(2)
    replicas = cpu_replicate(converted[1], [0])
    compiled = torch.compile(replicas[0], backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="torchrun" if takes_reason else "normalize_replica"):
        compiled(torch.randn(2, 5, 2, 2, dtype=torch.float64))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for nn.DataParallel")
def test_real_data_parallel_matches_one_module_on_the_whole_batch():
    reference, converted = _pair(2)
    converted = converted.float().cuda()
    reference = reference.float().cuda()
    devices = list(range(min(torch.cuda.device_count(), 3)))
    dp = nn.DataParallel(converted, device_ids=devices)
    for step in range(2):
        x, grad = _batch(2, 7, seed=step)
        x, grad = x.float().cuda(), grad.float().cuda()
        x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
        reference.zero_grad()
        converted.zero_grad()
        expected = reference_step(reference, x_ref, grad)
        got = dp(x_dp)
        got.backward(grad)
        close = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, expected, **close)
        torch.testing.assert_close(x_dp.grad, x_ref.grad, **close)
        for a, b in zip(reference.parameters(), converted.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **close)
        for a, b in zip(reference.buffers(), converted.buffers()):
            torch.testing.assert_close(b, a, **close)


def test_inspect_and_verify_work_on_the_module_data_parallel_wraps(tmp_path):
    """Paths are the wrapped model's own (no 'module.'), and verify checks the wrapped modules."""
    from bnsurgeon.api import inspect, verify

    plain, converted = _pair(2)
    wrapped = nn.DataParallel(plain)
    direct = inspect(wrapped)
    assert "DataParallel wraps" in direct.source
    assert [path for group in direct.groups for path in group.all_paths] == ["1", "4"]
    torch.save(wrapped, tmp_path / "plain.pt")
    torch.save(nn.DataParallel(converted), tmp_path / "converted.pt")
    from_file = inspect(str(tmp_path / "plain.pt"), trust_pickle=True)
    assert [path for group in from_file.groups for path in group.all_paths] == ["1", "4"]
    result = verify(
        str(tmp_path / "plain.pt"),
        str(tmp_path / "converted.pt"),
        trust_pickle=True,
        world_sizes=(),
        input_shape=(2, 3, 4, 4),
    )
    assert result.checks and all(check.passed for check in result.checks)
    assert "DataParallel wraps" in result.source


def test_a_copy_freed_by_the_cyclic_collector_while_the_lock_is_held_does_not_deadlock():
    """A replica copy in a reference cycle is freed by the cyclic collector, which can run at any allocation,
    including inside enrol's lock; its finalizer takes the same lock (a plain Lock deadlocked there)."""
    import gc

    from bnsurgeon.runtime import replicas

    layer = bnsurgeon.convert(nn.Sequential(nn.BatchNorm2d(3)), "sync").model[0]
    copy = layer._replicate_for_data_parallel()
    copy.cycle = copy
    del copy

    def collect_holding_the_lock():
        with replicas._forming_lock:
            gc.collect()

    thread = threading.Thread(target=collect_holding_the_lock, daemon=True)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), "the finalizer deadlocked on the replicas' lock"


class _Unprintable(RuntimeError):
    def __str__(self):
        raise ValueError("no message")


class _RaisesUnprintable(nn.Module):
    def forward(self, x):
        if torch.isnan(x.flatten()[0]):
            raise _Unprintable()
        return x


def test_a_replica_failing_with_an_unprintable_error_still_stops_the_others(cpu_replicate, monkeypatch):
    """The hook words the failure for the peers; an error whose message cannot be made must not break it."""
    monkeypatch.setenv("BNSURGEON_DIST_TIMEOUT", "600")  # if they waited, JOIN_S would fail the test
    _, converted = _pair(2)
    model = nn.Sequential(_RaisesUnprintable(), converted)
    x, _ = _batch(2, 4)
    x[2, 0, 0, 0] = float("nan")
    replicas = cpu_replicate(model, [0, 1])
    results = _in_threads(lambda i, piece: replicas[i](piece), x.split([2, 2]))
    assert isinstance(results[1], _Unprintable)
    assert isinstance(results[0], ReplicaFailedError) and "_Unprintable" in str(results[0]), type(results[0])


def test_a_layer_checkpointed_twice_finds_the_later_call_first(cpu_replicate):
    """One layer in two checkpointed segments: the backward recomputes the second call first, so its
    stash entry is not the oldest. Taking it must not compare the other entry's tensors with == (an
    ambiguous truth value, which stopped the backward)."""
    torch.manual_seed(5)
    conv = nn.Conv2d(3, 3, 1).double()
    bn = nn.BatchNorm2d(3).double()

    class TwoSegments(nn.Module):
        def __init__(self, conv, bn, checkpointed):
            super().__init__()
            self.conv, self.bn, self.checkpointed = conv, bn, checkpointed

        def segment(self, x):
            return self.bn(self.conv(x))

        def forward(self, x):
            if not self.checkpointed:  # the reference: plain BN would update its statistics again on a recompute
                return self.segment(self.segment(x)).relu()
            x = checkpoint(self.segment, x, use_reentrant=False)
            return checkpoint(self.segment, x, use_reentrant=False).relu()

    plain = TwoSegments(conv, bn, checkpointed=False).train()
    converted = bnsurgeon.convert(TwoSegments(copy.deepcopy(conv), copy.deepcopy(bn), True), "sync").model.train()
    _assert_replicas_match(plain, converted, cpu_replicate)
