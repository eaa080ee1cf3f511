"""Rules for Hugging Face transformers' frozen batch norm classes (``DetrFrozenBatchNorm2d`` and its
siblings in ConditionalDetr, DeformableDetr, TableTransformer, RTDetr, DFine, GroundingDino, ...).

They are plain modules, not BN subclasses: four buffers (weight, bias, running_mean,
running_var), no ``eps`` attribute, and eps hard-coded in ``forward``. transformers grows a
new one with most detector releases, so they are found by what they are, not from a list:
once transformers has imported a model's module (building the model did), every class of a
``transformers.models.*`` module whose name says frozen batch norm is probed: built with 4
channels, it must hold exactly those four buffers and no parameters, and its forward must be
the frozen BN map ``(x - mean) / sqrt(var + eps) * weight + bias`` in float64 for random
values, which also measures its ``eps``. A class that fails the probe is not claimed and stays
unhandled (convert refuses it, naming it). bnsurgeon never imports transformers itself.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable

from bnsurgeon.core.anatomy import attach_affine, attach_stats, qualname, read_fields
from bnsurgeon.core.module_copy import shallow_clone
from bnsurgeon.rules.base import BuildContext, Rule
from bnsurgeon.rules.builders import keep_if, register_frozen_origin, thaw_or_keep, to_fused, to_plain, to_sync

if TYPE_CHECKING:
    from torch import nn

#: the prefix of the modules searched (transformers' model implementations)
MODELS_PREFIX = "transformers.models."
#: relative agreement of the probe with the frozen BN formula, in float64
PROBE_TOLERANCE = 1e-10

#: class -> measured eps (None: probed, not a frozen BN)
_probed: dict[type, float | None] = {}


def candidate_classes(searched: set[str]) -> list[type]:
    """Classes named like a frozen batch norm in the transformers model modules not in ``searched`` (updated): the
    registry's own record, so that a registry made anew (or put back) finds them again."""
    found = []
    for name, module in list(sys.modules.items()):
        key = f"searched:{name}"
        if not name.startswith(MODELS_PREFIX) or module is None or key in searched:
            continue
        searched.add(key)
        for attribute, value in list(vars(module).items()):
            if isinstance(value, type) and "FrozenBatchNorm" in attribute and value.__module__ == name:
                found.append(value)
    return found


def measured_eps(cls: type) -> float | None:
    """The class's eps if it is a frozen batch norm (see the module doc), else None. Probed once per class."""
    if cls not in _probed:
        _probed[cls] = _probe(cls)
    return _probed[cls]


def _probe(cls: type) -> float | None:
    import torch
    from torch import nn

    if not issubclass(cls, nn.Module):
        return None
    try:
        module = cls(4).to(torch.float64)
    except Exception:  # not constructible from a channel count: not one of these
        return None
    if list(module.parameters()) or set(module._buffers) != {"weight", "bias", "running_mean", "running_var"}:
        return None
    try:
        with torch.no_grad():
            buffers = {name: tensor for name, tensor in module._buffers.items() if tensor is not None}
            for buffer, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 0.0)):
                buffers[buffer].fill_(fill)
            scale = module(torch.ones(1, 4, 1, 1, dtype=torch.float64))  # = eps ** -0.5 everywhere
            eps = float(1.0 / scale[0, 0, 0, 0] ** 2)
            if not (0 < eps < 1):
                return None
            generator = torch.Generator().manual_seed(0)
            values = {
                buffer: torch.rand(4, generator=generator, dtype=torch.float64) + 0.5
                for buffer in ("weight", "bias", "running_mean", "running_var")
            }
            for buffer, value in values.items():
                buffers[buffer].copy_(value)
            x = torch.randn(2, 4, 3, 3, generator=generator, dtype=torch.float64)
            shape = (1, 4, 1, 1)
            expected = (x - values["running_mean"].view(shape)) / (
                values["running_var"].view(shape) + eps
            ).sqrt() * values["weight"].view(shape) + values["bias"].view(shape)
            got = module(x)
    except Exception:
        return None
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=PROBE_TOLERANCE, atol=0):
        return None
    return eps


def _with_eps(build: Callable, eps: float) -> Callable:
    """``build`` applied to a shallow clone of the module that has the class's measured ``eps`` (the source
    module is not changed; the clone holds the same tensors)."""

    def builder(module: "nn.Module", context: BuildContext) -> "nn.Module":
        clone = shallow_clone(module)
        setattr(clone, "eps", eps)  # noqa: B010  (a plain attribute; Module.__setattr__ is typed for tensors)
        return build(clone, context)

    return builder


def _refrozen(cls: type) -> Callable:
    """``--to frozen`` of a module thawed from ``cls``: that class again, holding what it learned."""

    def make(module: "nn.Module") -> "nn.Module":
        import torch

        fields = read_fields(module)
        with torch.device("meta"):
            new = cls(fields.num_features)
        attach_affine(new, fields, as_parameters=False)
        attach_stats(new, fields, with_counter=False)
        return new

    return make


def rule_for(cls: type, eps: float) -> Rule:
    return Rule(
        name=f"transformers-{cls.__name__}",
        classes=(cls,),
        targets={
            "sync": thaw_or_keep(_with_eps(to_sync, eps)),
            "plain": thaw_or_keep(_with_eps(to_plain, eps)),
            "frozen": keep_if("frozen"),
            "fused": _with_eps(to_fused, eps),
        },
        description=f"transformers {cls.__name__} (frozen BN, eps {eps:g} measured; x*scale+shift arithmetic)",
        exact=False,
    )


def imported_rules(already: set[str]) -> list[Rule]:
    """Rules for the frozen BN classes transformers has imported since ``already`` was filled (updated)."""
    if "transformers" not in sys.modules:
        return []
    found = []
    for cls in candidate_classes(already):
        name = f"transformers-{cls.__name__}"
        if name in already:
            continue
        already.add(name)
        eps = measured_eps(cls)
        if eps is None:
            continue
        register_frozen_origin(qualname(cls), _refrozen(cls))
        found.append(rule_for(cls, eps))
    return found
