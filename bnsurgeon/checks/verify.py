"""Prove a converted model behaves like its source: eval, train, N ranks, frozen.

Every check runs twice: on the models as given, and with the BN statistics and affine
parameters of both perturbed identically (seeded by module path). Freshly initialized
BN is close to the identity and hides lost behaviour; a perturbed one does not. The
N-rank check runs in float64, so any difference above rounding is a bug. How two outputs are
compared (tolerances, field by field, the first divergent module) is ``compare.py``'s; the N-rank
check itself (the model shipped to the ranks, the reference, the comparison) is ``ranks.py``'s.
"""

from __future__ import annotations

import copy
import glob
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.checks.check_input import CheckInput, cast_value, clone_value
from bnsurgeon.checks.compare import (
    EXACT,
    FLOAT64_AGREEMENT,
    SEED,
    CheckOutcome,
    Tolerance,
    compare_outputs,
    count_values,
    first_divergent_module,
    only_bn_trains,
    run_model,
    vacuous_outcome,
)
from bnsurgeon.checks.compare import within as _within
from bnsurgeon.checks.outputs import flatten_tensors
from bnsurgeon.checks.ranks import (  # noqa: F401  (rank_batch, RankReference, ship_model: verify's API as before)
    RankReference,
    check_ranks,
    has_sync_layers,
    rank_batch,
    rank_reference,
    ranks_timeout,
    ship_model,
    uneven_splits,
)
from bnsurgeon.core.anatomy import is_bn_like

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bnsurgeon.checks.torchrun_ranks import TorchrunWorld

VERIFY_SCHEMA_VERSION = 1
INEXACT_RTOL = 1e-4


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
    return vacuous_outcome(label, expected) or CheckOutcome(
        label, ok, diff, detail, where, values=count_values(expected)
    )


def _judged_in_float64(source, converted, x, compare_at) -> str:
    """For an inexact conversion (frozen x*scale+shift against batch_norm arithmetic) whose float32 outputs differ
    beyond the tolerance: the same comparison in float64, where rounding cannot hide a real difference. A model
    that amplifies float32 rounding (deformable attention samples at the positions it computes) agrees there to
    1e-12; a wrong conversion does not. Returns what float64 showed when it agrees, else ""."""
    import torch

    try:
        source64, converted64 = copy.deepcopy(source).double().eval(), copy.deepcopy(converted).double().eval()
        x64 = cast_value(clone_value(x), dtype=torch.float64)
        ok, diff, _ = compare_outputs(
            run_model(source64, clone_value(x64), compare_at),
            run_model(converted64, clone_value(x64), compare_at),
            FLOAT64_AGREEMENT,
        )
    except Exception:  # a model that does not run in float64 keeps its float32 verdict
        return ""
    return f"float32 rounding: in float64 the outputs agree to {diff:.2g}" if ok else ""


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
    return vacuous_outcome(label, expected) or CheckOutcome(
        label,
        ok and stats_ok,
        max(diff, stats_diff),
        detail,
        where,
        values=count_values(expected) + count_values(list(stats_expected.values())),
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
    return vacuous_outcome(label, expected) or CheckOutcome(
        label,
        ok,
        diff,
        f"{tol.describe()}; frozen BN ignores batch statistics" + (f"; {fields}" if fields else ""),
        values=count_values(expected),
    )


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
    collective_timeout: float | None = None,
    on_check: Callable[[CheckOutcome], None] | None = None,
    share_work: bool = True,
    compare_at: str | None = None,
    rebuild_converted: "Callable[[], nn.Module] | None" = None,
    torchrun: "TorchrunWorld | None" = None,
    precision: str = "float64",
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
    model's structure in each rank when the model itself does not pickle. ``torchrun``: this process is one
    rank of the N-rank check (``torchrun_ranks``), in ``precision`` on its device; the N-rank checks run first,
    every rank taking part, then rank 0 alone runs the one-process checks (its result lists them in ``-w N``'s
    order) and every other rank returns rank 0's result (or stops with its error's exit code).
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
    if torchrun is not None:
        world_sizes = (torchrun.world_size,)
    distributed = bool(world_sizes) and not frozen and has_sync_layers(converted)
    collective_timeout = collective_timeout or ranks_timeout()
    pool = (
        RankPool(max(world_sizes), collective_timeout=collective_timeout)
        if distributed and share_work and torchrun is None
        else None
    )
    at = {"compare_at": compare_at}
    thawed_for: dict[str, "nn.Module | None"] = {}

    def thawed(suffix: str, src: "nn.Module", conv: "nn.Module") -> "nn.Module | None":
        if suffix not in thawed_for:
            thawed_for[suffix] = thawed_reference(src, conv)
        return thawed_for[suffix]

    torchrun_outcomes: list[CheckOutcome] = []
    if torchrun is not None:
        from bnsurgeon.checks.torchrun_ranks import check_torchrun_ranks, leave_torchrun_world

        for suffix, src, conv in variants if not frozen else []:
            thawed_model = thawed(suffix, src, conv)
            against = "" if thawed_model is None else " vs source thawed"
            if not distributed:
                torchrun_outcomes.append(
                    CheckOutcome(
                        f"{torchrun.world_size} ranks" + against + suffix,
                        None,
                        detail="not applicable: the converted model has no sync layers",
                    )
                )
                continue
            outcome = check_torchrun_ranks(
                torchrun,
                src if thawed_model is None else thawed_model,
                conv,
                check_input,
                label=f"{torchrun.world_size} ranks" + against + suffix,
                precision=precision,
                compare_at=compare_at,
            )
            if outcome is not None:
                torchrun_outcomes.append(outcome)
        leave_torchrun_world(torchrun)

    def add(check: Callable[[], CheckOutcome]) -> None:
        result.checks.append(_timed(check, on_check))

    def remaining_checks() -> Verification:
        """The checks of one process (and -w N's ranks): under torchrun, rank 0's alone, the group closed."""
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
                thawed_model = thawed(suffix, src, conv)
                reference, against = (src, "") if thawed_model is None else (thawed_model, " vs source thawed")
                # batch_norm arithmetic both sides
                train_tol = tol if thawed_model is None else Tolerance(atol=tol.atol)
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
            for outcome in torchrun_outcomes:  # measured while every rank took part; told in -w N's order
                result.checks.append(outcome)
                if on_check is not None:
                    on_check(outcome)
            if not frozen and torchrun is None:
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
                                    ref_model,
                                    conv,
                                    check_input,
                                    batch,
                                    compare_at=compare_at,
                                    rebuild=rebuild_converted,
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

    if torchrun is None:
        return remaining_checks()
    from bnsurgeon.checks.torchrun_ranks import rank_0_alone

    return rank_0_alone(torchrun, remaining_checks)  # the same verdict, so the same exit code, on every rank


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
