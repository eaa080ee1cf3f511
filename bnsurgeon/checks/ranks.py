"""The N-rank check: W gloo ranks of the converted model, each on its slice of one batch, against the source on the
whole batch (float64; float32 within a share of each tensor's norm for a model that does not run in float64). The
converted model goes to the ranks pickled, or as its recipe and tensors where it does not pickle (``ship_model``);
the reference is computed once per model pair and shared by every world size (``rank_reference``)."""

from __future__ import annotations

import copy
import io
import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.checks.check_input import CheckInput, cast_value, clone_value, leaves
from bnsurgeon.checks.compare import (
    SEED,
    CheckOutcome,
    Tolerance,
    count_values,
    only_bn_trains,
    run_model,
    vacuous_outcome,
    within,
    within_norm,
)
from bnsurgeon.checks.outputs import per_sample
from bnsurgeon.core.errors import UnshippableModelError, first_line

if TYPE_CHECKING:
    from torch import nn

DIST_RTOL = 1e-6
#: the N-rank check of a model that only runs in float32: relative to each tensor's norm
FLOAT32_NORM_RTOL = 1e-3


def has_sync_layers(model: "nn.Module") -> bool:
    from bnsurgeon.runtime import SyncBatchNorm

    return any(isinstance(m, SyncBatchNorm) for m in model.modules())


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
    return run_share(model, bundle["input"], bundle["x"], bundle["grad"], splits, rank, bundle["compare_at"])


def run_share(
    model: "nn.Module",
    check_input: CheckInput,
    x,
    grad: list,
    splits: list[int],
    rank: int,
    compare_at: str | None,
    *,
    device=None,
    dtype=None,
    autocast: bool = False,
) -> dict:
    """One rank's part of the N-rank check: the converted model (BN training) on slice ``rank`` of ``x``, its
    loss's backward against that slice of the output gradient ``grad``; what the judge compares, on the CPU.
    ``device``/``dtype``: where and in what the slice runs (torchrun ranks; the pool's ranks run as sent);
    ``autocast``: under bf16 autocast on that device."""
    import torch

    first = sum(splits[:rank])
    xs = cast_value(clone_value(check_input.split(x, splits)[rank]), device, dtype)
    for leaf in leaves(xs):
        leaf.requires_grad_()
    context = torch.autocast(torch.device(device or "cpu").type, torch.bfloat16) if autocast else nullcontext()
    with context:
        samples = per_sample(run_model(model, xs, compare_at), splits[rank])
    if samples is None:
        raise RuntimeError("the converted model's outputs are not per sample")
    loss = _loss(samples, cast_value(grad[first : first + splits[rank]], device, dtype))
    if loss is not None and loss.requires_grad:
        loss.backward()

    def cpu(tensor):
        return None if tensor is None else tensor.detach().cpu()

    return {
        "outputs": [[cpu(o) for o in sample] for sample in samples],
        "input_grad": [cpu(leaf.grad) for leaf in leaves(xs)],
        "param_grads": {n: cpu(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        "stats": {
            n: cpu(b)
            for n, b in model.named_buffers()
            if n.endswith(("running_mean", "running_var", "num_batches_tracked"))
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
    grad: Any = None  # the output gradient, per sample (the ranks' loss is sum(output * grad))


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


def source_reference(
    source, shape, batch: int, *, seed=SEED, compare_at: str | None = None, dtype, device=None, drawn_in=None
) -> RankReference:
    """The source on the whole batch in ``dtype`` on ``device``, nothing shipped (torchrun's ranks hold the model)."""
    return _rank_reference(source, None, shape, batch, seed, compare_at, None, dtype, device=device, drawn_in=drawn_in)


def _rank_reference(
    source, converted, shape, batch: int, seed, compare_at, rebuild, dtype, *, device=None, drawn_in=None
) -> RankReference:
    """``converted`` None: nothing shipped (torchrun ranks hold the model). ``device``: where the source runs (its
    results come back to the CPU); ``drawn_in``: the dtype the input and output gradient are drawn in before they
    become ``dtype`` (the ranks' own precision, so that the reference sees exactly their values)."""
    import torch

    check_input = CheckInput.of_shape(shape).with_batch(batch, uniform=True)  # same-size images: same padding
    source64 = only_bn_trains(copy.deepcopy(source).to(device=device, dtype=dtype))
    generator = torch.Generator().manual_seed(seed)
    x = cast_value(check_input.make(generator=generator, dtype=drawn_in or dtype), None, dtype)
    xr = cast_value(clone_value(x), device, None)
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
    vacuous = vacuous_outcome("", [t for sample in samples for t in sample])
    if vacuous is not None:
        return RankReference(batch, b"", [], [], {}, {}, check_input, x, problem=(vacuous.max_abs_diff, vacuous.detail))
    grad = [
        [torch.randn(o.shape, generator=generator, dtype=drawn_in or dtype).to(dtype) for o in sample]
        for sample in samples
    ]
    loss = _loss(samples, cast_value(grad, device, None))
    if loss is not None and loss.requires_grad:
        loss.backward()
    payload = (
        b""
        if converted is None
        else ship_model(
            copy.deepcopy(converted).to(dtype),
            rebuild,
            {"x": x, "grad": grad, "input": check_input, "compare_at": compare_at, "dtype": dtype},
        )
    )
    input_grads = [leaf.grad.cpu() if leaf.grad is not None else torch.zeros_like(leaf).cpu() for leaf in leaves(xr)]
    reference = RankReference(
        batch,
        payload,
        [[o.detach().cpu() for o in sample] for sample in samples],
        input_grads,
        {n: p.grad.cpu() for n, p in source64.named_parameters() if p.grad is not None},
        {
            n: b.double().cpu()
            for n, b in source64.named_buffers()
            if n.endswith(("running_mean", "running_var", "num_batches_tracked"))
        },
        check_input,
        x,
    )
    reference.grad = grad
    return reference


#: the ranks' collective timeout where BNSURGEON_DIST_TIMEOUT is not set
DEFAULT_RANKS_TIMEOUT_S = 120.0


def ranks_timeout() -> float:
    """The check's ranks wait for each other at most this long: ``BNSURGEON_DIST_TIMEOUT`` where it is set (the run's
    timeout: a stopped rank is named after it), else 120 s."""
    import os

    from bnsurgeon.runtime.timeout import ENV_VAR, dist_timeout_s

    return dist_timeout_s() if os.environ.get(ENV_VAR, "").strip() else DEFAULT_RANKS_TIMEOUT_S


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
    collective_timeout: float | None = None,
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

    from bnsurgeon.checks.multiproc import RankFailure, RankPool

    label = label or f"{world_size} ranks"
    if not has_sync_layers(converted):
        return CheckOutcome(label, None, detail="not applicable: the converted model has no sync layers")
    if reference is None:
        reference = rank_reference(
            source, converted, shape, rank_batch([world_size]), seed=seed, compare_at=compare_at, rebuild=rebuild
        )
    if reference.problem is not None:
        diff, detail = reference.problem
        return CheckOutcome(label, False, diff, detail)
    splits = uneven_splits(reference.batch, world_size)
    collective_timeout = collective_timeout or ranks_timeout()
    timeout = max(timeout, 2 * collective_timeout + 60)  # the task outlasts a collective that waits its whole bound
    own_pool = RankPool(world_size, collective_timeout=collective_timeout) if pool is None else nullcontext(pool)
    try:
        with own_pool as ranks_pool:
            ranks = ranks_pool.run(world_size, _rank_worker, reference.payload, splits, seed, timeout=timeout)
    except RankFailure as error:
        return CheckOutcome(label, False, float("inf"), f"ranks failed: {str(error).splitlines()[0]}")

    tolerance = Tolerance(rtol=DIST_RTOL)

    def compare(name, expected, actual):
        return (
            within_norm(expected, actual, FLOAT32_NORM_RTOL)
            if reference.why_float32
            else within(expected, actual, tolerance)
        )

    problems, worst, values = judge_ranks(reference, ranks, splits, compare)
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


def judge_ranks(reference: RankReference, ranks: list[dict], splits: list[int], compare) -> tuple:
    """(what differs, the largest difference, values compared): every rank's outputs per sample, input gradient
    slices, parameter gradients summed over ranks and every rank's running statistics (a statistic that differs on
    some ranks only is named with them: ``4.running_var (rank 1)``), against ``reference``.
    ``compare(name, expected, actual)`` judges one quantity (-> (ok, diff))."""
    import torch

    problems, worst, values = [], 0.0, 0

    def judge(name, expected, actual):
        nonlocal worst, values
        values += count_values(expected)
        ok, diff = compare(name, expected, actual)
        worst = max(worst, diff)
        if not ok:
            problems.append(name)

    rank_samples = [sample for r in ranks for sample in r["outputs"]]
    for index, (expected, actual) in enumerate(zip(reference.samples, rank_samples, strict=True)):
        judge(f"output of sample {index}", expected, actual)
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
        judge(f"input gradient (rank {rank})", leaves(piece), theirs)
    for name, grad in reference.param_grads.items():
        summed = sum(r["param_grads"][name] for r in ranks if name in r["param_grads"])
        judge(f"grad {name}", [grad], [summed if isinstance(summed, torch.Tensor) else torch.zeros_like(grad)])
    for name, buf in reference.stats.items():
        differing = []
        for rank, r in enumerate(ranks):  # every rank's: one that started from other statistics ends elsewhere
            values += count_values([buf])
            theirs = r["stats"].get(name)
            ok, diff = compare(name, [buf], [theirs.double() if theirs is not None else torch.empty(0)])
            worst = max(worst, diff)
            if not ok:
                differing.append(rank)
        if differing:
            problems.append(name if len(differing) == len(ranks) else f"{name} ({_ranks_named(differing)})")
    return problems, worst, values


def _ranks_named(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 1, 3``, ``ranks 1, 2, 3 and 5 more``: which ranks a difference is on, in a few words."""
    shown = ", ".join(str(rank) for rank in ranks[:3]) + (f" and {len(ranks) - 3} more" if len(ranks) > 3 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
