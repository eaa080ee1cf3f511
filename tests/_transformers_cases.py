"""Rank functions for the Hugging Face Trainer integration test (importable by spawned ranks)."""

from __future__ import annotations

import os

import torch
from torch import nn

N, STEPS, PER_DEVICE = 8, 3, 2


class Net(nn.Module):
    """What the Trainer expects of a model: forward(pixel_values, labels) -> {"loss", "logits"}."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # no conv bias: BN cancels it, so its gradient is rounding noise that Adam would scale up to lr-sized steps
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 2),
        )
        self.seen: list = []

    def forward(self, pixel_values, labels=None):
        if self.training:  # what this process trained on, step by step, for the one-process reference
            self.seen.append((pixel_values.detach().clone(), labels.detach().clone()))
        logits = self.body(pixel_values)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def dataset():
    generator = torch.Generator().manual_seed(7)
    # samples with different scales: per-rank batch statistics differ, so plain BN ranks drift apart
    return [
        {"pixel_values": torch.randn(3, 8, 8, generator=generator) * (1 + i), "labels": torch.tensor(i % 2)}
        for i in range(N)
    ]


def trainer_rank(rank, world_size, use_callback, output_dir):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
    from transformers import Trainer, TrainingArguments

    from bnsurgeon.integrations.transformers import BNSurgeonCallback

    model = Net()
    args = TrainingArguments(
        output_dir=os.path.join(output_dir, f"rank{rank}"),
        per_device_train_batch_size=PER_DEVICE,
        max_steps=STEPS,
        learning_rate=0.05,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callbacks = [BNSurgeonCallback()] if use_callback else []
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    kinds = sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__})
    trainer.train()
    return {"kinds": kinds, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "seen": model.seen}


def one_process_reference(steps: list, output_dir: str) -> dict:
    """The same Trainer run in one process with plain BN, each step on the ranks' batches of that step
    joined (rank 0's, then rank 1's), in that order."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):  # the batches as the ranks saw them, not reshuffled
            return SequentialSampler(self.train_dataset)

    data = [{"pixel_values": x, "labels": y} for images, labels in steps for x, y in zip(images, labels)]
    model = Net()
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=len(data) // STEPS,
        max_steps=STEPS,
        learning_rate=0.05,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    InOrder(model=model, args=args, train_dataset=data).train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_detr_rank(rank, world_size, directory, trained):
    """Two DDP steps of a DETR that bnsurgeon wrote as a model directory (-o DIR), then rank 0 saves it as
    a transformers user would (save_pretrained). Returns each rank's BN state."""
    from torch.nn.parallel import DistributedDataParallel

    import bnsurgeon

    torch.manual_seed(0)
    model = bnsurgeon.load(directory).train()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own images
    for _ in range(2):
        out = ddp(pixel_values=torch.randn(2, 3, 64, 64, generator=generator) * (1 + rank))
        (out.logits.sum() + out.pred_boxes.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        model.save_pretrained(trained)
    return {
        key: value.detach().clone()
        for key, value in model.state_dict().items()
        if key.endswith(("running_mean", "running_var", "num_batches_tracked"))
    }
