"""The built-in rules described as plain data, so ``bnsurgeon rules`` needs neither torch nor timm
(it lives with the CLI: importing the ``rules`` package imports torch).

Building the real registry imports torch, torchvision and timm (about 10 s on a cold
2-core machine) only to print static names. This table is what that registry holds;
``tests/test_cli.py`` compares the two, so a rule added, renamed or changed in
``bnsurgeon/rules/`` fails the suite until the table says the same. When entry points
add rules, the real registry is built instead: their descriptions exist only there.
"""

from __future__ import annotations

from typing import Any

ALL_TARGETS = ["frozen", "fused", "plain", "sync"]

BUILTIN_RULES: list[dict[str, Any]] = [
    {
        "name": "torch-batchnorm",
        "classes": [
            "torch.nn.modules.batchnorm.BatchNorm1d",
            "torch.nn.modules.batchnorm.BatchNorm2d",
            "torch.nn.modules.batchnorm.BatchNorm3d",
            "torch.nn.modules.batchnorm.SyncBatchNorm",
        ],
        "targets": ALL_TARGETS,
        "exact": True,
        "description": "torch BatchNorm1d/2d/3d and torch.nn.SyncBatchNorm",
    },
    {
        "name": "bnsurgeon-sync",
        "classes": ["bnsurgeon.runtime.layers.SyncBatchNorm"],
        "targets": ALL_TARGETS,
        "exact": True,
        "description": "bnsurgeon SyncBatchNorm (restores its recorded original class)",
    },
    {
        "name": "timm-batchnorm-act",
        "classes": ["timm.layers.norm_act.BatchNormAct2d", "timm.layers.norm_act.SyncBatchNormAct"],
        "targets": ALL_TARGETS,
        "exact": True,
        "description": "timm BatchNormAct2d and SyncBatchNormAct (act and drop kept)",
    },
    {
        "name": "bnsurgeon-sync-act",
        "classes": ["bnsurgeon.runtime.layers.SyncBatchNormAct"],
        "targets": ALL_TARGETS,
        "exact": True,
        "description": "bnsurgeon SyncBatchNormAct (act and drop kept)",
    },
    {
        "name": "bnsurgeon-frozen",
        "classes": ["bnsurgeon.runtime.layers.FrozenBatchNorm"],
        "targets": ALL_TARGETS,
        "exact": True,
        "description": "bnsurgeon FrozenBatchNorm",
    },
    {
        "name": "bnsurgeon-frozen-act",
        "classes": ["bnsurgeon.runtime.layers.FrozenBatchNormAct"],
        "targets": ALL_TARGETS,
        "exact": True,
        "description": "bnsurgeon FrozenBatchNormAct",
    },
    {
        "name": "torchvision-frozen",
        "classes": ["torchvision.ops.misc.FrozenBatchNorm2d"],
        "targets": ALL_TARGETS,
        "exact": False,
        "description": "torchvision/timm FrozenBatchNorm2d (x*scale+shift arithmetic)",
    },
    {
        "name": "timm-frozen-act",
        "classes": ["timm.layers.norm_act.FrozenBatchNormAct2d"],
        "targets": ALL_TARGETS,
        "exact": False,
        "description": "timm FrozenBatchNormAct2d (x*scale+shift arithmetic)",
    },
]


def registry_rows(registry) -> list[dict[str, Any]]:
    """A live registry in the same shape as ``BUILTIN_RULES``."""
    from bnsurgeon.core.anatomy import qualname

    return [
        {
            "name": r.name,
            "classes": [qualname(c) for c in r.classes],
            "targets": sorted(r.targets),
            "exact": r.exact,
            "description": r.description,
        }
        for r in registry
    ]


ENTRY_POINT_GROUP = "bnsurgeon.rules"  # the same group as rules.base.ENTRY_POINT_GROUP (a test says so)


def has_entry_point_rules() -> bool:
    from importlib.metadata import entry_points

    return bool(entry_points(group=ENTRY_POINT_GROUP))


def describe_rules() -> list[dict[str, Any]]:
    """The rule registry as data: the static table, or the real registry when entry points add rules."""
    if not has_entry_point_rules():
        return [dict(rule, classes=list(rule["classes"]), targets=list(rule["targets"])) for rule in BUILTIN_RULES]
    from bnsurgeon.rules import default_registry

    return registry_rows(default_registry())
