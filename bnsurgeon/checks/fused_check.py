"""Checks for the ``fused`` target: eval outputs within float tolerance of the source.

A fold changes the arithmetic (one multiply-add instead of conv + normalize), so the
comparison is relative to each output's scale, not bit for bit. Fresh BN is near the
identity and would hide a wrong fold, so the check runs again on a copy of the source
with its BN state perturbed as ``verify`` does, folded with the same fold plan. Train
mode is not comparable: a folded BN no longer normalizes with batch statistics.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from bnsurgeon.checks.outputs import flatten_tensors
from bnsurgeon.core.layout import counted

if TYPE_CHECKING:
    from torch import nn

#: max |fused - source| / max |source| per output for the check to pass (fp32 folds measure ~1e-6)
FUSED_RTOL = 1e-4
TRAIN_NOT_APPLICABLE = "not applicable: a fused model has no BatchNorm to train (eval only)"


@dataclass
class FusedComparison:
    passed: bool | None  # None: undecidable (the source is chaotic at this state, see _float64_judgement)
    max_abs_diff: float
    max_rel_error: float
    detail: str


def relative_error(expected: list, actual: list) -> tuple[float, float]:
    """(max |diff|, max over outputs of max |diff| / max |expected|); inf when shapes differ, and
    where either side holds NaN (a NaN difference would otherwise vanish in ``max(0, nan)``)."""
    import math

    if (
        len(expected) != len(actual)
        or not expected
        or any(a.shape != b.shape for a, b in zip(expected, actual, strict=True))
    ):
        return float("inf"), float("inf")
    worst_abs = worst_rel = 0.0
    for a, b in zip(expected, actual, strict=True):
        if not a.numel():
            continue
        diff = (a.double() - b.double()).abs().max().item()
        if math.isnan(diff):
            return float("inf"), float("inf")
        scale = a.double().abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / scale if scale > 0 else diff)
    return worst_abs, worst_rel


def _eval_outputs(model: "nn.Module", x, what: str = "the model") -> list:
    import torch

    from bnsurgeon.core.running import run_forward

    saved = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            return flatten_tensors(run_forward(model.eval(), x.clone(), what))
    finally:
        for module, training in saved:
            module.training = training


#: the fold re-done on a float64 copy must match the float64 source this closely (exact arithmetic
#: up to float64 rounding, amplified by the net); a wrong fold errs by O(1) of the output scale
FLOAT64_RTOL = 1e-9
#: where float64 judges, the fused model's own outputs may drift from the float64 run at most this many
#: times as far as the source's do (float32/float16 rounding of the folded weights, amplified alike)
DRIFT_FACTOR = 10.0


def compare(
    source: "nn.Module",
    fused: "nn.Module",
    x,
    label: str,
    rtol: float = FUSED_RTOL,
    folds: list[dict[str, Any]] | None = None,
    *,
    judge_drift: bool = True,
) -> FusedComparison:
    """Within ``rtol`` of the output scale; failing that (float32 rounding amplified by a deep,
    ill-conditioned net), judged in float64 (see ``_float64_judgement``; ``judge_drift`` False
    for a state that is not the model's own, where the drift is reported, not judged)."""
    import torch

    expected, actual = _eval_outputs(source, x, "the source model"), _eval_outputs(fused, x, "the fused model")
    diff, rel = relative_error(expected, actual)
    finite = all(t.isfinite().all() for t in expected)
    fused_finite = all(t.isfinite().all() for t in actual)
    passed: bool | None = finite and fused_finite and rel <= rtol
    detail = f"{label}: max relative error {rel:.3g}"  # the tolerance is said once, by the caller
    if not finite:
        detail += "; the source's outputs are not finite"
    elif not fused_finite:
        bad = sum(int((~t.isfinite()).sum()) for t in actual)
        detail += f"; the fused model's outputs hold {counted(bad, 'NaN/inf value')} where the source's are finite"
    elif not passed and x.dtype != torch.float64 and folds is not None:
        passed, note = _float64_judgement(source, fused, folds, x, expected, actual, judge_drift=judge_drift)
        detail += "; " + note
    return FusedComparison(passed, diff, rel, detail)


def _float64_judgement(
    source, fused, folds, x, expected, actual, *, judge_drift: bool = True
) -> tuple[bool | None, str]:
    """Deep nets at random init (exploding activations, saturated SE gates) amplify float32
    rounding past any tolerance: the float32 source then differs as much from its own float64
    run. The fold is then proven in float64: the same folds re-done on a float64 copy of the
    source match the float64 source, and the float32 model's folded weights are exactly that
    float64 fold rounded to float32. "Match" is FLOAT64_RTOL, or, for an ill-conditioned net,
    10x its float64 noise floor: what nudging every folded BN's scale by 1e-15 (about 10x the
    fold's own float64 rounding) does to the output. Where that floor reaches the check's own
    tolerance / 10, float64 cannot judge a fold either (the model is chaotic at this state): None.

    An exact float64 fold does not make the float32 (or float16) model right: rounding the folded
    weights can lose them (a scale that underflows float16). To pass, the fused model's own
    outputs must also be within DRIFT_FACTOR x the source's drift from the float64 run. That is
    judged on the model's own state only: a perturbed state is random and can be ill-conditioned
    beyond what one float32 run of the source shows (random-init efficientnetv2_rw_m, perturbed: an
    error of 1.5e-4 entering blocks.5.17 leaves it 1e-2 off even in float64, while the float32
    source's own rounding happened to stay at 6e-6), so there the drift is reported, not failed;
    the fold itself is still proven there."""
    from bnsurgeon.surgery.walk import convert

    low = str(x.dtype).replace("torch.", "")
    try:
        source64 = copy.deepcopy(source).double()
        x64 = x.double()
        reference = _eval_outputs(source64, x64)
        refolded = convert(source64, "fused", folds=folds, allow_unhandled=True).model
        _, fold_rel = relative_error(reference, _eval_outputs(refolded, x64))
    except Exception as error:  # a model that cannot run in float64
        return False, f"no float64 reference ({type(error).__name__})"
    _, source_rel = relative_error(reference, [t.double() for t in expected])
    _, fused_rel = relative_error(reference, [t.double() for t in actual])
    same_weights = all(
        params_rounded_from(fused.get_submodule(f["producer"]), refolded.get_submodule(f["producer"])) for f in folds
    )
    note = (
        f"{low} rounding amplified by the net (the {low} source is {source_rel:.2g} from its own "
        f"float64 run); in float64 the fold errs {fold_rel:.2g}"
    )
    if not same_weights:
        return False, note + f"; the folded weights are NOT the float64 fold rounded to {low}"
    changed = unfolded_changes(source, fused, folds)
    if changed:  # float64 proves the folds only: everything else must be the source's own tensors
        shown = ", ".join(changed[:4]) + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else "")
        return False, note + f"; tensors outside the folds are NOT the source's: {shown}"
    drift = (
        ""
        if fused_rel <= DRIFT_FACTOR * source_rel
        else (
            f"; but the fused {low} model is {fused_rel:.2g} from the float64 run, more than {DRIFT_FACTOR:g}x the "
            f"source's own {source_rel:.2g} (its folded weights lose precision in {low}, e.g. underflow)"
        )
    )
    if drift and not judge_drift:
        note += (
            f"; at this state the fused {low} model is {fused_rel:.2g} from the float64 run (the source "
            f"{source_rel:.2g}): {low} rounding amplified by a random state, reported, not judged"
        )
        drift = ""
    if fold_rel <= FLOAT64_RTOL:
        return not drift, note + f" (tolerance {FLOAT64_RTOL:g})" + drift
    _, floor = relative_error(reference, _eval_outputs(_nudged(source64, folds), x64))
    if 10 * floor >= FUSED_RTOL:
        return None, note + (
            f"; undecidable: the source is chaotic at this state (nudging its folded BN scales "
            f"by 1e-15 moves its float64 output by {floor:.2g})"
        )
    return fold_rel <= 10 * floor and not drift, note + f" (tolerance 10x its float64 noise floor {floor:.2g})" + drift


def _nudged(source64: "nn.Module", folds: list[dict[str, Any]]) -> "nn.Module":
    """A copy of the float64 source with every folded BN's scale moved by a relative 1e-15."""
    import torch

    nudged = copy.deepcopy(source64)
    with torch.no_grad():
        for fold in folds:
            bn = nudged.get_submodule(fold["bn"])
            weight = bn._parameters.get("weight")
            if weight is not None:
                weight.mul_(1 + 1e-15)
            else:
                getattr(bn, "running_var").mul_(1 + 2e-15)  # noqa: B009  (typed: Module.__getattr__)
    return nudged


def unfolded_changes(source: "nn.Module", fused: "nn.Module", folds: list[dict[str, Any]]) -> list[str]:
    """State-dict entries of ``fused`` outside the folded producers that are not, bit for bit, the source's."""
    import torch

    producers = tuple(f["producer"] for f in folds)
    theirs = source.state_dict()
    changed = []
    for name, tensor in fused.state_dict().items():
        if any(name.startswith(p + ".") for p in producers):
            continue
        original = theirs.get(name)
        if (
            original is None
            or original.shape != tensor.shape
            or original.dtype != tensor.dtype
            or not torch.equal(original, tensor)
        ):
            changed.append(name)
    return changed


def params_rounded_from(low: "nn.Module", high: "nn.Module") -> bool:
    """Every parameter of ``low`` equals ``high``'s (float64) rounded to ``low``'s dtype, bit for bit."""
    import torch

    lows, highs = dict(low.named_parameters()), dict(high.named_parameters())
    return lows.keys() == highs.keys() and all(torch.equal(lows[k], highs[k].to(lows[k].dtype)) for k in lows)


def compare_perturbed(source: "nn.Module", folds: list[dict[str, Any]], x, rtol: float = FUSED_RTOL) -> FusedComparison:
    """Perturb a copy of the source's BN state (as verify does), fold it with the same plan, compare.

    Deep nets overflow at full perturbation; the strength is lowered 10x at a time until
    the source's outputs are finite (and the strength used is reported).
    """
    from bnsurgeon.checks.verify import perturb_bn
    from bnsurgeon.surgery.walk import convert

    strength = 1.0
    while True:
        perturbed = perturb_bn(copy.deepcopy(source), strength=strength)
        if all(t.isfinite().all() for t in _eval_outputs(perturbed, x)) or strength <= 1e-3:
            break
        strength /= 10
    fused = convert(perturbed, "fused", folds=folds, allow_unhandled=True).model
    label = "perturbed BN state" + ("" if strength == 1.0 else f" (strength {strength:g}: 1.0 overflows the source)")
    return compare(perturbed, fused, x, label, rtol, folds, judge_drift=False)


def check_fused(
    source: "nn.Module", fused: "nn.Module", folds: list[dict[str, Any]], x, rtol: float = FUSED_RTOL
) -> list[FusedComparison]:
    """The fused model as given, then the fold plan re-applied to a perturbed source."""
    return [compare(source, fused, x, "as converted", rtol, folds), compare_perturbed(source, folds, x, rtol)]


def verify_fused(
    source: "nn.Module",
    fused: "nn.Module",
    folds: list[dict[str, Any]],
    input_shape,
    *,
    atol: float | None = None,
    perturb: bool = True,
    source_name: str = "",
    converted_name: str = "",
    on_check: "Callable[[Any], None] | None" = None,
):
    """``bnsurgeon verify`` for a fused checkpoint: eval checks, and train checks marked not applicable.

    ``atol`` is the tolerance relative to the output's scale (default ``FUSED_RTOL``).
    ``on_check`` is told each check with its own time once both eval checks have run: a
    first check that float32 cannot decide takes its verdict from the perturbed one.
    """
    import time

    from bnsurgeon.checks.verify import CheckOutcome, Verification
    from bnsurgeon.surgery.fusion import example_tensor

    rtol = atol if atol is not None else FUSED_RTOL
    x = example_tensor(source, tuple(input_shape))
    result = Verification(source_name, converted_name, list(input_shape))
    runs = [("eval", lambda: compare(source, fused, x, "as converted", rtol, folds))]
    if perturb:
        runs.append(("eval (perturbed, re-folded)", lambda: compare_perturbed(source, folds, x, rtol)))
    done: list = []
    for label, run in runs:
        started = time.monotonic()
        done.append((label, run(), time.monotonic() - started))
    undecided = not any(outcome.passed for _, outcome, _ in done)
    for label, outcome, seconds in done:
        passed = False if undecided and outcome.passed is None else outcome.passed
        detail = f"{outcome.detail} (tolerance {rtol:g} of the output scale)" + (
            "; no check could judge the fold" if undecided and outcome.passed is None else ""
        )
        result.checks.append(CheckOutcome(label, passed, outcome.max_abs_diff, detail, seconds=seconds))
    result.checks.append(CheckOutcome("train", None, detail=TRAIN_NOT_APPLICABLE))
    if on_check is not None:
        for check in result.checks:
            on_check(check)
    return result


def fused_check_result(source: "nn.Module", result: Any, input_shape: tuple[int, ...], seed: int = 0):
    """The pre-write check of ``convert --to fused``, as the report's CheckResult (also noted in report.fusion)."""
    from bnsurgeon.surgery.fusion import example_tensor
    from bnsurgeon.surgery.report import CheckResult

    x = example_tensor(source, input_shape, seed)
    outcomes = check_fused(source, result.model, result.report.fusion["folded"], x)
    if outcomes[0].passed is False:  # NaN/inf from the source itself: say so (exit 9), not "outputs differ"
        from bnsurgeon.checks.eval_check import require_finite

        require_finite(source, _eval_outputs(source, x, "the source model"))
    result.report.fusion["max_rel_error"] = {
        "as_converted": outcomes[0].max_rel_error,
        "perturbed": outcomes[1].max_rel_error,
    }
    passed = all(o.passed is not False for o in outcomes) and any(o.passed for o in outcomes)
    return CheckResult(
        passed,
        f"close (max error <= {FUSED_RTOL:g} of the output scale)",
        max(o.max_abs_diff for o in outcomes),
        list(input_shape),
        seed,
        "; ".join(o.detail for o in outcomes),
    )
