"""Walk a module graph, match BN-family modules to rules by exact type, and rebuild.

By default the source model is left untouched: every converted module is new, every
container on the way to one is a shallow clone, and everything else (convs, acts,
Parameters, buffers) is shared. Source and result therefore hold one copy of the
weights between them, and the pre-write check can compare the two directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bnsurgeon.core.anatomy import is_bn_like, is_uninitialized_lazy, qualname
from bnsurgeon.core.errors import (
    BnSurgeonError,
    LazyModuleError,
    RuleRaisedError,
    UnhandledModuleError,
    UsageError,
    first_line,
)
from bnsurgeon.core.layout import counted, shown
from bnsurgeon.core.module_copy import carry_hooks, shallow_clone
from bnsurgeon.rules import BuildContext, Registry, Rule, builtin_rules, check_target, default_registry
from bnsurgeon.surgery.report import ModuleChange, ModuleKept, Report

if TYPE_CHECKING:
    from torch import nn


@dataclass
class PlanEntry:
    """One BN-like module (once, however many names reach it) and the rule that claims it."""

    module: "nn.Module"
    paths: list[str]
    rule: Rule | None

    @property
    def path(self) -> str:
        return self.paths[0]

    @property
    def cls_name(self) -> str:
        return qualname(type(self.module))


def plan(model: "nn.Module", registry: Registry | None = None) -> list[PlanEntry]:
    """Every BN-like module of ``model`` with all its paths, in first-visit order."""
    registry = registry or default_registry()
    entries: dict[int, PlanEntry] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if not is_bn_like(module) and not is_uninitialized_lazy(module):
            continue
        entry = entries.get(id(module))
        if entry is None:
            entries[id(module)] = PlanEntry(module, [path or "<root>"], registry.lookup(type(module)))
        else:
            entry.paths.append(path or "<root>")
    return list(entries.values())


def _describe(entries: list[PlanEntry], limit: int = 12) -> str:
    shown = [f"{e.path} ({type(e.module).__name__})" for e in entries[:limit]]
    more = f" and {len(entries) - limit} more" if len(entries) > limit else ""
    return ", ".join(shown) + more


@dataclass
class ConvertResult:
    """The converted model, the report, and the untouched source (sharing its tensors)."""

    model: "nn.Module"
    report: Report
    source: "nn.Module"
    exact: bool = True
    replaced: dict[int, "nn.Module"] = field(default_factory=dict)


def convert(
    model: "nn.Module",
    to: str = "sync",
    *,
    frozen: str = "keep",
    allow_unhandled: bool = False,
    process_group: Any = None,
    inplace: bool = False,
    registry: Registry | None = None,
    include: "tuple[str, ...] | list[str]" = (),
    exclude: "tuple[str, ...] | list[str]" = (),
    input_dims: "dict[str, int] | None" = None,
    example_input: Any = None,
    folds: Any = None,
) -> ConvertResult:
    """Convert every BN-family module of ``model`` to ``to`` (sync, plain, frozen or fused).

    ``fused`` folds each BN into the Conv/Linear that feeds it; the producers are found on
    ``example_input`` (a tensor or an input shape), or taken from ``folds`` (records of a
    checkpoint, validated against the model).

    Raises LazyModuleError for an uninitialized LazyBatchNorm and UnhandledModuleError
    for BN-like modules no rule claims (unless ``allow_unhandled``), before changing
    anything. ``include``/``exclude`` are module-path globs (``backbone.body.layer1.*``): only
    modules a name of which matches an include (all, when none is given) and none of
    whose names matches an exclude are converted; the rest are kept, and the report says
    which filter kept them.
    """
    check_target(to, frozen)
    include, exclude = check_filters(include, exclude)
    _refuse_ddp_copy(model, inplace)
    _refuse_compiled_copy(model, inplace)
    entries = plan(model, registry)
    lazy = [e for e in entries if is_uninitialized_lazy(e.module)]
    if lazy:
        raise LazyModuleError(f"uninitialized lazy batch norm has no size yet: {_describe(lazy)}")
    unhandled = [e for e in entries if e.rule is None]
    if unhandled and not allow_unhandled:
        raise UnhandledModuleError(
            f"no rule for {'this BatchNorm-like module' if len(unhandled) == 1 else 'these BatchNorm-like modules'}: {_describe(unhandled)}"
        )
    _refuse_unmatched_filters(entries, include, exclude)

    report = Report(
        target=to,
        options={
            "frozen": frozen,
            "allow_unhandled": allow_unhandled,
            "inplace": inplace,
            "include": list(include),
            "exclude": list(exclude),
        },
    )
    replacements: dict[int, nn.Module] = {}
    exact = True
    fold_plan = None
    if to == "fused":
        from bnsurgeon.surgery.fusion import fusion_plan

        fold_plan = fusion_plan(model, example_input, folds)
        exact = False
    for entry in entries:
        filtered = filtered_out(entry.paths, include, exclude)
        if filtered is not None:
            report.kept.append(
                ModuleKept(
                    entry.path, entry.paths[1:], entry.cls_name, entry.rule.name if entry.rule else None, filtered
                )
            )
            continue
        if entry.rule is None:
            report.unhandled.append(
                ModuleKept(
                    entry.path, entry.paths[1:], entry.cls_name, None, "no rule claims this class (left untouched)"
                )
            )
            continue
        dims = next((input_dims[p] for p in entry.paths if p in input_dims), None) if input_dims else None
        context = BuildContext(target=to, frozen=frozen, process_group=process_group, input_dims=dims)
        if fold_plan is not None:
            fold_plan.prepare(context, model, entry.path, entry.rule)
        new = _build(entry, context) if to in entry.rule.targets else entry.module
        if new is entry.module:
            report.kept.append(
                ModuleKept(
                    entry.path, entry.paths[1:], entry.cls_name, entry.rule.name, context.kept_reason or "unchanged"
                )
            )
            continue
        _carry_over(entry.module, new, entry.path)
        replacements[id(entry.module)] = new
        replacements.update(context.replaces)
        exact = exact and entry.rule.exact and not context.inexact
        report.changed.append(
            ModuleChange(
                path=entry.path,
                aliases=entry.paths[1:],
                from_class=entry.cls_name,
                to_class=qualname(type(new)),
                rule=entry.rule.name,
                children=[f"{name}={type(child).__name__}" for name, child in new.named_children()],
                notes=context.notes,
            )
        )

    if fold_plan is not None:
        report.fusion = fold_plan.summary(report)
    originals = {id(module): module for module in model.modules()}  # held: their ids stay theirs
    memo: dict[int, "nn.Module"] = {}
    converted = _rebuild(model, replacements, inplace, memo)
    relink_plain_references(converted, memo, originals, inplace)
    name_sync_layers(converted)
    before = set(model.state_dict(keep_vars=True)) if not inplace else None
    after = set(converted.state_dict(keep_vars=True))
    if before is not None:
        report.keys_added = sorted(after - before)
        report.keys_removed = sorted(before - after)
    return ConvertResult(model=converted, report=report, source=model, exact=exact, replaced=replacements)


MAX_FILTERS = 64


def check_filters(include, exclude) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Module-path globs as given on the command line or read from a checkpoint (validated: bounded strings)."""
    from bnsurgeon.core.errors import UsageError

    result = []
    for name, globs in (("include", include), ("exclude", exclude)):
        if globs is not None and not isinstance(globs, (list, tuple)):  # a str would be split into one-letter globs
            raise UsageError(
                f"--{name} takes a list of module-path globs, not a {type(globs).__name__}",
                f"pass a list: {name}=['backbone.body.layer1.*']",
            )
        globs = tuple(globs or ())
        if len(globs) > MAX_FILTERS or not all(isinstance(g, str) and 0 < len(g) <= 200 for g in globs):
            raise UsageError(
                f"--{name} takes up to {MAX_FILTERS} module-path globs of 1-200 characters",
                "write them like backbone.body.layer1.*",
            )
        result.append(globs)
    return result[0], result[1]


def _refuse_unmatched_filters(entries: list[PlanEntry], include, exclude) -> None:
    """A glob that names no BN module is a typo (``--exclude layer1`` for ``layer1.*``): refused, not
    ignored, because ignoring it converts exactly the modules the user meant to keep."""
    from fnmatch import fnmatchcase

    from bnsurgeon.core.errors import UsageError

    names = [path for entry in entries for path in entry.paths]
    for flag, globs in (("--include", include), ("--exclude", exclude)):
        for glob in globs:
            if not any(fnmatchcase(name, glob) for name in names):
                shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "none"
                raise UsageError(
                    f"{flag} {glob} matches no BatchNorm module (their paths: {shown})",
                    "a glob matches the whole path: write backbone.layer1.* for the modules inside "
                    "backbone.layer1 (bnsurgeon inspect lists the paths)",
                )
    if (include or exclude) and entries and all(filtered_out(e.paths, include, exclude) for e in entries):
        raise UsageError(
            f"the --include/--exclude globs keep all {counted(len(entries), 'BatchNorm module')}: nothing "
            "would be converted",
            "narrow the --exclude globs or widen the --include ones "
            "(bnsurgeon inspect with the same flags shows what they select)",
        )


def filtered_out(paths: list[str], include, exclude) -> str | None:
    """Why the --include/--exclude globs keep a module (any of its names counts), or None to convert it."""
    from fnmatch import fnmatchcase

    for glob in exclude:
        if any(fnmatchcase(path, glob) for path in paths):
            return f"excluded by --exclude {glob}"
    if include and not any(fnmatchcase(path, glob) for glob in include for path in paths):
        return "not matched by --include " + " ".join(include)
    return None


def _refuse_ddp_copy(model: "nn.Module", inplace: bool) -> None:
    """A copy of a DistributedDataParallel goes through its pickling: that fails for a
    subgroup and, for the default group, silently builds a second gradient reducer."""
    from torch.nn.parallel import DistributedDataParallel

    if inplace:
        return
    wrapped = [
        path or "<root>" for path, module in model.named_modules() if isinstance(module, DistributedDataParallel)
    ]
    if wrapped:
        from bnsurgeon.core.errors import UsageError

        raise UsageError(
            f"cannot convert a copy of a DistributedDataParallel-wrapped model ({', '.join(wrapped)})",
            "convert the inner model and wrap it again (bnsurgeon.convert(ddp.module, ...)), "
            "or convert it in place with inplace=True",
        )


def compiled_modules(model: "nn.Module") -> list[str]:
    """Paths of the ``torch.compile`` wrappers (OptimizedModule) in ``model``, itself included."""
    import sys

    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled in this process
        return []
    from torch._dynamo.eval_frame import OptimizedModule

    return [path or "<root>" for path, module in model.named_modules() if isinstance(module, OptimizedModule)]


def _refuse_compiled_copy(model: "nn.Module", inplace: bool) -> None:
    """A torch.compile wrapper's forward is bound to the module it compiled: a copy of the wrapper
    (with the converted modules under its ``_orig_mod``) would still run the source's modules."""
    if inplace:
        return
    compiled = compiled_modules(model)
    if compiled:
        from bnsurgeon.core.errors import UsageError

        raise UsageError(
            f"cannot convert a copy of a torch.compile'd model or submodule ({', '.join(compiled)[:200]}): its "
            "compiled forward is bound to the original module and would keep running the source",
            "convert the module it compiled (compiled._orig_mod; a factory should return the model uncompiled) "
            "and compile the result again, or, from Python, convert it in place with inplace=True",
        )


def _build(entry: PlanEntry, context: BuildContext) -> "nn.Module":
    """The rule's replacement; a user rule that raises is named with its error (a built-in one is a bug)."""
    rule = entry.rule
    assert rule is not None, f"{entry.path}: planned without a rule"
    try:
        return rule.build(entry.module, context)
    except BnSurgeonError:
        raise
    except Exception as error:
        if rule in builtin_rules():  # bnsurgeon's own rule: a bug, not the user's
            raise
        raise RuleRaisedError(
            f"rule {shown(rule.name, 60)} raised {type(error).__name__} building --to {context.target} for "
            f"{shown(entry.path, 120)} ({entry.cls_name}): {first_line(error)}",
            "fix the rule's builder for that target, or leave the module out with --exclude",
        ) from error


def _carry_over(old: "nn.Module", new: "nn.Module", path: str) -> None:
    """Move what is not a tensor: hooks, the training flag, a qconfig, the layer's name."""
    carry_hooks(old, new)
    new.training = old.training
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    if isinstance(getattr(type(new), "layer_name", None), property):
        setattr(new, "layer_name", path)  # noqa: B010  (a property of the sync layers)


def _rebuild(module: "nn.Module", replacements: dict[int, "nn.Module"], inplace: bool, memo: dict[int, "nn.Module"]):
    """Return ``module`` with replacements applied below it; shared modules stay shared."""
    key = id(module)
    if key in memo:
        return memo[key]
    if key in replacements:
        new = replacements[key]
        memo[key] = new
        for name, child in list(new._modules.items()):
            if child is not None:
                new._modules[name] = _rebuild(child, replacements, inplace, memo)
        return new
    memo[key] = module  # provisional, for cycles
    rebuilt = {
        name: _rebuild(child, replacements, inplace, memo)
        for name, child in module._modules.items()
        if child is not None
    }
    if all(rebuilt[name] is module._modules[name] for name in rebuilt):
        return module
    target = module if inplace else shallow_clone(module)
    target._modules.update(rebuilt)
    memo[key] = target
    return target


def relink_plain_references(
    converted: "nn.Module", memo: dict[int, "nn.Module"], originals: dict[int, "nn.Module"], inplace: bool
) -> None:
    """Point modules held in plain lists, tuples and dicts at their rebuilt selves.

    A model may keep its children twice: registered (``add_module``) and in a plain list its forward
    iterates (transformers' UperNet pyramid pooling: ``self.layers = [pool, conv]``). The rebuild only
    sees ``_modules``; left alone, a converted copy's forward would run the source's own BN, untouched
    by the conversion and sharing its running statistics, and no check of the copy could tell.
    """
    from torch import nn

    moved = {key: new for key, new in memo.items() if new is not originals.get(key)}
    if not moved:
        return
    internals = set(vars(nn.Module()))
    for path, module in converted.named_modules():
        for name, value in list(vars(module).items()):
            if name in internals:
                continue
            relinked = _relinked(value, moved)
            if relinked is value:
                continue
            if not inplace and id(module) in originals and originals[id(module)] is module:
                raise UsageError(
                    f"{path or 'the model'} ({type(module).__name__}) holds converted modules in its plain attribute "
                    f"{shown(name, 60)} but is itself shared with the source, so its copy cannot be pointed at them",
                    "convert in place (bnsurgeon.convert(model, inplace=True))",
                )
            module.__dict__[name] = relinked


def _relinked(value: Any, moved: dict[int, "nn.Module"], depth: int = 0) -> Any:
    """``value`` with every module in ``moved`` replaced, in new containers (the source's stay as they are)."""
    from torch import nn

    if isinstance(value, nn.Module):
        return moved.get(id(value), value)
    if depth >= 3 or type(value) not in (list, tuple, dict):
        return value
    if type(value) is dict:
        mapped = {key: _relinked(item, moved, depth + 1) for key, item in value.items()}
        return mapped if any(mapped[key] is not value[key] for key in value) else value
    items = [_relinked(item, moved, depth + 1) for item in value]
    return type(value)(items) if any(new is not old for new, old in zip(items, value, strict=True)) else value


def name_sync_layers(model: "nn.Module") -> int:
    """Name every bnsurgeon sync layer by its module path: the identity its rows carry (runtime/identity.py)."""
    count = 0
    for path, module in model.named_modules():
        if isinstance(getattr(type(module), "layer_name", None), property):
            module.layer_name = path or "<root>"
            count += 1
    return count


def class_map(model: "nn.Module") -> dict[str, str]:
    """path -> class of every BN-family module (recorded so load can prove it rebuilt the same)."""
    return {path: qualname(type(entry.module)) for entry in plan(model) for path in entry.paths}
