"""The sync layer's device path (CUDA and any non-CPU device), checked without a GPU.

On a device the global count must never be read back to the host, or the layer could
not run inside CUDA graph capture. CI has no GPU, so two stand-ins check the glue between
the kernels: meta tensors (which raise on any host read) run the whole forward and
backward, and CPU tensors with the device branch forced must equal plain BN. On a GPU
the same comparison runs on CUDA tensors through the fused kernels under
``torch.cuda.set_sync_debug_mode("error")``. All simulate two identical ranks: the
gather returns the local row twice and the sum over ranks doubles the local sums, so
the reference is plain BN on the batch concatenated with itself.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from bnsurgeon.runtime import sync_function
from bnsurgeon.runtime.sync_function import SyncBatchNormFunction


@pytest.fixture
def two_identical_ranks(monkeypatch):
    monkeypatch.setattr(sync_function, "all_gather_rows", lambda local, world_size, group, *_: torch.stack([local, local]))
    monkeypatch.setattr(sync_function, "all_reduce_sum", lambda local, world_size, group, *_: local * 2)


def _apply(x, bn: nn.BatchNorm2d | nn.BatchNorm1d, name: str = "blocks.0.bn1"):
    """Through the layer's header (identity.py), as a converted layer runs it."""
    from bnsurgeon.runtime.identity import LayerIdentity

    return SyncBatchNormFunction.apply(
        x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum, None, 2, LayerIdentity(name)
    )


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (4, 3, 5, 2, 2)])
def test_device_path_never_reads_a_value_on_the_host(two_identical_ranks, shape):
    """Meta tensors have no data: .item(), bool(tensor) or int(tensor) anywhere in the
    forward or backward would raise here, exactly where a CUDA sync would happen."""
    assert not sync_function.counts_on_host(torch.empty(1, device="meta"))
    bn = (nn.BatchNorm2d(3) if len(shape) == 4 else nn.BatchNorm3d(3)).to("meta")
    x = torch.empty(shape, device="meta", requires_grad=True)
    y = _apply(x, bn)
    y.backward(torch.empty(shape, device="meta"))
    assert y.shape == shape and y.device.type == "meta"
    assert x.grad.shape == shape and bn.weight.grad.shape == (3,) and bn.bias.grad.shape == (3,)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


@contextlib.contextmanager
def _no_host_sync(device: str):
    """On CUDA any device-to-host synchronization inside raises."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["planar", "channels_last", "2d"])
def test_device_branch_matches_plain_bn(two_identical_ranks, monkeypatch, device, layout):
    """The branch that keeps the count on the device against plain BN: forced on CPU values,
    and on CUDA (fused kernels) with no host synchronization anywhere in it."""
    monkeypatch.setattr(sync_function, "counts_on_host", lambda x: False)
    generator = torch.Generator().manual_seed(4)
    shape = (3, 5) if layout == "2d" else (3, 5, 4, 6)
    x = (torch.randn(shape, generator=generator) * 3 + 2).to(device)
    dy = torch.randn(shape, generator=generator).to(device)
    if layout == "channels_last":
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    plain = nn.BatchNorm1d(5) if layout == "2d" else nn.BatchNorm2d(5)
    with torch.no_grad():
        plain.weight.copy_(torch.rand(5, generator=generator) + 0.5)
        plain.bias.copy_(torch.randn(5, generator=generator))
    ours = type(plain)(5)
    ours.load_state_dict(plain.state_dict())
    plain, ours = plain.to(device), ours.to(device)

    x_ours = x.clone().requires_grad_()
    with _no_host_sync(device):
        y = _apply(x_ours, ours)
        y.backward(dy)
    both = torch.cat([x, x]).requires_grad_()
    expected = plain(both)
    expected.backward(torch.cat([dy, dy]))

    n = shape[0]
    tol = {"rtol": 1e-5, "atol": 1e-5} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(y, expected[:n], **tol)
    torch.testing.assert_close(x_ours.grad, both.grad[:n], **tol)
    torch.testing.assert_close(2 * ours.weight.grad, plain.weight.grad, **tol)
    torch.testing.assert_close(2 * ours.bias.grad, plain.bias.grad, **tol)
    stats_tol = {"rtol": 1e-6, "atol": 1e-6} if device == "cpu" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ours.running_mean, plain.running_mean, **stats_tol)
    torch.testing.assert_close(ours.running_var, plain.running_var, **stats_tol)


def test_device_branch_header_mismatch_is_a_device_assert_naming_the_layer(monkeypatch):
    """Off the CPU the header check is ``torch._assert_async`` (no host read); on CPU values
    that assert raises at once, so CI sees the message a GPU run reports at its next sync."""
    def other_rank_elsewhere(local, world_size, group, *_):
        other = local.clone()
        other[:4] += 1  # another layer's id
        return torch.stack([local, other])

    monkeypatch.setattr(sync_function, "all_gather_rows", other_rank_elsewhere)
    monkeypatch.setattr(sync_function, "counts_on_host", lambda x: False)
    bn = nn.BatchNorm2d(3)
    with pytest.raises(RuntimeError, match="sync layer 'stages.1.bn2' met other ranks at a different layer or call"):
        _apply(torch.randn(4, 3, 2, 2), bn, name="stages.1.bn2")
