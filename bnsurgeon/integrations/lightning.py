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
    from pytorch_lightning.plugins.layer_sync import TorchSyncBatchNorm

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
        return convert(
            model,
            "sync",
            frozen=self.frozen,
            allow_unhandled=self.allow_unhandled,
            process_group=self.process_group,
            inplace=True,
        ).model

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


try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback


class RecalibrateBN(Callback):
    """Give averaged weights (EMA, SWA) exact BN statistics before each validation and at the end of fit.

    ``Trainer(callbacks=[RecalibrateBN(lambda trainer: trainer.datamodule.train_dataloader(),
    model="ema", max_batches=50)])``. ``data``: an iterable of batches, or a function of the
    trainer returning one (each rank's loader: its DistributedSampler shard). ``model``: the
    attribute of the LightningModule holding the averaged weights (a timm ModelEma*, a torch
    AveragedModel or a plain module), or a function of the LightningModule returning it; None:
    the LightningModule itself. Under DDP every rank runs the pass (Lightning calls the hooks on
    all of them) and the statistics are merged over every rank in one collective. The last
    report is kept in ``self.report``.
    """

    def __init__(
        self,
        data: Any,
        model: Any = "ema",
        *,
        max_batches: int | None = None,
        max_samples: int | None = None,
        include_frozen: bool = False,
        before_validation: bool = True,
        at_fit_end: bool = True,
    ) -> None:
        self.data = data
        self.model = model
        self.options = {"max_batches": max_batches, "max_samples": max_samples, "include_frozen": include_frozen}
        self.before_validation = before_validation
        self.at_fit_end = at_fit_end
        self.report: Any = None  # the last pass's RecalibrationReport

    def _averaged(self, pl_module: Module) -> Any:
        if self.model is None:
            return pl_module
        if callable(self.model) and not isinstance(self.model, Module):
            return self.model(pl_module)
        if isinstance(self.model, str):
            return getattr(pl_module, self.model)
        return self.model

    def recalibrate(self, trainer: Any, pl_module: Module):
        """One pass now (what the hooks call)."""
        from bnsurgeon.calibration.training import recalibrate_averaged

        data = self.data(trainer) if callable(self.data) else self.data
        self.report = recalibrate_averaged(self._averaged(pl_module), data, **self.options)
        return self.report

    def on_validation_start(self, trainer: Any, pl_module: Module) -> None:
        if self.before_validation and not trainer.sanity_checking:
            self.recalibrate(trainer, pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Module) -> None:
        if self.at_fit_end:
            self.recalibrate(trainer, pl_module)
