"""PyTorch Lightning plugin: ``Trainer(strategy="ddp", sync_batchnorm=True, plugins=[BNSurgeonLayerSync()])``.

Lightning's default plugin uses torch's converter (timm's BatchNormAct2d loses its
activation) and reverts to a dimension-less ``_BatchNormXd``. This one converts with
bnsurgeon's rules (activations kept, CPU/gloo works) and reverts to the exact original
classes after fit. It subclasses Lightning's TorchSyncBatchNorm only so that Lightning
accepts it together with ``sync_batchnorm=True``.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
except ImportError:  # the older package name
    from pytorch_lightning.plugins.layer_sync import TorchSyncBatchNorm  # type: ignore[no-redef]

from torch.nn import Module

from bnsurgeon.rules.builders import is_frozen_origin, refreeze
from bnsurgeon.surgery.walk import convert


class BNSurgeonLayerSync(TorchSyncBatchNorm):
    """Synchronize BN-family layers with bnsurgeon's rules; revert to the original classes."""

    def __init__(self, process_group: Any = None, frozen: str = "keep", allow_unhandled: bool = False) -> None:
        self.process_group = process_group
        self.frozen = frozen
        self.allow_unhandled = allow_unhandled

    def apply(self, model: Module) -> Module:
        """Convert in place (the LightningModule stays the same object)."""
        return convert(model, "sync", frozen=self.frozen, allow_unhandled=self.allow_unhandled,
                       process_group=self.process_group, inplace=True).model

    def revert(self, model: Module) -> Module:
        """Back to the classes as they were before ``apply``.

        BatchNorm1d/2d/3d and BatchNormAct2d come back through the plain conversion; a
        layer that ``frozen="unfreeze"`` thawed goes back to its frozen class
        (torchvision/timm FrozenBatchNorm2d, FrozenBatchNormAct2d), keeping what it learned.
        """
        thawed = {
            path: module.bnsurgeon_origin
            for path, module in model.named_modules()
            if is_frozen_origin(getattr(module, "bnsurgeon_origin", None) or "")
        }
        model = convert(model, "plain", frozen=self.frozen, allow_unhandled=self.allow_unhandled, inplace=True).model
        for path, origin in thawed.items():
            restored = refreeze(model.get_submodule(path), origin)
            if restored is not None and path:  # a root module cannot be swapped in place
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent), name, restored)
        return model
