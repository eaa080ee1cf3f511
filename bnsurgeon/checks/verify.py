"""Prove a converted model behaves like its source: eval, train, N ranks, frozen.

Every check runs twice: on the models as given, and with the BN statistics and affine
parameters of both perturbed identically (seeded by module path). Freshly initialized
BN is close to the identity and hides lost behaviour; a perturbed one does not. The
N-rank check runs in float64, so any difference above rounding is a bug. How two outputs are
compared (tolerances, field by field, the first divergent module) is ``compare.py``'s.
"""

from __future__ import annotations

import copy
import glob
import io
import re
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.checks.check_input import CheckInput, clone_value, leaves
from bnsurgeon.checks.compare import (
    EXACT,
    FLOAT64_AGREEMENT,
    Tolerance,
    compare_outputs,
    first_divergent_module,
)
from bnsurgeon.checks.compare import within as _within
from bnsurgeon.checks.compare import within_norm as _within_norm
from bnsurgeon.checks.eval_check import vacuous_reason
from bnsurgeon.checks.outputs import flatten_tensors, per_sample
from bnsurgeon.core.anatomy import is_bn_like
from bnsurgeon.core.errors import UnshippableModelError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

SEED = 0
VERIFY_SCHEMA_VERSION = 1
DIST_RTOL = 1e-6
INEXACT_RTOL = 1e-4
#: the N-rank check of a model that only runs in float32: relative to each tensor's norm
FLOAT32_NORM_RTOL = 1e-3


@dataclass
class CheckOutcome:
    name: str
    passed: bool | None  # None: not applicable (skipped, with the reason in detail)
    max_abs_diff: float = 0.0
    detail: str = ""
    first_divergence: str | None = None
    seconds: float = 0.0  # wall time of this check in the verifying process
    values: int = 0  # how many values the check compared: 0 is a check that proved nothing


@dataclass
class Verification:
    source: str
    converted: str
    input_shape: list[int]  # [] when the check input is a list or dict (see ``input``)
    checks: list[CheckOutcome] = field(default_factory=list)
    input: str = ""
    compare_at: str | None = None  # the submodule whose output was compared (None: the model's)
    #: why verify chose ``compare_at`` itself (the model's own outputs were empty); None: the user named it, or none
    compare_at_why: str | None = None

    @property
    def passed(self) -> bool:
        return all(check.passed is not False for check in self.checks)

    @property
    def first_failure(self) -> CheckOutcome | None:
        return next((c for c in self.checks if c.passed is False), None)

    def to_dict(self) -> dict[str, Any]:
        from bnsurgeon import __version__

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


def _input(shape, model, seed: int, dtype=None):
    import torch

    reference = next(iter(model.parameters()), None)
    dtype = dtype or (reference.dtype if reference is not None and reference.is_floating_point() else torch.float32)
    return CheckInput.of_shape(shape).make(seed=seed, dtype=dtype)


class _Reached(Exception):
    """Raised by the --compare-at hook: the output is captured, the rest of the forward is not needed."""


def run_model(model: "nn.Module", x, compare_at: str | None = None):
    """``model(x)``, or the output of submodule ``compare_at`` (the forward stops there)."""
    if compare_at is None:
        return model(x)
    from bnsurgeon.core.errors import UsageError

    captured: list = []
    normalized: list = []  # BN-family modules that ran before the output was captured

    def capture(module, args, output):
        captured.append(output)
        raise _Reached

    handles = [
        module.register_forward_pre_hook(lambda m, args: normalized.append(m) if not normalized else None)
        for module in model.modules()
        if is_bn_like(module)
    ]
    handles.append(model.get_submodule(compare_at).register_forward_hook(capture))
    try:
        model(x)
    except _Reached:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        raise UsageError(
            f"--compare-at {compare_at}: the forward never reached that module",
            "name a module the forward runs (see the model's named_modules())",
        )
    if not normalized:  # the compared output is computed before any BN: every check would pass vacuously
        raise UsageError(
            f"--compare-at {compare_at}: no BatchNorm-family module runs before that module's output, "
            "so comparing there tests nothing the conversion changed",
            "name a module that contains or follows the BN layers (e.g. backbone)",
        )
    return captured[0]


def check_compare_at(compare_at: str | None, *models: "nn.Module") -> None:
    """Refuse a --compare-at path that is not a submodule of every model, naming the top-level ones."""
    from bnsurgeon.core.errors import UsageError

    if compare_at is None:
        return
    for model in models:
        try:
            model.get_submodule(compare_at)
        except AttributeError:
            children = ", ".join(name for name, _ in model.named_children()) or "none"
            raise UsageError(
                f"--compare-at {compare_at!r} is not a submodule of the model",
                f"name a module path, e.g. one of: {children}",
            ) from None


def where_outputs_exist(models: "list[nn.Module]", check_input: CheckInput, seed: int = SEED) -> str | None:
    """Where the model's own outputs are empty for any of ``models`` (the source as the checks run it: eval and
    train, perturbed or not; a detector without trained weights keeps 0 boxes), the deepest submodule whose output
    holds values in all of them: batch-first floating tensors, computed after a BN module, by the module's one call
    per forward. The checks compare there instead of failing as vacuous. None where the outputs hold values, or
    where no submodule qualifies (the checks then say they are vacuous)."""
    import torch

    batch = check_input.batch
    empty, usable = False, []
    for model in models:
        order: list[str] = []
        normalized, handles = [False], []
        calls: dict = {}

        def mark(module, args, normalized=normalized):  # this model's flags (bound: the loop moves on)
            normalized[0] = True

        def record(module, args, output, path, calls=calls, normalized=normalized, order=order):
            calls[path] = calls.get(path, 0) + 1
            if normalized[0] and _holds_values(output, batch):
                order.append(path)

        for path, module in model.named_modules():
            if is_bn_like(module):
                handles.append(module.register_forward_pre_hook(mark))
            if path:
                handles.append(module.register_forward_hook(lambda m, a, o, path=path: record(m, a, o, path)))
        try:
            with torch.no_grad():
                output = model(_input(check_input, model, seed))
        finally:
            for handle in handles:
                handle.remove()
        empty = empty or not any(t.numel() for t in flatten_tensors(output))
        usable.append([path for path in order if calls[path] == 1])
    if not empty:
        return None
    everywhere = [path for path in usable[0] if all(path in other for other in usable[1:])]
    return everywhere[-1] if everywhere else None


def _holds_values(output: Any, batch: int) -> bool:
    """An output the checks can compare and the N-rank check can cut per sample: batch-first tensors, some
    floating with values, all finite."""
    tensors = flatten_tensors(output)
    return (
        bool(tensors)
        and all(t.dim() and t.shape[0] == batch for t in tensors)
        and any(t.is_floating_point() and t.numel() for t in tensors)
        and all(bool(t.isfinite().all()) for t in tensors if t.is_floating_point())
    )


def _vacuous(label: str, outputs: list, detail: str = "") -> CheckOutcome | None:
    reason = vacuous_reason(outputs)
    if reason is None:
        return None
    return CheckOutcome(
        label,
        False,
        float("nan"),
        f"vacuous, not a pass: {reason}"
        + (f" ({detail})" if detail else "")
        + "; compare where values exist (--compare-at MODULE, e.g. backbone)",
    )


def _has_sync_layers(model: "nn.Module") -> bool:
    from bnsurgeon.runtime import SyncBatchNorm

    return any(isinstance(m, SyncBatchNorm) for m in model.modules())


def _is_frozen_model(model: "nn.Module") -> bool:
    from bnsurgeon.runtime import FrozenBatchNorm

    bn = [m for m in model.modules() if is_bn_like(m)]
    return bool(bn) and all(isinstance(m, FrozenBatchNorm) or "Frozen" in type(m).__name__ for m in bn)


def check_eval(
    source, converted, shape, tol: Tolerance = EXACT, *, seed=SEED, label="eval", compare_at: str | None = None
) -> CheckOutcome:
    import torch

    from bnsurgeon.core.running import preserved_modes

    x = _input(shape, source, seed)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        converted.eval()
        raw = run_model(source, clone_value(x), compare_at)
        expected = flatten_tensors(raw)
        ok, diff, fields = compare_outputs(raw, run_model(converted, clone_value(x), compare_at), tol)
        rejudged = "" if ok or tol.exact else _judged_in_float64(source, converted, x, compare_at)
        if rejudged:
            ok, fields = True, rejudged
        where = None if ok else first_divergent_module(source, converted, x, tol)
    detail = tol.describe() + (f"; {fields}" if fields else "")
    if not ok and not tol.exact and _is_detections(raw):
        detail += (
            "; the outputs are detections: top-k and NMS can turn a rounding-level difference into "
            "different boxes, so compare before the head (--compare-at backbone)"
        )
    return _vacuous(label, expected) or CheckOutcome(label, ok, diff, detail, where, values=_count(expected))


def _count(tensors: list) -> int:
    """The values a comparison of ``tensors`` looks at."""
    return sum(t.numel() for t in tensors)


def _judged_in_float64(source, converted, x, compare_at) -> str:
    """For an inexact conversion (frozen x*scale+shift against batch_norm arithmetic) whose float32 outputs differ
    beyond the tolerance: the same comparison in float64, where rounding cannot hide a real difference. A model
    that amplifies float32 rounding (deformable attention samples at the positions it computes) agrees there to
    1e-12; a wrong conversion does not. Returns what float64 showed when it agrees, else ""."""
    try:
        source64, converted64 = copy.deepcopy(source).double().eval(), copy.deepcopy(converted).double().eval()
        x64 = _to_double(clone_value(x))
        ok, diff, _ = compare_outputs(
            run_model(source64, clone_value(x64), compare_at),
            run_model(converted64, clone_value(x64), compare_at),
            FLOAT64_AGREEMENT,
        )
    except Exception:  # a model that does not run in float64 keeps its float32 verdict
        return ""
    return f"float32 rounding: in float64 the outputs agree to {diff:.2g}" if ok else ""


def _to_double(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _to_double(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_double(item) for item in value)
    return value


def _is_detections(output: Any) -> bool:
    """A detector's result: one dict (boxes, scores, labels, ...) per image."""
    return isinstance(output, (list, tuple)) and bool(output) and all(isinstance(item, dict) for item in output)


def _running_stats(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    return {n: b for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))}


def check_train(
    source,
    converted,
    shape,
    tol: Tolerance = EXACT,
    *,
    seed=SEED,
    label="train, one process",
    compare_at: str | None = None,
) -> CheckOutcome:
    """Outputs and running-stat updates of one train-mode forward (copies: the caller's models are untouched)."""
    import torch

    source, converted = only_bn_trains(copy.deepcopy(source)), only_bn_trains(copy.deepcopy(converted))
    x = _input(shape, source, seed)
    with torch.no_grad():
        raw = run_model(source, clone_value(x), compare_at)
        expected = flatten_tensors(raw)
        ok, diff, fields = compare_outputs(raw, run_model(converted, clone_value(x), compare_at), tol)
    stats_expected, actual = _running_stats(source), _running_stats(converted)
    stats_ok, stats_diff = _within(
        list(stats_expected.values()), [actual.get(n, torch.empty(0)) for n in stats_expected], tol
    )
    where = None
    if not ok:
        where = first_divergent_module(source, converted, x, tol)
    detail = (
        "outputs and running statistics"
        + (f"; {fields}" if fields else "")
        + ("" if stats_ok else "; running statistics differ")
    )
    return _vacuous(label, expected) or CheckOutcome(
        label,
        ok and stats_ok,
        max(diff, stats_diff),
        detail,
        where,
        values=_count(expected) + _count(list(stats_expected.values())),
    )


def check_frozen(
    source,
    converted,
    shape,
    tol: Tolerance = EXACT,
    *,
    seed=SEED,
    label="frozen (train) == source (eval)",
    compare_at: str | None = None,
) -> CheckOutcome:
    import torch

    from bnsurgeon.core.running import preserved_modes

    x = _input(shape, source, seed)
    with preserved_modes(source, converted), torch.no_grad():
        source.eval()
        only_bn_trains(converted)
        raw = run_model(source, clone_value(x), compare_at)
        expected = flatten_tensors(raw)
        ok, diff, fields = compare_outputs(raw, run_model(converted, clone_value(x), compare_at), tol)
    return _vacuous(label, expected) or CheckOutcome(
        label,
        ok,
        diff,
        f"{tol.describe()}; frozen BN ignores batch statistics" + (f"; {fields}" if fields else ""),
        values=_count(expected),
    )


def _loss(samples: list, grads: list):
    """sum(output * grad) over every floating output tensor of every sample."""
    terms = [
        (o * g).sum()
        for sample, sample_grads in zip(samples, grads, strict=True)
        for o, g in zip(sample, sample_grads, strict=True)
        if o.is_floating_point()
    ]
    return sum(terms) if terms else None


def _rank_model(bundle: dict) -> "nn.Module":
    """The converted model in float64: as sent, or built here from its recipe and given the sent tensors."""
    if "converted" in bundle:
        return bundle["converted"]
    model = bundle["rebuild"]().to(bundle["dtype"])
    model.load_state_dict(bundle["state"], strict=True)
    return model


def _rank_worker(rank: int, world_size: int, payload: bytes, splits: list[int], seed: int) -> dict:
    import torch

    torch.set_num_threads(1)
    bundle = torch.load(io.BytesIO(payload), weights_only=False)  # written by this process's parent
    model = only_bn_trains(_rank_model(bundle))
    check_input: CheckInput = bundle["input"]
    first = sum(splits[:rank])
    xs = clone_value(check_input.split(bundle["x"], splits)[rank])
    for leaf in leaves(xs):
        leaf.requires_grad_()
    samples = per_sample(run_model(model, xs, bundle["compare_at"]), splits[rank])
    if samples is None:
        raise RuntimeError("the converted model's outputs are not per sample")
    loss = _loss(samples, bundle["grad"][first : first + splits[rank]])
    if loss is not None and loss.requires_grad:
        loss.backward()
    return {
        "outputs": [[o.detach() for o in sample] for sample in samples],
        "input_grad": [leaf.grad for leaf in leaves(xs)],
        "param_grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "stats": {
            n: b for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var", "num_batches_tracked"))
        },
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
    """What W ranks must reproduce: the source in float64 on the whole batch, per sample.

    Computed once per model pair and shared by every world size (the float64
    forward/backward of the source is the parent's largest cost), with the bytes each
    rank loads: the converted model in float64, the batch, its CheckInput and the output
    gradient. ``problem`` (not per sample, or vacuous) makes every N-rank check fail with it.
    """

    batch: int
    payload: bytes
    samples: list
    input_grads: list
    param_grads: dict
    stats: dict
    check_input: "CheckInput | None" = None
    x: Any = None
    problem: "tuple[float, str] | None" = None
    why_float32: str = ""  # why the reference is float32, not float64 (the model does not run in float64)


def ship_model(model: "nn.Module", rebuild: "Callable[[], nn.Module] | None", rest: dict) -> bytes:
    """The bytes each rank loads: the model pickled with ``rest``, or, where the model does not pickle,
    its recipe (``rebuild``, built in the rank) and its tensors.

    Pickling sends the very object that was checked, so it is the first choice. Models whose Python
    objects are not picklable (transformers 5 installs output-capturing hooks that are local closures,
    and a fresh process also needs transformers' per-instance capture registry) are built in each rank
    by the same code that built them here, then given exactly these tensors.
    """
    import torch

    buffer = io.BytesIO()
    try:
        torch.save({"converted": model, **rest}, buffer)
        return buffer.getvalue()
    except Exception as error:  # pickle, AttributeError on local objects, RuntimeError on parametrized modules
        if rebuild is None:
            raise UnshippableModelError(
                f"the converted model cannot be sent to the rank processes ({type(error).__name__}: "
                f"{first_line(error)}) and was not built from a recipe bnsurgeon can repeat in them"
            ) from None
    buffer = io.BytesIO()
    torch.save({"rebuild": rebuild, "state": model.state_dict(), **rest}, buffer)
    return buffer.getvalue()


def rank_reference(
    source,
    converted,
    shape,
    batch: int,
    *,
    seed=SEED,
    compare_at: str | None = None,
    rebuild: "Callable[[], nn.Module] | None" = None,
) -> RankReference:
    """In float64; in float32 for a model that does not run in float64 (one that makes float32 tensors of
    its own, as DAB-DETR's sine position embedding does), judged then within rounding (``check_ranks``)."""
    import torch

    try:
        return _rank_reference(source, converted, shape, batch, seed, compare_at, rebuild, torch.float64)
    except RuntimeError as error:
        if not re.search(r"dtype|Double|double|Float\b|float\b", str(error)):
            raise
        reference = _rank_reference(source, converted, shape, batch, seed, compare_at, rebuild, torch.float32)
        reference.why_float32 = f"{type(error).__name__}: {first_line(error)[:160]}"
        return reference


def _rank_reference(source, converted, shape, batch: int, seed, compare_at, rebuild, dtype) -> RankReference:
    import torch

    check_input = CheckInput.of_shape(shape).with_batch(batch, uniform=True)  # same-size images: same padding
    source64 = only_bn_trains(copy.deepcopy(source).to(dtype))
    converted64 = copy.deepcopy(converted).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    x = check_input.make(generator=generator, dtype=dtype)
    xr = clone_value(x)
    for leaf in leaves(xr):
        leaf.requires_grad_()
    samples = per_sample(run_model(source64, xr, compare_at), batch)
    if samples is None:
        return RankReference(
            batch,
            b"",
            [],
            [],
            {},
            {},
            check_input,
            x,
            problem=(
                float("inf"),
                "the outputs are not per sample (neither batch-first tensors nor one result per "
                "image), so ranks cannot be lined up; compare at a submodule (--compare-at MODULE)",
            ),
        )
    vacuous = _vacuous("", [t for sample in samples for t in sample])
    if vacuous is not None:
        return RankReference(batch, b"", [], [], {}, {}, check_input, x, problem=(vacuous.max_abs_diff, vacuous.detail))
    grad = [[torch.randn(o.shape, generator=generator, dtype=dtype) for o in sample] for sample in samples]
    loss = _loss(samples, grad)
    if loss is not None and loss.requires_grad:
        loss.backward()
    payload = ship_model(
        converted64, rebuild, {"x": x, "grad": grad, "input": check_input, "compare_at": compare_at, "dtype": dtype}
    )
    input_grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves(xr)]
    return RankReference(
        batch,
        payload,
        [[o.detach() for o in sample] for sample in samples],
        input_grads,
        {n: p.grad for n, p in source64.named_parameters() if p.grad is not None},
        {
            n: b.double()
            for n, b in source64.named_buffers()
            if n.endswith(("running_mean", "running_var", "num_batches_tracked"))
        },
        check_input,
        x,
    )


def check_ranks(
    source,
    converted,
    shape,
    world_size: int,
    *,
    seed=SEED,
    timeout: float = 600.0,
    label: str | None = None,
    pool=None,
    reference: RankReference | None = None,
    collective_timeout: float = 120.0,
    compare_at: str | None = None,
    rebuild: "Callable[[], nn.Module] | None" = None,
) -> CheckOutcome:
    """W gloo ranks of the converted model on slices == the source on the whole batch (float64).

    Outputs are compared per sample: a batch-first tensor is cut along its first dimension,
    a detector's list of per-image results is taken image by image, so ranks holding 3 and
    2 images line up with the source's 5. ``pool`` (a ``multiproc.RankPool`` of at least
    W processes) runs the ranks in processes that are already started; without one, W
    processes are started for this check alone. ``reference`` (from ``rank_reference``)
    is reused when given. ``rebuild`` builds the converted model's structure again in a rank where the
    model itself does not pickle (``ship_model``).
    """
    import torch

    from bnsurgeon.checks.multiproc import RankFailure, RankPool

    label = label or f"{world_size} ranks"
    if not _has_sync_layers(converted):
        return CheckOutcome(label, None, detail="not applicable: the converted model has no sync layers")
    if reference is None:
        reference = rank_reference(
            source, converted, shape, rank_batch([world_size]), seed=seed, compare_at=compare_at, rebuild=rebuild
        )
    if reference.problem is not None:
        diff, detail = reference.problem
        return CheckOutcome(label, False, diff, detail)
    splits = uneven_splits(reference.batch, world_size)
    own_pool = RankPool(world_size, collective_timeout=collective_timeout) if pool is None else nullcontext(pool)
    try:
        with own_pool as ranks_pool:
            ranks = ranks_pool.run(world_size, _rank_worker, reference.payload, splits, seed, timeout=timeout)
    except RankFailure as error:
        return CheckOutcome(label, False, float("inf"), f"ranks failed: {str(error).splitlines()[0]}")

    problems, worst, values = [], 0.0, 0

    tolerance = Tolerance(rtol=DIST_RTOL)

    def compare(name, expected, actual):
        nonlocal worst, values
        values += _count(expected)
        ok, diff = (
            _within_norm(expected, actual, FLOAT32_NORM_RTOL)
            if reference.why_float32
            else _within(expected, actual, tolerance)
        )
        worst = max(worst, diff)
        if not ok:
            problems.append(name)

    rank_samples = [sample for r in ranks for sample in r["outputs"]]
    for index, (expected, actual) in enumerate(zip(reference.samples, rank_samples, strict=True)):
        compare(f"output of sample {index}", expected, actual)
    check_input, x = reference.check_input, reference.x
    assert check_input is not None, "the reference run records its check input"
    grad_value = (
        reference.input_grads[0]
        if check_input.kind == "tensor"
        else (reference.input_grads if check_input.kind == "list" else dict(zip(x, reference.input_grads, strict=True)))
    )
    for rank, (piece, r) in enumerate(zip(check_input.split(grad_value, splits), ranks, strict=True)):
        theirs = [
            g if g is not None else torch.zeros_like(e) for g, e in zip(r["input_grad"], leaves(piece), strict=True)
        ]
        compare(f"input gradient (rank {rank})", leaves(piece), theirs)
    for name, grad in reference.param_grads.items():
        summed = sum(r["param_grads"][name] for r in ranks if name in r["param_grads"])
        compare(f"grad {name}", [grad], [summed if isinstance(summed, torch.Tensor) else torch.zeros_like(grad)])
    for name, buf in reference.stats.items():
        compare(name, [buf], [ranks[0]["stats"][name].double()])
    precision = (
        f"float32, each tensor within {FLOAT32_NORM_RTOL:g} of its norm or 1 (the model does not run in "
        f"float64: {reference.why_float32})"
        if reference.why_float32
        else "float64"
    )
    detail = f"splits {splits}, {precision}, per sample" + (f"; differs: {', '.join(problems[:4])}" if problems else "")
    return CheckOutcome(
        label, not problems, worst, detail, values=values
    )  # what differs: a tensor (detail), not a module


def _timed(check: Callable[[], CheckOutcome], on_check: Callable[[CheckOutcome], None] | None) -> CheckOutcome:
    started = time.monotonic()
    outcome = check()
    outcome.seconds = time.monotonic() - started
    if on_check is not None:
        on_check(outcome)
    return outcome


def verify_models(
    source: "nn.Module",
    converted: "nn.Module",
    input_shape,
    *,
    world_sizes=(2,),
    atol: float | None = None,
    perturb: bool = True,
    exact: bool = True,
    source_name: str = "",
    converted_name: str = "",
    collective_timeout: float = 120.0,
    on_check: Callable[[CheckOutcome], None] | None = None,
    share_work: bool = True,
    compare_at: str | None = None,
    rebuild_converted: "Callable[[], nn.Module] | None" = None,
) -> Verification:
    """Run every check, then all of them again with identically perturbed BN state.

    ``input_shape`` is a tensor shape or a ``CheckInput`` (list/dict inputs);
    ``exact=False`` (conversions from x*scale+shift frozen BN) compares within rtol 1e-4;
    ``atol`` relaxes bit-identity explicitly; ``compare_at`` compares the output of that
    submodule instead of the model's (a detector head's output is not comparable after
    perturbation: 0 boxes). ``on_check`` is told each check as it finishes. The N-rank
    checks share one pool of max(N) processes (forked from a server that imported torch
    and timm once) and one float64 reference per variant (one batch
    for every N). ``share_work=False`` starts fresh processes and recomputes the reference
    for every N-rank check (forked from the same server, so it does not show what spawned
    ranks cost), as verify did before the pool: the benchmark's yardstick
    (``scripts/bench_verify.py``). ``rebuild_converted`` (a picklable callable) builds the converted
    model's structure in each rank when the model itself does not pickle.
    """
    from bnsurgeon.checks.multiproc import RankPool
    from bnsurgeon.core.running import preserved_modes

    check_compare_at(compare_at, source, converted)
    check_input = CheckInput.of_shape(input_shape)
    tol = Tolerance(atol=atol or 0.0, rtol=0.0 if exact else INEXACT_RTOL)
    variants = [("", source, converted)]
    if perturb:
        variants.append((" (perturbed)", perturb_bn(copy.deepcopy(source)), perturb_bn(copy.deepcopy(converted))))
    why = None
    if compare_at is None:  # the model's outputs empty (0 boxes): compare where values exist, and say where
        with preserved_modes(*(src for _, src, _ in variants)):
            runs = [src.eval() for _, src, _ in variants] + [
                only_bn_trains(copy.deepcopy(src)) for _, src, _ in variants
            ]
            compare_at = where_outputs_exist(runs, check_input)
        if compare_at is not None:
            why = (
                f"the model's outputs are empty (e.g. a detector returned 0 boxes): compared at {compare_at}, the "
                "deepest module whose outputs hold values"
            )
    result = Verification(
        source_name,
        converted_name,
        list(check_input.shape or []),
        input=check_input.describe(),
        compare_at=compare_at,
        compare_at_why=why,
    )
    frozen = _is_frozen_model(converted)
    distributed = bool(world_sizes) and not frozen and _has_sync_layers(converted)
    pool = RankPool(max(world_sizes), collective_timeout=collective_timeout) if distributed and share_work else None
    at = {"compare_at": compare_at}

    def add(check: Callable[[], CheckOutcome]) -> None:
        result.checks.append(_timed(check, on_check))

    with pool if pool is not None else nullcontext():
        references_for: dict[str, tuple] = {}  # suffix -> (reference model, label suffix)
        for suffix, src, conv in variants:
            add(partial(check_eval, src, conv, check_input, tol, label="eval" + suffix, **at))
            if frozen:
                add(
                    partial(
                        check_frozen,
                        src,
                        conv,
                        check_input,
                        tol,
                        label="frozen (train) == source (eval)" + suffix,
                        **at,
                    )
                )
                continue
            thawed = thawed_reference(src, conv)
            reference, against = (src, "") if thawed is None else (thawed, " vs source thawed")
            train_tol = tol if thawed is None else Tolerance(atol=tol.atol)  # thawed: batch_norm arithmetic both sides
            references_for[suffix] = (reference, against)
            add(
                partial(
                    check_train,
                    reference,
                    conv,
                    check_input,
                    train_tol,
                    label="train, one process" + against + suffix,
                    **at,
                )
            )
        if not frozen:
            batch = rank_batch(world_sizes) if world_sizes else 0
            references = {}  # one float64 reference per variant, shared by every world size
            for world_size in world_sizes:
                for suffix, _, conv in variants:
                    ref_model, against = references_for[suffix]

                    def ranks_check(
                        suffix=suffix, ref_model=ref_model, against=against, conv=conv, world_size=world_size
                    ) -> CheckOutcome:
                        if suffix not in references and distributed and share_work:
                            references[suffix] = rank_reference(
                                ref_model, conv, check_input, batch, compare_at=compare_at, rebuild=rebuild_converted
                            )
                        return check_ranks(
                            ref_model,
                            conv,
                            check_input,
                            world_size,
                            label=f"{world_size} ranks" + against + suffix,
                            pool=pool,
                            reference=references.get(suffix),
                            collective_timeout=collective_timeout,
                            compare_at=compare_at,
                            rebuild=rebuild_converted,
                        )

                    add(ranks_check)
    return result


def thawed_reference(source: "nn.Module", converted: "nn.Module") -> "nn.Module | None":
    """For an unfreeze result (frozen BN made trainable): the source with its frozen BN thawed to plain BN.

    Comparing the trainable model in train mode with the frozen source is not the
    property: frozen BN ignores batch statistics by design. What unfreeze must give is
    BN that trains exactly like plain BN holding the frozen layers' tensors; so the train
    and N-rank checks take that as the reference (the eval check still compares with the
    frozen source). None when nothing was thawed.
    """
    from bnsurgeon.core.anatomy import qualname
    from bnsurgeon.rules.builders import is_frozen_origin
    from bnsurgeon.surgery.walk import convert, plan

    theirs = dict(converted.named_modules())
    thawed = [
        entry
        for entry in plan(source)
        if is_frozen_origin(entry.cls_name)
        and entry.path in theirs
        and not is_frozen_origin(qualname(type(theirs[entry.path])))
    ]
    if not thawed:
        return None
    paths = [glob.escape(path) for entry in thawed for path in entry.paths]
    return convert(source, "plain", frozen="unfreeze", allow_unhandled=True, include=paths).model
