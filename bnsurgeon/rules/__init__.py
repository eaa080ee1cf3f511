"""The rule registry: built-in families plus users' rules (Python or entry points).

Users add a rule for their own BN subclass with ``bnsurgeon.rules.register(Rule(...))``
or by exposing, in the ``bnsurgeon.rules`` entry-point group, a Rule, a list of Rules,
or a zero-argument callable returning either.
"""

from __future__ import annotations

import sys
from typing import Callable

from bnsurgeon.rules.base import ENTRY_POINT_GROUP, FROZEN_POLICIES, TARGETS, BuildContext, Registry, Rule, check_target
from bnsurgeon.rules.builders import (
    keep_if,
    to_frozen,
    to_frozen_act,
    to_fused,
    to_fused_act,
    to_plain,
    to_plain_act,
    to_sync,
    to_sync_act,
)

__all__ = [
    "FROZEN_POLICIES",
    "TARGETS",
    "BuildContext",
    "Registry",
    "Rule",
    "check_target",
    "default_registry",
    "keep_if",
    "register",
    "to_frozen",
    "to_frozen_act",
    "to_fused",
    "to_fused_act",
    "to_plain",
    "to_plain_act",
    "to_sync",
    "to_sync_act",
]

_default: Registry | None = None


def builtin_rules() -> list[Rule]:
    """Every built-in rule (imports timm and torchvision for theirs)."""
    from bnsurgeon.rules import frozen, norm_act, torch_bn

    return [
        *torch_bn.rules(),
        *norm_act.timm_rules(),
        *norm_act.rules(),
        *frozen.rules(),
        *frozen.torchvision_rules(),
        *frozen.timm_rules(),
    ]


#: the names of builtin_rules() and of the families that join when their package is imported, known without
#: importing timm or torchvision (--rules checks them in every child of a run; a test keeps the list true)
BUILTIN_RULE_NAMES = frozenset(
    {
        "torch-batchnorm",
        "bnsurgeon-sync",
        "timm-batchnorm-act",
        "bnsurgeon-sync-act",
        "bnsurgeon-frozen",
        "bnsurgeon-frozen-act",
        "torchvision-frozen",
        "timm-frozen-act",
        "detectron2-frozen",
    }
)


def _core_rules() -> list[Rule]:
    """The built-in rules for torch's and bnsurgeon's classes: what needs no other package."""
    from bnsurgeon.rules import frozen, norm_act, torch_bn

    return [*torch_bn.rules(), *norm_act.rules(), *frozen.rules()]


def _package_rules() -> list[tuple[str, str, "Callable[[], list[Rule]]"]]:
    """(module that defines the classes, a name for the family, its rules) of the built-in rules for timm's and
    torchvision's classes: they join the default registry once that module is imported, so a process that never
    imports timm (a script under bnsurgeon run) does not pay for it, and no instance of them can exist before."""
    from bnsurgeon.rules import frozen, norm_act

    return [
        (norm_act.TIMM_MODULE, "timm-act", norm_act.timm_rules),
        (frozen.TORCHVISION_MODULE, "torchvision-frozen", frozen.torchvision_rules),
        (frozen.TIMM_MODULE, "timm-frozen", frozen.timm_rules),
        (frozen.DETECTRON2_MODULE, "detectron2-frozen", frozen.detectron2_rules),
    ]


def _as_rules(value, origin: str) -> list[Rule]:
    from bnsurgeon.core.errors import UsageError

    if callable(value) and not isinstance(value, Rule):
        try:
            value = value()
        except Exception as error:  # the user's code: its failure is a usage error, not a crash
            raise UsageError(
                f"{origin} raised {type(error).__name__}: {str(error).strip()[:200]}",
                "make it a Rule, a list of Rules, or a callable that takes no arguments and returns them",
            ) from None
    items = [value] if isinstance(value, Rule) else list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, Rule):
            raise UsageError(
                f"{origin} gave {type(item).__name__}, not a Rule",
                "make it a bnsurgeon.rules.Rule, a list of them, or a callable returning those",
            )
    return items


def _entry_point_rules() -> list[Rule]:
    from importlib.metadata import entry_points

    found: list[Rule] = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found += _as_rules(entry.load(), f"entry point {entry.name!r} in group {ENTRY_POINT_GROUP!r}")
    return found


#: ``pkg.mod:obj`` rule specs the user named in this process (--rules or use_rules) -> their rule names
_named_specs: dict[str, list[str]] = {}


def use_rules(specs, directory: str | None = None) -> list[str]:
    """Import and register the rules each ``pkg.mod:obj`` names (a Rule, a list, or a callable
    returning either). Naming it is what allows its code to run; checkpoints record the
    specs, and loading one asks for the same names again (see ``confirm_rules``). ``directory``:
    import them from there rather than the working directory (a run's child, wherever it is)."""
    from bnsurgeon.core.errors import SourceNotFoundError, UsageError
    from bnsurgeon.core.user_code import FACTORY_PATTERN, import_named_module

    for spec in specs or ():
        if spec in _named_specs:
            continue
        if not isinstance(spec, str) or not FACTORY_PATTERN.match(spec):  # relative or malformed: nothing imported
            raise UsageError(f"--rules {spec!r} is not package.module:object", "write it like my_pkg.bn_rules:RULES")
        module_name = spec.partition(":")[0]
        try:
            module, attribute = import_named_module(spec, directory)
        except ImportError as error:
            missing = getattr(error, "name", None)
            it_failed = not isinstance(error, ModuleNotFoundError) or not (
                missing is not None and (module_name == missing or module_name.startswith(missing + "."))
            )
            if not it_failed:  # json/bn_rules.py: the standard library's json was found, without bn_rules
                _refuse_shadowed(spec, module_name, directory)
            raise SourceNotFoundError(
                f"--rules {spec}: cannot import {module_name!r} ({error})",
                f"fix the error in {module_name} (it was found, and failed as it was imported)"
                if it_failed
                else "run from the directory that holds it, or install it",
            ) from None
        if not hasattr(module, attribute):
            _refuse_shadowed(spec, module_name, directory)
            raise SourceNotFoundError(f"--rules {spec}: {module_name} has no {attribute!r}", "check the object's name")
        found = _as_rules(getattr(module, attribute), f"--rules {spec}")
        _refuse_builtin_overrides(found, spec)
        for rule in found:
            register(rule, replace=True)
        _named_specs[spec] = [rule.name for rule in found]
    return list(_named_specs)


def _refuse_shadowed(spec: str, module_name: str, directory: str | None) -> None:
    """A rules file named like a module imported before it (``timeit.py``, ``csv.py``: the standard library's, which
    torch or bnsurgeon had already imported) is never read: the import returns the other module. Said as such,
    not as "no RULES in it"."""
    import os
    import sys

    from bnsurgeon.core.errors import ShadowedModuleError

    top = module_name.partition(".")[0]
    home = directory if directory is not None else os.getcwd()
    # as python looks in a directory: a package first, then a module, then a directory (a namespace package)
    package, single = os.path.join(home, top, "__init__.py"), os.path.join(home, f"{top}.py")
    found = [path for path in (package, single) if os.path.isfile(path)]
    yours = found[0] if found else (os.path.join(home, top) if os.path.isdir(os.path.join(home, top)) else None)
    module = sys.modules.get(top)
    imported = getattr(module, "__file__", None)
    searched = [os.path.realpath(entry) for entry in getattr(module, "__path__", None) or []]
    if os.path.realpath(os.path.join(home, top)) in searched:  # it is yours (a package, or a namespace package)
        return
    if (
        yours is None
        or module is None
        or (isinstance(imported, str) and os.path.realpath(imported) == os.path.realpath(yours))
    ):
        return
    where = imported or "a module without a file (built in, or a namespace package)"
    raise ShadowedModuleError(
        f"--rules {spec}: {top!r} is {where}, imported before your {yours} (a module of that name was already "
        "loaded), so your rules were never read",
        f"rename {yours} to a name of its own ({'my_bn_rules' if os.path.isdir(yours) else 'my_bn_rules.py'}, say) "
        "and name that in --rules",
    )


def _refuse_builtin_overrides(found: list[Rule], spec: str) -> None:
    """A --rules rule may not take a built-in rule's name or classes: that would silently change how
    every torch/timm BN converts (a subclass is its own class: claim it, not its base)."""
    from bnsurgeon.core.anatomy import qualname
    from bnsurgeon.core.errors import UsageError
    from bnsurgeon.rules.openmmlab import OPTIONAL_CLASSES

    builtin = BUILTIN_RULE_NAMES | {name for _, name, _ in OPTIONAL_CLASSES.values()}
    registry = default_registry()
    hint = (
        "claim only your own classes (rules match the exact class), under a name of your own; to replace a "
        "built-in rule on purpose, register it in Python: bnsurgeon.rules.register(rule, replace=True)"
    )
    for rule in found:
        if rule.name in builtin:
            raise UsageError(f"--rules {spec}: rule name {rule.name!r} is a built-in rule's", hint)
        for cls in rule.classes:
            taken = registry.lookup(cls)
            if taken is not None and taken.name in builtin:
                raise UsageError(
                    f"--rules {spec}: rule {rule.name!r} claims {qualname(cls)}, which the built-in rule "
                    f"{taken.name!r} converts",
                    hint,
                )


def specs_for(rule_names) -> list[str]:
    """The named specs whose rules a conversion used (recorded in the checkpoint)."""
    used = set(rule_names)
    return [spec for spec, names in _named_specs.items() if used.intersection(names)]


#: a --rules confirmation hint longer than this (with its Python form) is not printed as a command: cut, it
#: would be half a command
CONFIRMATION_HINT_CHARS = 800


def confirm_rules(recorded, origin: str) -> None:
    """A checkpoint made with ``--rules X`` is rebuilt only after the user names X again."""
    from bnsurgeon.core.errors import CheckpointError, ConfirmationError

    if not isinstance(recorded, list) or not all(isinstance(s, str) and 0 < len(s) <= 200 for s in recorded):
        raise CheckpointError(f"{origin}: recorded rules are invalid", "re-convert from the original model")
    missing = [spec for spec in recorded if spec not in _named_specs]
    if missing:
        command = " ".join(f"--rules {spec}" for spec in missing)
        python = f"bnsurgeon.rules.use_rules({missing!r})"
        if len(command) + len(python) > CONFIRMATION_HINT_CHARS:  # a hint is a whole command or none
            hint = (
                f"if you trust that code, name each of the {len(missing)} recorded rule modules with --rules "
                "(the file's bnsurgeon.rules metadata lists them)"
            )
            python = (
                f"if you trust that code, pass each of the {len(missing)} recorded rule modules to "
                "bnsurgeon.rules.use_rules([...]) (the file's bnsurgeon.rules metadata lists them)"
            )
        else:
            hint, python = f"if you trust that code, confirm with {command}", f"if you trust that code, call {python}"
        raise ConfirmationError(
            f"{origin} was converted with rules from {', '.join(missing)}; importing them runs code",
            hint,
            python=python,
        )


def default_registry() -> Registry:
    """The process-wide registry: built-ins, then entry-point rules (which may replace them).

    Rules for timm's, torchvision's, OpenMMLab's and Lightning's classes join as soon as
    those packages are imported (checked on every call: a dict lookup per package).
    """
    global _default
    if _default is None:
        registry = Registry(_core_rules())
        for rule in _entry_point_rules():
            registry.register(rule, replace=True)
        _default = registry
    from bnsurgeon.rules import openmmlab, transformers_bn

    joined = _default.joined  # the registry's own record: a registry put back (a test's) still knows what it lacks
    joining = []
    for module_name, family, rules in _package_rules():
        if module_name in sys.modules and family not in joined:
            joining += rules()
            joined.add(family)  # after its rules are made: one that raised is tried again on the next look-up
    joining += [*openmmlab.imported_rules(joined), *transformers_bn.imported_rules(joined)]
    for rule in joining:
        if all(_default.lookup(cls) is None for cls in rule.classes):
            _default.register(rule)
    return _default


def register(rule: Rule, *, replace: bool = False) -> Rule:
    """Add a rule to the process-wide registry."""
    return default_registry().register(rule, replace=replace)
