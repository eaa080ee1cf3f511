"""Per-device building blocks of the synchronized batch norm.

Two implementations with one interface, chosen by the input's device:

* ``GenericKernels`` (the CPU path, valid on any device): one-pass local statistics
  (``torch.batch_norm_update_stats``), normalization as an eval-mode ``batch_norm`` with
  the global statistics (one fused pass, layout kept), the backward reductions from
  ``aten.native_batch_norm_backward`` (one fused pass), the input gradient from one
  eval-mode ``batch_norm`` pass plus one ``addcmul_``.
* ``CudaKernels``: the fused kernels torch's own SyncBatchNorm uses.

Statistics are float32 (float64 for float64 inputs) whatever the input dtype. Nothing
here reads a device value on the host.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(C,) -> (1, C, 1, ...) broadcastable against an ndim input."""
    return t.view((1, -1) + (1,) * (ndim - 2))


class GenericKernels:
    """CPU path, built from torch ops that exist on every device."""

    @staticmethod
    def local_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        channels = x.shape[1]
        dtype = stats_dtype(x)
        if x.numel() == 0:
            zeros = torch.zeros(channels, dtype=dtype, device=x.device)
            return zeros, zeros.clone()
        source = x.to(dtype) if x.dtype != dtype else x
        mean, var = torch.batch_norm_update_stats(source, None, None, 0.0)
        return mean, var

    @staticmethod
    def normalize(x, weight, bias, mean, var, invstd, eps):
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward_reduce(dy, x, weight, mean, invstd, eps):
        """Local sum(dy), sum(dy * (x - mean)) and sum(dy * xhat) per channel."""
        if x.numel() == 0:
            zeros = torch.zeros_like(mean)
            return zeros, zeros.clone(), zeros.clone()
        if x.dtype != mean.dtype:
            x, dy = x.to(mean.dtype), dy.to(mean.dtype)
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, None, None, None, mean, invstd, True, eps, [False, True, True]
        )
        return sum_dy, sum_dy_xhat / invstd, sum_dy_xhat

    @staticmethod
    def grad_input(dy, x, weight, mean, invstd, sum_dy, sum_dy_xmu, count):
        """dx = w*invstd*(dy - sum_dy/n - (x-mean)*invstd^2*sum_dy_xmu/n), as dy*a + x*b + c."""
        scale = invstd if weight is None else weight.to(invstd.dtype) * invstd
        inv_count = 1.0 / count.clamp(min=1)
        a = scale
        b = -scale * invstd * invstd * sum_dy_xmu * inv_count
        c = -scale * sum_dy * inv_count - b * mean
        ndim = x.dim()
        if x.dtype == invstd.dtype:
            # x*b + c as an eval-mode batch_norm (mean 0, var 1, eps 0: the scale is exactly 1),
            # one fused per-channel pass, then + dy*a in place: ~2x faster than two addcmuls
            dx = F.batch_norm(x, torch.zeros_like(b), torch.ones_like(b), b, c, False, 0.0, 0.0)
            return dx.addcmul_(dy, channel_view(a, ndim))
        dx = torch.addcmul(channel_view(c, ndim), dy, channel_view(a, ndim))  # low precision: accumulate in fp32
        dx.addcmul_(x, channel_view(b, ndim))
        return dx.to(x.dtype)


class CudaKernels:
    """CUDA path on torch's fused sync-BN kernels (the ones torch.nn.SyncBatchNorm uses)."""

    @staticmethod
    def local_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.numel() == 0:
            zeros = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
            return zeros, zeros.clone()
        mean, invstd = torch.batch_norm_stats(x, eps)
        var = (invstd.pow(-2) - eps).clamp_(min=0)
        return mean, var

    @staticmethod
    def normalize(x, weight, bias, mean, var, invstd, eps):
        if x.numel() == 0:
            return torch.empty_like(x)
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward_reduce(dy, x, weight, mean, invstd, eps):
        if x.numel() == 0:
            zeros = torch.zeros_like(mean)
            return zeros, zeros.clone(), zeros.clone()
        sum_dy, sum_dy_xmu, sum_dy_xhat, _ = torch.batch_norm_backward_reduce(
            dy, x, mean, invstd, weight, True, weight is not None, False
        )
        if sum_dy_xhat is None:
            sum_dy_xhat = sum_dy_xmu * invstd
        return sum_dy, sum_dy_xmu, sum_dy_xhat

    @staticmethod
    def grad_input(dy, x, weight, mean, invstd, sum_dy, sum_dy_xmu, count):
        if x.numel() == 0:
            return torch.empty_like(x)
        return torch.batch_norm_backward_elemt(
            dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count.to(torch.int32)
        )


#: read once at import: kernels_for runs on every forward and backward of every sync layer
_FORCE_GENERIC = os.environ.get("BNSURGEON_GENERIC_KERNELS") == "1"


def kernels_for(x: torch.Tensor):
    """CUDA tensors use the fused kernels unless BNSURGEON_GENERIC_KERNELS=1 asks otherwise."""
    if x.is_cuda and not _FORCE_GENERIC:
        return CudaKernels
    return GenericKernels
