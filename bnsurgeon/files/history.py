"""The conversions a checkpoint went through, in order, so that loading replays all of them.

A file made by ``--frozen unfreeze`` and then converted ``--to plain`` holds BN that only
exists after both steps: rebuilding with the last step alone leaves the frozen layers
frozen and the weights no longer fit. Every written checkpoint therefore records the
whole history (read back from metadata, so it is validated like any untrusted field).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bnsurgeon.core.errors import HookedModelError, UsageError
from bnsurgeon.core.layout import shown
from bnsurgeon.rules import FROZEN_POLICIES, TARGETS
from bnsurgeon.surgery.walk import check_filters

if TYPE_CHECKING:
    from torch import nn


MAX_STEPS = 64


STEP_KEYS = {"target", "frozen", "allow_unhandled", "include", "exclude"}


def step(target: str, options: dict[str, Any]) -> dict[str, Any]:
    return {
        "target": target,
        "frozen": options.get("frozen", "keep"),
        "allow_unhandled": bool(options.get("allow_unhandled", False)),
        "include": list(options.get("include") or []),
        "exclude": list(options.get("exclude") or []),
    }


def history_problem(history: Any) -> str | None:
    if not isinstance(history, list) or not 1 <= len(history) <= MAX_STEPS:
        return f"expected a list of 1-{MAX_STEPS} steps"
    for entry in history:
        if not isinstance(entry, dict) or not {"target", "frozen", "allow_unhandled"} <= set(entry) <= STEP_KEYS:
            return "each step is {target, frozen, allow_unhandled, include, exclude}"
        if (
            entry["target"] not in TARGETS
            or entry["frozen"] not in FROZEN_POLICIES
            or not isinstance(entry["allow_unhandled"], bool)
        ):
            return f"unknown step {shown(entry, 200)}"
        try:
            check_filters(entry.get("include", []), entry.get("exclude", []))
        except UsageError as error:
            return error.message
    return None


def replay(
    model: "nn.Module",
    history: list[dict[str, Any]],
    recorded_classes: dict | None = None,
    folds: list | None = None,
    origin: str = "the checkpoint",
) -> "nn.Module":
    """Apply every recorded conversion in order, in place.

    A last ``plain`` step takes each BatchNorm1d/2d/3d the file records (what the check
    input showed for a dimension-less _BatchNormXd or SyncBN when it was written).
    """
    from bnsurgeon.rules.builders import DIMS_OF_PLAIN

    final_dims = {
        path: DIMS_OF_PLAIN[cls]
        for path, cls in (recorded_classes or {}).items()
        if isinstance(path, str) and cls in DIMS_OF_PLAIN
    }
    for index, entry in enumerate(history):
        last_plain = index == len(history) - 1 and entry["target"] == "plain"
        try:
            model = _replay_step(model, entry, final_dims if last_plain else None, folds)
        except HookedModelError:  # the caller's model, not the file
            raise
        except UsageError as error:  # a recorded filter that names no module of this model
            from bnsurgeon.core.errors import MetadataError

            raise MetadataError(
                f"{origin}: metadata bnsurgeon.history step {index + 1} does not fit the model ({error.message})"
            ) from None
    return model


def _replay_step(model: "nn.Module", entry: dict[str, Any], input_dims, folds) -> "nn.Module":
    from bnsurgeon.surgery.walk import convert

    return convert(
        model,
        entry["target"],
        frozen=entry["frozen"],
        allow_unhandled=entry["allow_unhandled"],
        include=entry.get("include", ()),
        exclude=entry.get("exclude", ()),
        inplace=True,
        input_dims=input_dims,
        folds=folds if entry["target"] == "fused" else None,
    ).model
