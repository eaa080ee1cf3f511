"""What BN-family modules a model has, what each rule would make of them, and what
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` and transformers' ``replace_batch_norm``
would do to them instead."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.anatomy import is_uninitialized_lazy, qualname
from bnsurgeon.core.layout import counted
from bnsurgeon.rules import TARGETS, BuildContext, Registry, default_registry
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
    transformers_replace: str = ""
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
            f"{name}={type(child).__name__}" if not isinstance(child, nn.Identity) else name for name, child in named
        ]
        lost.append(
            "drops " + ", ".join(children)
            if children
            else f"drops {type(module).__name__}.forward (bare SyncBatchNorm)"
        )
    hooks = len(module._forward_hooks) + len(module._forward_pre_hooks)
    if hooks:
        lost.append(f"drops {counted(hooks, 'hook')}")
    if type(module) is nn.SyncBatchNorm:
        return "unchanged"
    if lost:
        return "; ".join(lost)
    return "ok (nn.SyncBatchNorm; CUDA only, no way back)"


# transformers' replace_batch_norm (DETR, ConditionalDetr, DeformableDetr, TableTransformer, RTDetr, DFine,
# GroundingDino, ...; the same function in each model module) swaps every nn.BatchNorm2d it reaches through
# named_children for a new <Model>FrozenBatchNorm2d(num_features) holding copies of weight, bias and the
# running statistics, whose forward is x * scale + shift with eps hard-coded to 1e-5, in float32 on the CPU.
TRANSFORMERS_FROZEN_EPS = 1e-5
_NORM_ACT_FORWARD = "timm.layers.norm_act.BatchNormAct2d"  # batch_norm, then self.drop, then self.act


def _forward_owner(cls: type) -> type:
    return next(klass for klass in cls.__mro__ if "forward" in vars(klass))


TRANSFORMERS_OK = "ok (frozen; eval within rounding)"


def transformers_replace_clauses(module: "nn.Module", paths: "list[str] | tuple[str, ...]" = ()) -> list[str]:
    """What transformers' ``replace_batch_norm`` does to this module, read from its anatomy: one clause
    per defect (``drops act=SiLU``, ``eps 0.001 -> 1e-05``, ...), none when its eval output survives.

    It is about the eval output: the replacement is frozen by design (no batch statistics,
    no running-stat updates), and computes x*scale+shift, equal to batch_norm within rounding.
    No transformers import: the function is the same in every DETR-family model module.
    """
    import torch
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm

    if not isinstance(module, nn.BatchNorm2d):
        return ["not replaced (not a BatchNorm2d)"]
    if paths and all(path == "<root>" for path in paths):
        return ["not replaced (the root: only children are)"]
    if module.weight is None:
        return ["fails (affine=False: it reads weight.device)"]
    if module.running_mean is None or module.running_var is None:
        return ["fails (no running stats to copy)"]
    lost = []
    owner = _forward_owner(type(module))
    if owner not in (nn.BatchNorm2d, _BatchNorm):
        if f"{owner.__module__}.{owner.__qualname__}" == _NORM_ACT_FORWARD:  # its act and drop are all it adds
            named = [(name, child) for name, child in module.named_children() if not isinstance(child, nn.Identity)]
            lost += [f"drops {name}={type(child).__name__}" for name, child in named if name != "drop"]
            lost += [f"drops drop={type(child).__name__} (train only)" for name, child in named if name == "drop"]
        else:
            lost.append(f"drops {owner.__name__}.forward")
    hooks = len(module._forward_hooks) + len(module._forward_pre_hooks)
    if hooks:
        lost.append(f"drops {counted(hooks, 'hook')}")
    if float(module.eps) != TRANSFORMERS_FROZEN_EPS:
        lost.append(f"eps {float(module.eps):g} -> {TRANSFORMERS_FROZEN_EPS:g}")
    if module.weight.dtype != torch.float32:
        lost.append(f"float32 buffers (was {str(module.weight.dtype).removeprefix('torch.')})")
    if module.weight.device.type not in ("cpu", "meta"):
        lost.append(f"buffers on cpu (was {module.weight.device.type})")
    return lost


def transformers_replace_effect(modules: "list[tuple[nn.Module, list[str]]]") -> str:
    """One line for a class: each clause of ``transformers_replace_clauses`` over its members, with how
    many members it applies to when not all (``drops act=SiLU (52/78); eps 0.001 -> 1e-05``)."""
    counts: dict[str, int] = {}
    clean = 0
    for module, paths in modules:
        clauses = transformers_replace_clauses(module, paths)
        clean += not clauses
        for clause in clauses:
            counts[clause] = counts.get(clause, 0) + 1
    total = len(modules)
    parts = [clause if n == total else f"{clause} ({n}/{total})" for clause, n in counts.items()]
    if clean and parts:
        parts.append(f"{TRANSFORMERS_OK} ({clean}/{total})")
    return "; ".join(parts) or TRANSFORMERS_OK


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
                transformers_replace=transformers_replace_effect([(e.module, e.paths) for e in members]),
                all_paths=paths,
            )
        )
    parameters = sum(p.numel() for p in model.parameters())
    return Inspection(source=source, parameters=parameters, groups=groups)
