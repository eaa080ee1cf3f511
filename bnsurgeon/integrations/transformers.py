"""Hugging Face ``Trainer``: ``Trainer(model, args, ..., callbacks=[BNSurgeonCallback()])``.

Neither the Trainer nor accelerate synchronizes BatchNorm; their maintainers tell users to
call torch's ``convert_sync_batchnorm`` by hand, which drops timm's BatchNormAct2d
activation and refuses CPU tensors. The callback converts the Trainer's model in place with
bnsurgeon's rules when the Trainer is built (``on_init_end``, before ``train()`` wraps it in
DDP), and again when training begins for a model it has not seen (added with ``add_callback``,
or built by ``model_init``), so the sync layers run on the Trainer's process group (the default one, set up by
torchrun or accelerate; gloo on CPU, NCCL on GPUs). With gradient checkpointing the Trainer
turns off DDP's buffer broadcast; the statistics stay identical on every rank anyway, because
each sync layer computes them from the global batch (and a recomputed forward reuses them).
``sync_batchnorm(model)`` does the same for a script that builds its own loop.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.nn import Module
from transformers import TrainerCallback

from bnsurgeon.surgery.walk import convert


def sync_batchnorm(
    model: Module, *, frozen: str = "keep", allow_unhandled: bool = False, process_group: Any = None
) -> Module:
    """Convert ``model`` in place to bnsurgeon's sync layers (the same object is returned)."""
    return convert(
        model, "sync", frozen=frozen, allow_unhandled=allow_unhandled, process_group=process_group, inplace=True
    ).model


class BNSurgeonCallback(TrainerCallback):
    """Synchronize the Trainer's BN-family layers (``frozen="unfreeze"`` also trains frozen BN)."""

    def __init__(self, frozen: str = "keep", allow_unhandled: bool = False, process_group: Any = None) -> None:
        self.frozen = frozen
        self.allow_unhandled = allow_unhandled
        self.process_group = process_group
        self.converted = 0

    def on_init_end(self, args, state, control, model: Module | None = None, **kwargs):  # noqa: ANN001 - HF's signature
        if model is not None:
            self._sync(model)
        return control

    def on_train_begin(self, args, state, control, model: Module | None = None, **kwargs):  # noqa: ANN001
        """The model that trains: a callback added with ``trainer.add_callback`` after the Trainer was built never
        saw ``on_init_end``, and ``Trainer(model_init=...)`` builds a new model in ``train()``. Parameters and
        buffers keep their identity through the surgery, so the optimizer and DDP already built still hold them."""
        if model is None:
            warnings.warn(
                "BNSurgeonCallback: the Trainer passed no model to on_train_begin, so its BatchNorm layers "
                "are not synchronized; call bnsurgeon.integrations.transformers.sync_batchnorm(model) "
                "before train()",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            self._sync(model)
        return control

    def _sync(self, model: Module) -> None:
        """Convert what is not synchronized yet (layers converted before are kept as they are)."""
        result = convert(
            model,
            "sync",
            frozen=self.frozen,
            allow_unhandled=self.allow_unhandled,
            process_group=self.process_group,
            inplace=True,
        )
        self.converted += len(result.report.changed)
