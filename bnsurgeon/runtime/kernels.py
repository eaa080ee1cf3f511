"""The CPU building blocks of the synchronized batch norm, and which path a tensor takes.

* ``GenericKernels`` (the CPU path, valid on any device), built so that each pass over
  the activation is one vectorized torch kernel and nothing is allocated that native BN
  does not allocate too:

  - local statistics: for NCHW-contiguous inputs, torch's one-pass kernel is a scalar
    loop (~10x slower than a vectorized pass), so the input is centred on its
    vectorized-sum mean and the corrected two-pass formula reads
    sum(d) and sum(d^2) from one ``native_batch_norm_backward`` reduction; the centred
    copy then becomes the output in place. Channels-last and (N, C) inputs use
    ``torch.batch_norm_update_stats``, which is vectorized there.
  - backward: sum(dy) and sum(dy * xhat) from one fused reduction; the input gradient
    from one eval-mode ``batch_norm`` pass plus one in-place ``addcmul_``.
* CUDA tensors take ``device_path.py`` instead: torch's fused sync-BN kernels, written
  for the count of ops dispatched (``uses_device_path``).

Statistics are float32 (float64 for float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_native_batch_norm_backward = torch.ops.aten.native_batch_norm_backward


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(C,) -> (1, C, 1, ...) broadcastable against an ndim input."""
    return t.view((1, -1) + (1,) * (ndim - 2))


def _is_planar(x: torch.Tensor) -> bool:
    """NCHW-style contiguous with more than one element per (sample, channel) plane."""
    return x.dim() > 2 and x.is_contiguous() and x.numel() > x.shape[0] * x.shape[1]


class GenericKernels:
    """CPU path, built from torch ops that exist on every device."""

    @staticmethod
    def local_stats(x: torch.Tensor, eps: float = 1e-5):
        """(mean, biased var, centred) of the local batch; ``centred`` feeds ``normalize``."""
        channels = x.shape[1]
        dtype = stats_dtype(x)
        if x.numel() == 0:
            zeros = torch.zeros(channels, dtype=dtype, device=x.device)
            return zeros, zeros.clone(), None
        if x.dtype == dtype and _is_planar(x):
            return _centred_stats(x)
        source = x.to(dtype) if x.dtype != dtype else x
        mean, var = torch.batch_norm_update_stats(source, None, None, 0.0)
        return mean, var, None

    @staticmethod
    def normalize(x, weight, bias, mean, var, invstd, eps, centred=None):
        if centred is None:
            # a model cast to bf16/fp16 has low-precision weight and bias; CPU batch_norm takes
            # low-precision input only with parameters in the statistics' dtype
            if weight is not None and weight.dtype != mean.dtype:
                weight = weight.to(mean.dtype)
            if bias is not None and bias.dtype != mean.dtype:
                bias = bias.to(mean.dtype)
            return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        # y = (x - mean) * scale + bias = d * scale + ((shift - mean) * scale + bias), in place on d
        d, shift = centred
        scale = invstd if weight is None else invstd * weight
        offset = (shift - mean).mul_(scale)
        if bias is not None:
            offset.add_(bias)
        ndim = d.dim()
        return d.mul_(channel_view(scale, ndim)).add_(channel_view(offset, ndim))  # d is in the stats dtype

    @staticmethod
    def backward_reduce(dy, x, weight, mean, invstd, eps):
        """Local (sum(dy), term to all-reduce, sum(dy * xhat)); here the term is sum(dy * xhat)."""
        if x.numel() == 0:
            zeros = torch.zeros_like(mean)
            return zeros, zeros.clone(), zeros.clone()
        if x.dtype != mean.dtype:
            x, dy = x.to(mean.dtype), dy.to(mean.dtype)
        _, sum_dy_xhat, sum_dy = _native_batch_norm_backward(
            dy, x, None, None, None, mean, invstd, True, eps, [False, True, True]
        )
        return sum_dy, sum_dy_xhat, sum_dy_xhat

    @staticmethod
    def grad_input(dy, x, weight, mean, var, invstd, eps, sum_dy, sum_dy_xhat, total):
        """dx = scale * (dy - sum_dy/n - xhat * sum_dy_xhat/n), scale = weight * invstd."""
        ndim = x.dim()
        scale = invstd if weight is None else weight.to(invstd.dtype) * invstd
        coef = scale * (-1.0 / max(total, 1)) if isinstance(total, (int, float)) else -scale / total.clamp(min=1)
        if x.dtype == invstd.dtype:
            # xhat * (coef*sum_dy_xhat) + coef*sum_dy as one eval-mode batch_norm pass, then + dy*scale in place
            dx = F.batch_norm(x, mean, var, coef * sum_dy_xhat, coef * sum_dy, False, 0.0, eps)
            return dx.addcmul_(dy, channel_view(scale, ndim))
        # low precision: accumulate dy*a + x*b + c in the stats dtype, cast once
        b = coef * sum_dy_xhat * invstd
        c = coef * sum_dy - b * mean
        dx = torch.addcmul(channel_view(c, ndim), dy, channel_view(scale, ndim))
        dx.addcmul_(x, channel_view(b, ndim))
        return dx.to(x.dtype)


def _centred_stats(x: torch.Tensor):
    """Corrected two-pass statistics, three vectorized passes instead of torch's scalar one.

    shift = sum(x)/n; d = x - shift; mean = shift + sum(d)/n; var = sum(d^2)/n - (sum(d)/n)^2.
    Exact to rounding even when |mean| >> std, because d is already centred.
    """
    ndim = x.dim()
    count = x.numel() // x.shape[1]
    shift = x.sum([0, *range(2, ndim)]).div_(count)
    d = x - channel_view(shift, ndim)
    # with dy = d, save_mean = shift, save_invstd = 1: grad_weight = sum(d * (x - shift)) = sum(d^2), grad_bias = sum(d)
    _, sum_sq, sum_d = _native_batch_norm_backward(
        d, x, None, None, None, shift, torch.ones_like(shift), True, 0.0, [False, True, True]
    )
    correction = sum_d.div_(count)
    mean = shift + correction
    var = sum_sq.div_(count).addcmul_(correction, correction, value=-1).clamp_(min=0)
    return mean, var, (d, shift)


#: read once at import: the test runs on every forward and backward of every sync layer
_FORCE_GENERIC = os.environ.get("BNSURGEON_GENERIC_KERNELS") == "1"


def uses_device_path(x: torch.Tensor) -> bool:
    """CUDA tensors run the fused kernels (device_path.py) unless BNSURGEON_GENERIC_KERNELS=1 asks otherwise."""
    return x.is_cuda and not _FORCE_GENERIC
