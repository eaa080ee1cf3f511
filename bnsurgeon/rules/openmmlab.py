"""Rules for the BN classes OpenMMLab and Lightning build, claimed only when those packages
are already imported (a model made of their classes has imported them; bnsurgeon never
imports them itself, so they stay optional and cost nothing when absent).

- mmengine's ``SyncBatchNorm`` (``mmengine.utils.dl_utils.parrots_wrapper``): what every
  mmseg/mmdet ``norm_cfg=dict(type='SyncBN')`` builds; a torch SyncBatchNorm subclass that
  only changes the input check, so it converts as torch's does.
- ``_BatchNormXd`` (mmengine's and Lightning's ``revert_sync_batchnorm``): a BN that
  accepts any input rank; ``--to plain`` restores BatchNorm1d/2d/3d from the input rank
  the check input showed at that module.
"""

from __future__ import annotations

import sys

from bnsurgeon.rules.base import Rule
from bnsurgeon.rules.builders import to_frozen, to_fused, to_plain, to_sync

#: module that must already be imported -> (attribute, rule name, description)
OPTIONAL_CLASSES = {
    "mmengine.utils.dl_utils.parrots_wrapper": (
        "SyncBatchNorm",
        "mmengine-syncbn",
        "mmengine SyncBatchNorm (norm_cfg type='SyncBN')",
    ),
    "mmengine.model.utils": (
        "_BatchNormXd",
        "mmengine-batchnorm-xd",
        "mmengine _BatchNormXd (revert_sync_batchnorm); plain: dims from the check input",
    ),
    "lightning.pytorch.plugins.layer_sync": (
        "_BatchNormXd",
        "lightning-batchnorm-xd",
        "Lightning _BatchNormXd (TorchSyncBatchNorm.revert)",
    ),
    "pytorch_lightning.plugins.layer_sync": (
        "_BatchNormXd",
        "pytorch-lightning-batchnorm-xd",
        "pytorch_lightning _BatchNormXd (TorchSyncBatchNorm.revert)",
    ),
}


def imported_rules(already: set[str]) -> list[Rule]:
    """Rules for the optional packages imported since ``already`` was filled (which is updated)."""
    found = []
    for module_name, (attribute, name, description) in OPTIONAL_CLASSES.items():
        module = sys.modules.get(module_name)
        cls = getattr(module, attribute, None) if module is not None else None
        if cls is None or name in already:
            continue
        already.add(name)
        found.append(
            Rule(
                name=name,
                classes=(cls,),
                targets={"sync": to_sync, "plain": to_plain, "frozen": to_frozen, "fused": to_fused},
                description=description,
            )
        )
    return found
