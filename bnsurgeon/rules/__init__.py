"""The rule registry: built-in families plus users' rules (Python or entry points).

Users add a rule for their own BN subclass with ``bnsurgeon.rules.register(Rule(...))``
or by exposing, in the ``bnsurgeon.rules`` entry-point group, a Rule, a list of Rules,
or a zero-argument callable returning either.
"""

from __future__ import annotations

from .base import ENTRY_POINT_GROUP, FROZEN_POLICIES, TARGETS, BuildContext, Registry, Rule, check_target
from .builders import keep_if, to_frozen, to_frozen_act, to_fused, to_fused_act, to_plain, to_plain_act, to_sync, to_sync_act

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
    from . import frozen, norm_act, torch_bn

    return [*torch_bn.rules(), *norm_act.rules(), *frozen.rules()]


def _entry_point_rules() -> list[Rule]:
    from importlib.metadata import entry_points

    from ..errors import UsageError

    found: list[Rule] = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        value = entry.load()
        if callable(value) and not isinstance(value, Rule):
            value = value()
        items = [value] if isinstance(value, Rule) else list(value)
        for item in items:
            if not isinstance(item, Rule):
                raise UsageError(
                    f"entry point {entry.name!r} in group {ENTRY_POINT_GROUP!r} gave {type(item).__name__}, not a Rule",
                    "make it a bnsurgeon.rules.Rule, a list of them, or a callable returning those",
                )
            found.append(item)
    return found


def default_registry() -> Registry:
    """The process-wide registry: built-ins, then entry-point rules (which may replace them)."""
    global _default
    if _default is None:
        registry = Registry(builtin_rules())
        for rule in _entry_point_rules():
            registry.register(rule, replace=True)
        _default = registry
    return _default


def register(rule: Rule, *, replace: bool = False) -> Rule:
    """Add a rule to the process-wide registry."""
    return default_registry().register(rule, replace=replace)
