"""What BN-family modules a model has, what each rule would make of them, and what
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` would do to them instead."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.anatomy import qualname
from bnsurgeon.core.layout import counted
from bnsurgeon.rules import TARGETS, BuildContext, Registry, default_registry
from bnsurgeon.core.anatomy import is_uninitialized_lazy
from bnsurgeon.surgery.walk import plan

if TYPE_CHECKING:
    from torch import nn

EXAMPLE_PATHS = 3


@dataclass
class ClassGroup:
    cls: str
    count: int
    paths: int
    rule: str | None
    targets: dict[str, str]
    examples: list[str]
    torch_converter: str
    all_paths: list[str] = field(default_factory=list, repr=False)

    @property
    def handled(self) -> bool:
        return self.rule is not None


@dataclass
class Inspection:
    source: str
    parameters: int
    groups: list[ClassGroup] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checkpoint: dict[str, Any] | None = None

    @property
    def bn_modules(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def unhandled(self) -> int:
        return sum(g.count for g in self.groups if not g.handled)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["totals"] = {"bn_modules": self.bn_modules, "unhandled": self.unhandled, "parameters": self.parameters}
        return data


def torch_converter_effect(module: "nn.Module") -> str:
    """One line: what torch's convert_sync_batchnorm does to this module."""
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm

    if is_uninitialized_lazy(module):
        return "breaks: rebuilt with num_features=0"
    if not isinstance(module, _BatchNorm):
        return "ignored (not a _BatchNorm): left as is"
    lost = []
    if type(module) not in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        named = sorted(module.named_children(), key=lambda item: isinstance(item[1], nn.Identity))
        children = [
            f"{name}={type(child).__name__}" if not isinstance(child, nn.Identity) else name
            for name, child in named
        ]
        lost.append(
            "drops " + ", ".join(children) if children else f"drops {type(module).__name__}.forward (bare SyncBatchNorm)"
        )
    hooks = len(module._forward_hooks) + len(module._forward_pre_hooks)
    if hooks:
        lost.append(f"drops {counted(hooks, 'hook')}")
    if type(module) is nn.SyncBatchNorm:
        return "unchanged"
    if lost:
        return "; ".join(lost)
    return "ok (nn.SyncBatchNorm; CUDA only, no way back)"


def _target_classes(module: "nn.Module", rule) -> dict[str, str]:
    result = {}
    for target in TARGETS:
        if target == "fused":  # decided per module by the dataflow (its producer), not by the class alone
            result[target] = "foldable" if target in rule.targets else "kept (the rule has no fused builder)"
            continue
        context = BuildContext(target=target)
        try:
            built = rule.build(module, context)
        except Exception as error:  # a rule that cannot build this target says why
            result[target] = f"n/a ({error})"
            continue
        result[target] = "kept" if built is module else type(built).__name__
    return result


def inspect_model(model: "nn.Module", source: str = "", registry: Registry | None = None) -> Inspection:
    """Group the BN-family modules of ``model`` by exact class."""
    entries = plan(model, registry or default_registry())
    by_class: dict[type, list] = {}
    for entry in entries:
        by_class.setdefault(type(entry.module), []).append(entry)
    groups = []
    for cls, members in by_class.items():
        first = members[0]
        paths = [p for e in members for p in e.paths]
        groups.append(
            ClassGroup(
                cls=qualname(cls),
                count=len(members),
                paths=len(paths),
                rule=first.rule.name if first.rule else None,
                targets=_target_classes(first.module, first.rule) if first.rule else {t: "UNHANDLED" for t in TARGETS},
                examples=paths[:EXAMPLE_PATHS],
                torch_converter=torch_converter_effect(first.module),
                all_paths=paths,
            )
        )
    parameters = sum(p.numel() for p in model.parameters())
    return Inspection(source=source, parameters=parameters, groups=groups)
