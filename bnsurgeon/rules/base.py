"""The Rule record and the registry that maps exact classes to rules.

Matching is on exact type, never isinstance: a subclass may change forward, and
converting it as its base class would silently drop that behaviour (the bug of
``torch.nn.SyncBatchNorm.convert_sync_batchnorm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from bnsurgeon.core.anatomy import qualname
from bnsurgeon.core.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

TARGETS = ("sync", "plain", "frozen", "fused")
#: every rule builds these; ``fused`` is optional (a rule without it leaves its modules, saying so)
REQUIRED_TARGETS = ("sync", "plain", "frozen")
FROZEN_POLICIES = ("keep", "unfreeze")
ENTRY_POINT_GROUP = "bnsurgeon.rules"


@dataclass
class BuildContext:
    """What a builder may read (the options) and write (notes for the report)."""

    target: str
    frozen: str = "keep"
    process_group: Any = None
    notes: list[str] = field(default_factory=list)
    kept_reason: str | None = None
    inexact: bool = False  # set by a builder whose result computes eval with other (equivalent) arithmetic
    input_dims: int | None = None  # input rank the check input showed at this module (plain of _BatchNormXd)
    #: fused target only: the layer that feeds this BN (None: not foldable, see fold_reason)
    producer: "nn.Module | None" = None
    fold_reason: str | None = None
    #: fused target only: other modules the build replaces (id of old -> new), e.g. the folded producer
    replaces: dict[int, "nn.Module"] = field(default_factory=dict)

    def keep(self, module: "nn.Module", reason: str) -> "nn.Module":
        """Leave ``module`` as it is, and say why in the report."""
        self.kept_reason = reason
        return module


Builder = Callable[["nn.Module", BuildContext], "nn.Module"]


@dataclass(frozen=True)
class Rule:
    """One converter rule: the exact classes it claims and a builder per target.

    ``exact`` is False when a target computes eval outputs with different (equivalent)
    arithmetic from the source, e.g. torchvision's FrozenBatchNorm2d (x*scale+shift) to
    F.batch_norm; the pre-write check then compares within float tolerance instead of
    bit for bit.
    """

    name: str
    classes: tuple[type, ...]
    targets: Mapping[str, Builder]
    description: str = ""
    exact: bool = True

    def build(self, module: "nn.Module", context: BuildContext) -> "nn.Module":
        return self.targets[context.target](module, context)


class Registry:
    """Exact class -> Rule. Later registrations may replace earlier ones only with ``replace=True``."""

    def __init__(self, rules: Iterable[Rule] = ()) -> None:
        self._rules: list[Rule] = []
        self._by_class: dict[type, Rule] = {}
        #: the families of rules that joined once their package was imported (``default_registry``)
        self.joined: set[str] = set()
        for rule in rules:
            self.register(rule)

    def register(self, rule: Rule, *, replace: bool = False) -> Rule:
        missing = [t for t in REQUIRED_TARGETS if t not in rule.targets]
        if missing:
            raise UsageError(
                f"rule {rule.name!r} has no builder for {'target' if len(missing) == 1 else 'targets'} {', '.join(missing)}",
                "give Rule.targets a builder for each of sync, plain and frozen",
            )
        for cls in rule.classes:
            taken = self._by_class.get(cls)
            if taken is not None and not replace and taken.name != rule.name:
                raise UsageError(
                    f"{qualname(cls)} is already claimed by rule {taken.name!r}",
                    "pass replace=True to override it",
                )
        self._rules = [r for r in self._rules if r.name != rule.name]
        self._rules.append(rule)
        for cls in rule.classes:
            self._by_class[cls] = rule
        return rule

    def lookup(self, cls: type) -> Rule | None:
        return self._by_class.get(cls)

    def __iter__(self):
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)


def check_target(target: str, frozen: str = "keep") -> None:
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}", f"use one of: {', '.join(TARGETS)}")
    if frozen not in FROZEN_POLICIES:
        raise UsageError(f"unknown frozen policy {frozen!r}", f"use one of: {', '.join(FROZEN_POLICIES)}")
