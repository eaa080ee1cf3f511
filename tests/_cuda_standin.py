"""Strict CPU stand-ins for the CUDA sync-BN kernels, and a dispatch counter, for CI without a GPU.

Each stand-in computes what its CUDA kernel computes (aten/src/ATen/native/cuda/
Normalization.cu and .cuh) in the kernel's accumulation dtype and raises where the kernel
raises on dtypes, so the device path's glue is checked on CPU values (exactness) and on
meta tensors (no host read). The rules enforced:

* statistics (mean, invstd) are float32, float64 for float64 inputs, and mean and invstd
  always share that dtype;
* ``batch_norm_elemt`` / ``batch_norm_backward_reduce``: the affine parameters are in the
  input's dtype or in the statistics' dtype, never a third, and weight and bias agree;
* ``batch_norm_backward_elemt``: a half/bfloat16 input with float32 statistics takes the
  weight in float32 only ("Expected weight to have type Float but got Half" on a GPU); the
  count is an int32 tensor of per-rank counts;
* ``batch_norm_gather_stats_with_counts``: the counts and running statistics are in one
  dtype (the running statistics', else the first argument's), the per-rank rows in its
  accumulation dtype, and the merge runs rank by rank with an integer running count, as
  the kernel's loop does (a leading zero count gives NaN there too).

``OpCounter`` counts every aten op dispatched, with each stand-in counted as the one
kernel launch it replaces, and flags host reads and host-to-device copies.

``StrictDevice`` (entered by ``installed()``) is the device itself, as strict as CUDA where a
CPU is lenient:

* a device assert (``aten._assert_async.msg``) whose message is 255 bytes or longer raises on
  every call, whether the condition holds or not (CUDA checks the length on the host at
  launch); meta tensors included;
* a failed device assert poisons the device: every later op raises, as a CUDA context after
  "device-side assert triggered" does, so a test cannot catch it and go on;
* ``capture()`` is a stand-in CUDA graph capture: ops are recorded, not run (their outputs are
  garbage until a replay: NaN floats, a sentinel in integers), a host read or a value copied
  from the host raises, and the layers' ``device_checks.capturing`` answers True. ``replay()``
  runs what was recorded, in order, into the same output tensors. A graph keeps the tensors it
  allocated; a tensor it only read (made before capture) is held weakly, and a replay after
  the owner dropped it raises, as a CUDA graph reading freed memory would read garbage.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_active: list["OpCounter"] = []


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _kernel(function):
    """Count a stand-in as one op and hide its own ops from the counter."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        counter = _active[-1] if _active else None
        if counter is None:
            return function(*args, **kwargs)
        counter.ops[f"cuda.{function.__name__}"] += 1
        counter.hidden += 1
        try:
            return function(*args, **kwargs)
        finally:
            counter.hidden -= 1

    return wrapper


def _channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _format(x: torch.Tensor) -> torch.memory_format:
    """What ``suggest_memory_format`` answers in C++: channels_last when the input is laid out so."""
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _check_params(x: torch.Tensor, *params) -> None:
    defined = [p for p in params if p is not None]
    if not defined:
        return
    first = defined[0].dtype
    _require(first in (x.dtype, _acc(x.dtype)), f"Expected parameters in {x.dtype} or {_acc(x.dtype)}, got {first}")
    for p in defined[1:]:
        _require(p.dtype == first, f"Expected all parameters to have type {first} but got {p.dtype}")


def _check_stats(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> None:
    _require(mean.dtype == invstd.dtype, "mean and invstd need to have the same data types")
    _require(mean.dtype == _acc(x.dtype), f"Expected statistics in {_acc(x.dtype)}, got {mean.dtype}")


@_kernel
def batch_norm_stats(x: torch.Tensor, eps: float):
    var, mean = torch.var_mean(x.to(_acc(x.dtype)), _dims(x), correction=0)
    return mean, (var + eps).rsqrt()


@_kernel
def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    _check_stats(x, mean, invstd)
    _check_params(x, weight, bias)
    acc, ndim = mean.dtype, x.dim()
    y = (x.to(acc) - _channel(mean, ndim)) * _channel(invstd, ndim)
    if weight is not None:
        y = y * _channel(weight.to(acc), ndim)
    if bias is not None:
        y = y + _channel(bias.to(acc), ndim)
    return y.to(x.dtype).contiguous(memory_format=_format(x))


@_kernel
def batch_norm_gather_stats_with_counts(first, means, invstds, running_mean, running_var, momentum, eps, counts):
    scalar = running_mean.dtype if running_mean is not None else first.dtype
    acc = _acc(scalar)
    _require(means.dtype == acc and invstds.dtype == acc, f"Expected per-rank statistics in {acc}, got {means.dtype}")
    _require(counts.dtype == scalar, f"Expected counts to have type {scalar} but got {counts.dtype}")
    _require(running_var is None or running_var.dtype == scalar, "running_var must match running_mean")
    avg = torch.zeros_like(means[0])
    var_n = torch.zeros_like(means[0])
    n = means.new_zeros(())
    for rank in range(means.shape[0]):  # the kernel's loop, with its integer running count
        count = counts[rank].to(acc)
        m = means[rank]
        v = invstds[rank].reciprocal()
        v = (v * v - eps) * count
        factor = (n + count).reciprocal()
        var_n = var_n + v + (avg - m) * (avg - m) * n * count * factor
        avg = n * factor * avg + count * factor * m
        n = (n + count).trunc()
    invstd = (var_n / n + eps).sqrt().reciprocal()
    if running_mean is not None:
        running_mean.copy_(((1 - momentum) * running_mean.to(acc) + momentum * avg).to(scalar))
        running_var.copy_(((1 - momentum) * running_var.to(acc) + momentum * var_n / (n - 1)).to(scalar))
    return avg, invstd


@_kernel
def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    _check_stats(x, mean, invstd)
    _check_params(x, weight)
    acc, ndim = mean.dtype, x.dim()
    xmu = x.to(acc) - _channel(mean, ndim)
    sum_dy = dy.to(acc).sum(_dims(x))
    sum_dy_xmu = (dy.to(acc) * xmu).sum(_dims(x))
    param = weight.dtype if weight is not None else x.dtype
    grad_weight = (sum_dy_xmu * invstd).to(param) if weight_g else x.new_empty(0, dtype=param)
    grad_bias = sum_dy.to(param) if bias_g else x.new_empty(0, dtype=param)
    if not input_g:
        sum_dy, sum_dy_xmu = x.new_empty(0, dtype=acc), x.new_empty(0, dtype=acc)
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


@_kernel
def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    _check_stats(x, mean, invstd)
    _require(count.dtype == torch.int32, f"Expected count to have type Int but got {count.dtype}")
    if weight is not None and x.dtype in (torch.float16, torch.bfloat16):
        _require(weight.dtype == mean.dtype, f"Expected weight to have type Float but got {weight.dtype}")
    _check_params(x, weight)
    acc, ndim = mean.dtype, x.dim()
    norm = count.to(acc).sum().reciprocal()
    scale = invstd if weight is None else invstd * weight.to(acc)
    dx = (
        dy.to(acc)
        - _channel(sum_dy * norm, ndim)
        - (x.to(acc) - _channel(mean, ndim)) * _channel(invstd * invstd * sum_dy_xmu * norm, ndim)
    )
    return (dx * _channel(scale, ndim)).to(x.dtype).contiguous(memory_format=_format(x))


KERNELS = (
    "batch_norm_stats",
    "batch_norm_elemt",
    "batch_norm_gather_stats_with_counts",
    "batch_norm_backward_reduce",
    "batch_norm_backward_elemt",
)


def identical_ranks(monkeypatch, world_size: int = 2) -> None:
    """The device path's two collectives as ``world_size`` ranks holding the same batch would
    return them, each counted as the one collective op it replaces."""
    from bnsurgeon.runtime import device_path

    def gather(gathered, row, group):
        _collective("c10d.all_gather", lambda: gathered.view(world_size, -1).copy_(row.expand(world_size, -1)))

    def reduce(packed, group):
        _collective("c10d.all_reduce", lambda: packed.mul_(world_size))

    monkeypatch.setattr(device_path, "all_gather_into", gather)
    monkeypatch.setattr(device_path, "all_reduce_into", reduce)


def _collective(name: str, run) -> None:
    counter = _active[-1] if _active else None
    if counter is None:
        run()
        return
    counter.ops[name] += 1
    counter.collectives += 1
    counter.hidden += 1
    try:
        run()
    finally:
        counter.hidden -= 1


@contextlib.contextmanager
def installed():
    """The stand-in kernels, the device path forced and a ``StrictDevice`` entered (yielded);
    for code that has no monkeypatch (a spawned rank) and for tests that need the strict device."""
    from bnsurgeon.runtime import device_checks, sync_function

    saved = {name: getattr(torch, name) for name in KERNELS}
    saved_choice = sync_function.uses_device_path
    saved_on_host = sync_function.counts_on_host
    saved_capturing = device_checks.capturing
    device = StrictDevice()
    try:
        for name in KERNELS:
            setattr(torch, name, globals()[name])
        sync_function.uses_device_path = lambda x: True
        sync_function.counts_on_host = lambda x: False  # nothing lives on the host of a device
        device_checks.capturing = lambda on: device.graph is not None
        with device:
            yield device
    finally:
        for name, value in saved.items():
            setattr(torch, name, value)
        sync_function.uses_device_path = saved_choice
        sync_function.counts_on_host = saved_on_host
        device_checks.capturing = saved_capturing


#: CUDA's host check on a device assert's message, at every launch
ASSERT_MESSAGE_LIMIT = 255
_ASSERTS = {"aten._assert_async.msg", "aten._assert_async.default"}
#: ops that read a device value on the host, or make a device value from a host one
_HOST_TRAFFIC = {
    "aten._local_scalar_dense.default",
    "aten.equal.default",
    "aten.is_nonzero.default",
    "aten.item.default",
    "aten.lift_fresh.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
}


class DevicePoisoned(RuntimeError):
    """What every op raises after a failed device assert."""


class StrictDevice(TorchDispatchMode):
    """The CPU as strict as a CUDA device: assert messages, poisoning, capture (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned: "str | None" = None
        self.graph: "StandinGraph | None" = None
        self.asserts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.poisoned is not None:
            raise DevicePoisoned(
                f"CUDA error: device-side assert triggered (stand-in device unusable since: {self.poisoned})"
            )
        name = str(func)
        if name in _ASSERTS:
            return self._assert(func, args, kwargs)
        if self.graph is not None:
            return self.graph.capture(func, name, args, kwargs)
        return func(*args, **kwargs)

    def _assert(self, func, args, kwargs):
        message = args[1] if len(args) > 1 else kwargs.get("assert_msg", "")
        if len(message.encode("utf-8")) >= ASSERT_MESSAGE_LIMIT:
            raise RuntimeError(f"Message length must be smaller than {ASSERT_MESSAGE_LIMIT} (got {len(message)})")
        self.asserts += 1
        if self.graph is not None:
            self.graph.record("assert", func, args, kwargs, None)
            return None
        condition = args[0]
        if condition.device.type != "meta" and not bool(condition):
            self.poisoned = message
            raise RuntimeError(f"CUDA error: device-side assert triggered: {message}")
        return None

    @contextlib.contextmanager
    def capture(self):
        """A stand-in ``torch.cuda.graph`` capture; yields the graph to ``replay()``."""
        assert self.graph is None, "captures do not nest"
        graph = self.graph = StandinGraph(self)
        try:
            yield graph
        finally:
            self.graph = None


def _garbage_like(meta: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    return out.fill_(True if out.dtype == torch.bool else 77)


def _map(value, function):
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, function) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, function) for k, v in value.items()}
    return value


def _to_meta(value):
    """Tensors and devices, at any depth, on the meta device (for the shapes an op returns)."""
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


class StandinGraph:
    """What a stand-in capture recorded; ``replay()`` runs it (module docstring)."""

    def __init__(self, device: StrictDevice) -> None:
        self.device = device
        self.records: list = []
        self._owned: dict[int, torch.Tensor] = {}  # id -> tensor this graph allocated (kept alive, as its pool)

    def _own(self, value):
        _map(value, lambda t: self._owned.setdefault(id(t), t))
        return value

    def _hold(self, value):
        """A tensor argument as the graph keeps it: owned strongly, anything else weakly."""

        def hold(t):
            if self._owned.get(id(t)) is t:
                return ("owned", t)
            return ("weak", weakref.ref(t), str(tuple(t.shape)))

        return _map(value, lambda t: _Held(hold(t)))

    def record(self, kind, func, args, kwargs, outputs) -> None:
        self.records.append((kind, func, self._hold(list(args)), self._hold(dict(kwargs)), outputs))

    def capture(self, func, name: str, args, kwargs):
        if name in _HOST_TRAFFIC:
            raise RuntimeError(f"operation not permitted when stream is capturing ({name}: host traffic)")
        if func.is_view:
            return self._own(func(*args, **kwargs))
        if func._schema.is_mutable:
            if func._schema.name.endswith("_"):
                result = args[0]
            elif "out" in kwargs:
                result = kwargs["out"]
            else:
                raise RuntimeError(f"the stand-in capture does not model {name}")
            self.record("mutate", func, args, kwargs, None)
            return result
        shapes = func(*_to_meta(list(args)), **_to_meta(dict(kwargs)))
        outputs = _map(shapes, _garbage_like)
        self._own(outputs)
        self.record("compute", func, args, kwargs, outputs)
        return outputs

    def replay(self) -> None:
        """Run the recorded ops, in order, into the tensors the capture handed out."""
        with torch.no_grad(), self.device:
            for kind, func, args, kwargs, outputs in self.records:
                args, kwargs = _resolve(args, func), _resolve(kwargs, func)
                if kind == "assert":
                    torch._assert_async(*args, **kwargs)
                    continue
                result = func(*args, **kwargs)
                if kind == "compute":
                    pairs = zip(_flat(outputs), _flat(result), strict=True)
                    for old, new in pairs:
                        old.copy_(new)


class _Held:
    __slots__ = ("held",)

    def __init__(self, held) -> None:
        self.held = held


def _resolve(value, func):
    if isinstance(value, _Held):
        held = value.held
        if held[0] == "owned":
            return held[1]
        tensor = held[1]()
        if tensor is None:
            raise RuntimeError(
                f"graph replay of {func} reads a tensor of shape {held[2]} that was freed after capture "
                "(on a GPU: garbage or an illegal memory access)"
            )
        return tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(v, func) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, func) for k, v in value.items()}
    return value


def _flat(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


HOST_READS = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (a stand-in as one) and records host reads and host-to-device copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.hidden = 0
        self.collectives = 0
        self.host_reads: list[str] = []
        self.host_copies: list[str] = []

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.hidden:
            name = str(func)
            self.ops[name] += 1
            if name in HOST_READS:
                self.host_reads.append(name)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if name.startswith(("aten._to_copy", "aten.copy_", "aten.lift_fresh")) and tensors:
                source = tensors[-1] if name.startswith("aten.copy_") else tensors[0]
                target = kwargs.get("device") or (tensors[0].device if name.startswith("aten.copy_") else None)
                if name.startswith("aten.lift_fresh") or (
                    source.device.type == "cpu" and target is not None and torch.device(target).type != "cpu"
                ):
                    self.host_copies.append(name)
        return func(*args, **kwargs)
