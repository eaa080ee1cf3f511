"""Prove a converted model behaves like its source: eval, train, N ranks, frozen.

Every check runs twice: on the models as given, and with the BN statistics and affine
parameters of both perturbed identically (seeded by module path). Freshly initialized
BN is close to the identity and hides lost behaviour; a perturbed one does not. The
N-rank check runs in float64, so any difference above rounding is a bug.
"""

from __future__ import annotations

import copy
import io
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .outputs import flatten_tensors
from .surgery import is_bn_like

if TYPE_CHECKING:
    import torch
    from torch import nn

SEED = 0
VERIFY_SCHEMA_VERSION = 1
DIST_RTOL = 1e-6
INEXACT_RTOL = 1e-4


@dataclass
class CheckOutcome:
    name: str
    passed: bool | None  # None: not applicable (skipped, with the reason in detail)
    max_abs_diff: float = 0.0
    detail: str = ""
    first_divergence: str | None = None
    seconds: float = 0.0  # wall time of this check in the verifying process


@dataclass
class Verification:
    source: str
    converted: str
    input_shape: list[int]
    checks: list[CheckOutcome] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.passed is not False for check in self.checks)

    @property
    def first_failure(self) -> CheckOutcome | None:
        return next((c for c in self.checks if c.passed is False), None)

    def to_dict(self) -> dict[str, Any]:
        from . import __version__

        data = {"schema_version": VERIFY_SCHEMA_VERSION, "tool_version": __version__}
        data.update(asdict(self))
        data["passed"] = self.passed
        return data


def only_bn_trains(model: "nn.Module") -> "nn.Module":
    """BN-family modules in train mode, all else in eval: dropout/drop-path stay out of the comparison."""
    model.train()
    for module in model.modules():
        if not is_bn_like(module):
            module.training = False
    return model


def perturb_bn(model: "nn.Module", seed: int = SEED, strength: float = 1.0) -> "nn.Module":
    """Set every BN-family module's weight, bias and running stats to seeded values keyed by its path.

    ``strength`` scales the spread around the identity (weight 1, bias 0, mean 0, var 1);
    deep nets whose activations overflow at 1.0 get a milder one.
    """
    import torch

    with torch.no_grad():
        for path, module in model.named_modules():
            if not is_bn_like(module):
                continue
            for name in ("weight", "bias", "running_mean", "running_var"):
                tensor = module._parameters.get(name, module._buffers.get(name))
                if tensor is None:
                    continue
                generator = torch.Generator().manual_seed(seed + zlib.crc32(f"{path}.{name}".encode()))
                if name == "running_var":
                    values = 1.0 + strength * (torch.rand(tensor.shape, generator=generator) - 0.5)
                else:
                    noise = torch.randn(tensor.shape, generator=generator) * 0.5 * strength
                    values = noise + (1.0 if name == "weight" else 0.0)
                tensor.copy_(values)
    return model


def _max_diff(expected: list, actual: list) -> tuple[float, bool]:
    if len(expected) != len(actual) or any(a.shape != b.shape for a, b in zip(expected, actual)):
        return float("inf"), False
    diff = max(((a.double() - b.double()).abs().max().item() for a, b in zip(expected, actual) if a.numel()), default=0.0)
    return diff, True


@dataclass(frozen=True)
class Tolerance:
    """Bit-identical when both are zero; else |a - b| <= atol + rtol * max(|a|, 1) elementwise."""

    atol: float = 0.0
    rtol: float = 0.0

    @property
    def exact(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0

    def describe(self) -> str:
        return "bit-identical" if self.exact else f"atol {self.atol:g}, rtol {self.rtol:g}"


EXACT = Tolerance()


def _within(expected: list, actual: list, tol: Tolerance = EXACT) -> tuple[bool, float]:
    import torch

    diff, comparable = _max_diff(expected, actual)
    if not comparable:
        return False, diff
    if tol.exact:
        return all(torch.equal(a, b) for a, b in zip(expected, actual)), diff
    ok = all(
        torch.allclose(a.double(), b.double(), rtol=0.0, atol=tol.atol + tol.rtol * max(a.abs().max().item(), 1.0))
        for a, b in zip(expected, actual) if a.numel()
    )
    return ok, diff


def first_divergent_module(source: "nn.Module", converted: "nn.Module", x: "torch.Tensor",
                           tol: Tolerance = EXACT) -> str | None:
    """Run both models with forward hooks; name the first module (in the source's call order) whose output differs."""
    import torch

    recorded: dict[str, list] = {"source": [], "converted": []}

    def hook_all(model, key):
        handles = []
        for path, module in model.named_modules():
            if path:
                handles.append(module.register_forward_hook(
                    lambda m, i, o, path=path: recorded[key].append((path, type(m).__name__, flatten_tensors(o)))))
        return handles

    handles = hook_all(source, "source") + hook_all(converted, "converted")
    try:
        with torch.no_grad():
            source(x.clone())
            converted(x.clone())
    finally:
        for handle in handles:
            handle.remove()
    theirs = {}
    for path, cls, outputs in recorded["converted"]:
        theirs.setdefault(path, (cls, outputs))
    for path, cls, outputs in recorded["source"]:
        if path not in theirs:
            continue
        other_cls, other = theirs[path]
        same, _ = _within([o.detach() for o in outputs], [o.detach() for o in other], tol)
        if not same:
            return f"{path} ({other_cls}; in the source {cls})"
    return None


def _input(shape, model, seed: int, dtype=None) -> "torch.Tensor":
    import torch

    reference = next(iter(model.parameters()), None)
    dtype = dtype or (reference.dtype if reference is not None and reference.is_floating_point() else torch.float32)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _has_sync_layers(model: "nn.Module") -> bool:
    from .runtime import SyncBatchNorm

    return any(isinstance(m, SyncBatchNorm) for m in model.modules())


def _is_frozen_model(model: "nn.Module") -> bool:
    from .runtime import FrozenBatchNorm

    bn = [m for m in model.modules() if is_bn_like(m)]
    return bool(bn) and all(isinstance(m, FrozenBatchNorm) or "Frozen" in type(m).__name__ for m in bn)


def check_eval(source, converted, shape, tol: Tolerance = EXACT, *, seed=SEED, label="eval") -> CheckOutcome:
    import torch

    from .checks import preserved_modes

    x = _input(shape, source, seed)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        converted.eval()
        ok, diff = _within(flatten_tensors(source(x.clone())), flatten_tensors(converted(x.clone())), tol)
        where = None if ok else first_divergent_module(source, converted, x, tol)
    return CheckOutcome(label, ok, diff, tol.describe(), where)


def _running_stats(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    return {n: b for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))}


def check_train(source, converted, shape, tol: Tolerance = EXACT, *, seed=SEED, label="train, one process") -> CheckOutcome:
    """Outputs and running-stat updates of one train-mode forward (copies: the caller's models are untouched)."""
    import torch

    source, converted = only_bn_trains(copy.deepcopy(source)), only_bn_trains(copy.deepcopy(converted))
    x = _input(shape, source, seed)
    with torch.no_grad():
        ok, diff = _within(flatten_tensors(source(x.clone())), flatten_tensors(converted(x.clone())), tol)
    expected, actual = _running_stats(source), _running_stats(converted)
    stats_ok, stats_diff = _within(list(expected.values()), [actual.get(n, torch.empty(0)) for n in expected], tol)
    where = None
    if not ok:
        where = first_divergent_module(source, converted, x, tol)
    detail = "outputs and running statistics" + ("" if stats_ok else "; running statistics differ")
    return CheckOutcome(label, ok and stats_ok, max(diff, stats_diff), detail, where)


def check_frozen(source, converted, shape, tol: Tolerance = EXACT, *, seed=SEED,
                 label="frozen (train) == source (eval)") -> CheckOutcome:
    import torch

    from .checks import preserved_modes

    x = _input(shape, source, seed)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        only_bn_trains(converted)
        ok, diff = _within(flatten_tensors(source(x.clone())), flatten_tensors(converted(x.clone())), tol)
    return CheckOutcome(label, ok, diff, f"{tol.describe()}; frozen BN ignores batch statistics")


def _rank_worker(rank: int, world_size: int, payload: bytes, splits: list[int], seed: int) -> dict:
    import torch

    torch.set_num_threads(1)
    bundle = torch.load(io.BytesIO(payload), weights_only=False)  # written by this process's parent
    model = only_bn_trains(bundle["converted"])
    x, grad = bundle["x"], bundle["grad"]
    start = sum(splits[:rank])
    rows = slice(start, start + splits[rank])
    xs = x[rows].clone().requires_grad_()
    outputs = flatten_tensors(model(xs))
    loss = sum((o * g[rows]).sum() for o, g in zip(outputs, grad))
    loss.backward()
    return {
        "outputs": [o.detach() for o in outputs],
        "input_grad": xs.grad,
        "param_grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "stats": {n: b for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var", "num_batches_tracked"))},
    }


def rank_batch(world_sizes) -> int:
    """One batch for every world size checked: 3 + 2 per extra rank of the largest (5 for 2 ranks, 7 for 3)."""
    return 3 + 2 * (max(world_sizes) - 1)


def uneven_splits(batch: int, world_size: int) -> list[int]:
    """``batch`` rows over the ranks, never all equal: counts must weight the merge (7 -> [4, 3] or [3, 2, 2])."""
    share, extra = divmod(batch, world_size)
    splits = [share + 1] * extra + [share] * (world_size - extra)
    if extra == 0 and world_size > 1:
        splits[0], splits[-1] = splits[0] + 1, splits[-1] - 1
    return splits


@dataclass
class RankReference:
    """What W ranks must reproduce: the source in float64 on the whole batch.

    Computed once per model pair and shared by every world size (the float64
    forward/backward of the source is the parent's largest cost), with the bytes each
    rank loads: the converted model in float64, the batch and the output gradient.
    """

    batch: int
    payload: bytes
    outputs: list
    input_grad: "torch.Tensor"
    param_grads: dict
    stats: dict


def rank_reference(source, converted, shape, batch: int, *, seed=SEED) -> RankReference:
    import torch

    source64 = only_bn_trains(copy.deepcopy(source).double())
    converted64 = copy.deepcopy(converted).double()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *shape[1:]), generator=generator, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    outputs = flatten_tensors(source64(xr))
    grad = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    sum((o * g).sum() for o, g in zip(outputs, grad)).backward()
    buffer = io.BytesIO()
    torch.save({"converted": converted64, "x": x, "grad": grad}, buffer)
    return RankReference(
        batch, buffer.getvalue(), [o.detach() for o in outputs], xr.grad,
        {n: p.grad for n, p in source64.named_parameters() if p.grad is not None},
        {n: b.double() for n, b in source64.named_buffers()
         if n.endswith(("running_mean", "running_var", "num_batches_tracked"))},
    )


def check_ranks(source, converted, shape, world_size: int, *, seed=SEED, timeout: float = 600.0,
                label: str | None = None, pool=None, reference: RankReference | None = None,
                collective_timeout: float = 120.0) -> CheckOutcome:
    """W gloo ranks of the converted model on slices == the source on the whole batch (float64).

    ``pool`` (a ``multiproc.RankPool`` of at least W processes) runs the ranks in
    processes that are already started; without one, W processes are started for this
    check alone. ``reference`` (from ``rank_reference``) is reused when given.
    """
    import torch

    from .multiproc import RankFailure, RankPool

    label = label or f"{world_size} ranks"
    if not _has_sync_layers(converted):
        return CheckOutcome(label, None, detail="not applicable: the converted model has no sync layers")
    if reference is None:
        reference = rank_reference(source, converted, shape, rank_batch([world_size]), seed=seed)
    splits = uneven_splits(reference.batch, world_size)
    own_pool = RankPool(world_size, collective_timeout=collective_timeout) if pool is None else nullcontext(pool)
    try:
        with own_pool as ranks_pool:
            ranks = ranks_pool.run(world_size, _rank_worker, reference.payload, splits, seed, timeout=timeout)
    except RankFailure as error:
        return CheckOutcome(label, False, float("inf"), f"ranks failed: {str(error).splitlines()[0]}")

    problems, worst = [], 0.0

    def compare(name, expected, actual):
        nonlocal worst
        ok, diff = _within(expected, actual, Tolerance(rtol=DIST_RTOL))
        worst = max(worst, diff)
        if not ok:
            problems.append(name)

    for index, expected in enumerate(reference.outputs):
        compare(f"output {index}", [expected], [torch.cat([r["outputs"][index] for r in ranks])])
    compare("input gradient", [reference.input_grad], [torch.cat([r["input_grad"] for r in ranks])])
    for name, grad in reference.param_grads.items():
        summed = sum(r["param_grads"][name] for r in ranks if name in r["param_grads"])
        compare(f"grad {name}", [grad], [summed if isinstance(summed, torch.Tensor) else torch.zeros_like(grad)])
    for name, buf in reference.stats.items():
        compare(name, [buf], [ranks[0]["stats"][name].double()])
    detail = f"splits {splits}, float64" + (f"; differs: {', '.join(problems[:4])}" if problems else "")
    return CheckOutcome(label, not problems, worst, detail, problems[0] if problems else None)


def _timed(check: Callable[[], CheckOutcome], on_check: Callable[[CheckOutcome], None] | None) -> CheckOutcome:
    started = time.monotonic()
    outcome = check()
    outcome.seconds = time.monotonic() - started
    if on_check is not None:
        on_check(outcome)
    return outcome


def verify_models(source: "nn.Module", converted: "nn.Module", input_shape, *, world_sizes=(2,),
                  atol: float | None = None, perturb: bool = True, exact: bool = True,
                  source_name: str = "", converted_name: str = "", collective_timeout: float = 120.0,
                  on_check: Callable[[CheckOutcome], None] | None = None,
                  share_work: bool = True) -> Verification:
    """Run every check, then all of them again with identically perturbed BN state.

    ``exact=False`` (conversions from x*scale+shift frozen BN) compares within rtol 1e-4;
    ``atol`` relaxes bit-identity explicitly. ``on_check`` is told each check as it
    finishes. The N-rank checks share one pool of max(N) processes, started first so
    that their imports overlap with the one-process checks, and one float64 reference
    per variant (one batch for every N). ``share_work=False`` starts fresh processes and
    recomputes the reference for every N-rank check, as verify did before: the
    benchmark's yardstick (``scripts/bench_verify.py``).
    """
    from .multiproc import RankPool

    tol = Tolerance(atol=atol or 0.0, rtol=0.0 if exact else INEXACT_RTOL)
    result = Verification(source_name, converted_name, list(input_shape))
    variants = [("", source, converted)]
    if perturb:
        variants.append((" (perturbed)", perturb_bn(copy.deepcopy(source)), perturb_bn(copy.deepcopy(converted))))
    frozen = _is_frozen_model(converted)
    distributed = bool(world_sizes) and not frozen and _has_sync_layers(converted)
    pool = RankPool(max(world_sizes), collective_timeout=collective_timeout) if distributed and share_work else None

    def add(check: Callable[[], CheckOutcome]) -> None:
        result.checks.append(_timed(check, on_check))

    with pool if pool is not None else nullcontext():
        for suffix, src, conv in variants:
            add(lambda: check_eval(src, conv, input_shape, tol, label="eval" + suffix))
            if frozen:
                add(lambda: check_frozen(src, conv, input_shape, tol, label="frozen (train) == source (eval)" + suffix))
            else:
                add(lambda: check_train(src, conv, input_shape, tol, label="train, one process" + suffix))
        if not frozen:
            batch = rank_batch(world_sizes) if world_sizes else 0
            references = {}  # one float64 reference per variant, shared by every world size
            for world_size in world_sizes:
                for suffix, src, conv in variants:
                    def ranks_check(suffix=suffix, src=src, conv=conv, world_size=world_size) -> CheckOutcome:
                        if suffix not in references and distributed and share_work:
                            references[suffix] = rank_reference(src, conv, input_shape, batch)
                        return check_ranks(src, conv, input_shape, world_size, label=f"{world_size} ranks" + suffix,
                                           pool=pool, reference=references.get(suffix),
                                           collective_timeout=collective_timeout)

                    add(ranks_check)
    return result
