"""How two models' outputs are compared, for every check verify runs (one process or N ranks): what is compared
(the model's output, or a submodule's with ``compare_at``; BN in train mode and all else in eval), a tolerance
(bit-identical, or absolute and relative), tensors within it (masks and indices exactly), tensors within a share of
their norm (float32 sums in another order), outputs field by field by name, the first module whose output differs,
and the outcome of a check (``CheckOutcome``; vacuous where the outputs hold no values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bnsurgeon.checks.check_input import clone_value
from bnsurgeon.checks.eval_check import vacuous_reason
from bnsurgeon.checks.outputs import flatten_tensors, named_tensors
from bnsurgeon.core.anatomy import is_bn_like

if TYPE_CHECKING:
    import torch
    from torch import nn

#: the seed of every check's input, perturbation and output gradient
SEED = 0


@dataclass
class CheckOutcome:
    name: str
    passed: bool | None  # None: not applicable (skipped, with the reason in detail)
    max_abs_diff: float = 0.0
    detail: str = ""
    first_divergence: str | None = None
    seconds: float = 0.0  # wall time of this check in the verifying process
    values: int = 0  # how many values the check compared: 0 is a check that proved nothing


def only_bn_trains(model: "nn.Module") -> "nn.Module":
    """BN-family modules in train mode, all else in eval: dropout/drop-path stay out of the comparison."""
    model.train()
    for module in model.modules():
        if not is_bn_like(module):
            module.training = False
    return model


def max_diff(expected: list, actual: list) -> tuple[float, bool]:
    if len(expected) != len(actual) or any(a.shape != b.shape for a, b in zip(expected, actual, strict=True)):
        return float("inf"), False
    diff = max(
        ((a.double() - b.double()).abs().max().item() for a, b in zip(expected, actual, strict=True) if a.numel()),
        default=0.0,
    )
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
#: an inexact conversion judged again in float64, where rounding is 1e-16 relative
FLOAT64_AGREEMENT = Tolerance(rtol=1e-9)


def within(expected: list, actual: list, tol: Tolerance = EXACT) -> tuple[bool, float]:
    import torch

    diff, comparable = max_diff(expected, actual)
    if not comparable:
        return False, diff
    if tol.exact:
        return all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True)), diff
    ok = all(  # masks and indices (bool, int) compare exactly; values within the tolerance
        torch.equal(a, b)
        if not a.is_floating_point() and not a.is_complex()
        else torch.allclose(a.double(), b.double(), rtol=0.0, atol=tol.atol + tol.rtol * max(a.abs().max().item(), 1.0))
        for a, b in zip(expected, actual, strict=True)
        if a.numel()
    )
    return ok, diff


def within_norm(expected: list, actual: list, rtol: float) -> tuple[bool, float]:
    """Each tensor pair within ``rtol`` of the expected tensor's norm (or of 1): float32 sums in another order (ranks, a
    gathered merge) differ in single elements by far more than rounding of the whole, and a BN that does not
    sync differs by 1e-1 of it."""
    diff, comparable = max_diff(expected, actual)
    if not comparable:
        return False, diff
    ok = all(torch_equal_or_close(a, b, rtol) for a, b in zip(expected, actual, strict=True))
    return ok, diff


def torch_equal_or_close(a: "torch.Tensor", b: "torch.Tensor", rtol: float) -> bool:
    import torch

    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= rtol * max(a.norm().item(), 1.0))  # as within: a tensor near 0 is judged by 1


def compare_outputs(expected: Any, actual: Any, tol: Tolerance = EXACT) -> tuple[bool, float, str]:
    """Two model outputs field by field, by name: (within ``tol``, max |diff|, which fields differ or are
    missing on one side, "" when none)."""
    ours, theirs = dict(named_tensors(expected)), dict(named_tensors(actual))
    if list(ours) != list(theirs):
        missing, extra = [n for n in ours if n not in theirs], [n for n in theirs if n not in ours]
        if missing or extra:
            parts = ([f"only the source has {', '.join(missing[:3])}"] if missing else []) + (
                [f"only the converted model has {', '.join(extra[:3])}"] if extra else []
            )
            return False, float("inf"), "; ".join(parts)
        theirs = {name: theirs[name] for name in ours}  # same fields in another order: by name
    ok, diff = within(list(ours.values()), list(theirs.values()), tol)
    if ok:
        return True, diff, ""
    differing = [name for name in ours if not within([ours[name]], [theirs[name]], tol)[0]]
    return (
        False,
        diff,
        "differs: " + ", ".join(differing[:4]) + (f" (+{len(differing) - 4})" if len(differing) > 4 else ""),
    )


class _Snapshots:
    """Copies of module outputs taken when each module returns.

    A tensor returned again by the module around it (``return self.act(x)``, a Sequential)
    is copied once: it shares the copy while it is the same tensor at the same version
    (no in-place write since). The tensor itself is held only weakly, so its memory is
    never kept alive (and reused by another tensor under the same id) for this purpose.
    """

    def __init__(self) -> None:
        self._taken: dict[int, tuple] = {}

    def take(self, tensor: "torch.Tensor") -> "torch.Tensor":
        import weakref

        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor has no version counter: copy it every time
            return tensor.detach().clone()
        hit = self._taken.get(id(tensor))
        if hit is not None and hit[0]() is tensor and hit[1] == version:
            return hit[2]
        taken = tensor.detach().clone()
        self._taken[id(tensor)] = (weakref.ref(tensor), version, taken)
        return taken


def first_divergent_module(
    source: "nn.Module", converted: "nn.Module", x: "torch.Tensor", tol: Tolerance = EXACT
) -> str | None:
    """Name the first module (in the source's call order) whose output differs.

    Each output is taken when its module returns: a later in-place op (a residual
    ``hidden += shortcut(x)``, ``ReLU(inplace=True)``) rewrites the tensor a module
    returned, so outputs kept by reference until both forwards end would blame an earlier
    module for a later one's difference, or hide one. The source runs first and its
    outputs are copied as they are returned; the converted model's outputs are compared
    with those copies inside its own hooks, and never kept. Every call of a module is
    matched with the same call (a ReLU run twice in a block).
    """
    import torch

    snapshots = _Snapshots()
    expected: dict[str, list] = {}  # path -> per call: (position in the source's call order, class, copies)
    order = [0]

    def record(module, args, output, path):
        expected.setdefault(path, []).append(
            (order[0], type(module).__name__, [snapshots.take(t) for t in flatten_tensors(output)])
        )
        order[0] += 1

    calls: dict[str, int] = {}
    first: list[tuple[int, str]] = []  # the earliest divergence found so far: (source position, description)

    def compare(module, args, output, path):
        index = calls[path] = calls.get(path, -1) + 1
        if index >= len(expected.get(path, ())):
            return
        position, cls, copies = expected[path][index]
        if first and first[0][0] <= position:  # a module earlier in the source's order already differs
            return
        same, _ = within(copies, [t.detach() for t in flatten_tensors(output)], tol)
        if not same:
            first[:] = [(position, f"{path} ({type(module).__name__}; in the source {cls})")]

    def run_hooked(model, hook):  # one model at a time: source and converted share some child modules
        handles = [
            module.register_forward_hook(lambda m, i, o, path=path: hook(m, i, o, path))
            for path, module in model.named_modules()
            if path
        ]
        try:
            model(clone_value(x))
        finally:
            for handle in handles:
                handle.remove()

    with torch.no_grad():
        run_hooked(source, record)
        run_hooked(converted, compare)
    return first[0][1] if first else None


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


def vacuous_outcome(label: str, outputs: list, detail: str = "") -> CheckOutcome | None:
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


def count_values(tensors: list) -> int:
    """The values a comparison of ``tensors`` looks at."""
    return sum(t.numel() for t in tensors)
