"""Shallow module copies for copy-on-write surgery, and the hooks a copy or replacement carries.

``copy.copy`` of an ``nn.Module`` shares every dict in its ``__dict__``: a child set, a buffer
registered, or a hook added on the copy would change the source too. A copy here owns its
containers (modules, parameters, buffers) and shares the tensors in them. Hook dicts follow
one rule (``carry_hooks``): a module that has hooks hands the same dict objects on, so the
user's RemovableHandles still remove them; a module with none gives the copy its own empty
dicts, so a hook added later to the copy never runs on the source. Modules the conversion
did not change (convs, acts, a folded norm-act's own act and drop) are the same objects in
both models, so their hooks are shared like their weights.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

#: every hook attribute torch's nn.Module has (hook dicts and the full/legacy backward-hook
#: flag ``_is_full_backward_hook``); ``hook_attributes`` adds any a newer torch defines
HOOK_ATTRIBUTES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)

#: the dicts that hold hook callables (the others are flags and per-hook options)
FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
BACKWARD_HOOKS = ("_backward_hooks", "_backward_pre_hooks")
STATE_DICT_HOOKS = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)

_CONTAINERS = ("_parameters", "_buffers", "_modules")


@functools.lru_cache(maxsize=None)
def hook_attributes() -> tuple[str, ...]:
    """HOOK_ATTRIBUTES plus any hook attribute the installed torch's nn.Module adds."""
    from torch import nn

    extra = tuple(name for name in nn.Module().__dict__ if "hook" in name and name not in HOOK_ATTRIBUTES)
    return HOOK_ATTRIBUTES + extra


def hook_kinds(module: "nn.Module", kinds: tuple[str, ...]) -> list[str]:
    """The names of ``kinds`` (hook dict attributes) that hold at least one hook on ``module``."""
    return [kind for kind in kinds if module.__dict__.get(kind)]


def has_hooks(module: "nn.Module") -> bool:
    """Whether the user (or a library) registered any hook of any kind on ``module``."""
    return any(
        isinstance(value, dict) and value
        for name in hook_attributes()
        if (value := module.__dict__.get(name)) is not None
    )


def carry_hooks(old: "nn.Module", new: "nn.Module") -> None:
    """Give ``new`` the hooks of ``old``: the same dicts where ``old`` has any, else fresh empty ones."""
    share = has_hooks(old)
    for name in hook_attributes():  # replaces any hook ``new`` registered itself (no built-in rule's class does)
        if name not in old.__dict__:
            continue
        value = old.__dict__[name]
        new.__dict__[name] = value if share or not isinstance(value, dict) else type(value)()


def shallow_clone(module: "nn.Module") -> "nn.Module":
    """A copy of ``module`` that owns its containers and shares its tensors, children and hooks (as above)."""
    clone = copy.copy(module)
    for name in _CONTAINERS:
        clone.__dict__[name] = type(module.__dict__[name])(module.__dict__[name])
    if "_non_persistent_buffers_set" in module.__dict__:
        clone.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    carry_hooks(module, clone)
    return clone
