"""A LightningModule for the plugin test (importable by ddp_spawn's worker processes)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

N, STEPS, LR = 8, 3, 0.01

import lightning.pytorch as pl  # noqa: E402


def tiny_model():
    import timm

    torch.manual_seed(0)
    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=4).double()


def data():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(N, 3, 32, 32, generator=generator, dtype=torch.float64)
    g = torch.randn(N, 4, generator=generator, dtype=torch.float64)
    return x, g


class Module(pl.LightningModule):
    def __init__(self, record_path: str):
        super().__init__()
        self.net = tiny_model()
        self.record_path = record_path

    def training_step(self, batch, index):
        x, g = batch
        if self.global_step == 0:  # what the layers are while training, per rank
            kinds = sorted(
                {f"{type(m).__name__}:{type(m.act).__name__}" for m in self.net.modules() if hasattr(m, "act")}
            )
            with open(f"{self.record_path}.rank{self.global_rank}", "w") as handle:
                handle.write("\n".join(kinds))
        # sum over the global batch, scaled so DDP's gradient average equals the full-batch gradient
        return (self.net(x) * g).sum() * self.trainer.world_size / N

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data()), batch_size=N // self.trainer.world_size, shuffle=False)


def reference_state():
    net = tiny_model().train()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, g = data()
    for _ in range(STEPS):
        optimizer.zero_grad()
        ((net(x) * g).sum() / N).backward()
        optimizer.step()
    return net.state_dict()


class PrecisionModule(pl.LightningModule):
    """A tiny conv net with a BatchNormAct2d and a BatchNorm2d for the precision runs.

    The two ranks get batches from different distributions (the sampler deals samples
    alternately, and every odd sample is shifted by +3), so unsynced BN would end with
    running stats ~0.2 away from the full-batch ones (tolerance 2e-2).
    """

    def __init__(self):
        super().__init__()
        self.net = precision_net()

    def training_step(self, batch, index):
        x, g = batch
        return (self.net(x).float() * g.float()).sum() * self.trainer.world_size / N

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*precision_data()), batch_size=N // self.trainer.world_size, shuffle=False)


def precision_net():
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        BatchNormAct2d(8, act_layer=torch.nn.SiLU),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def precision_data():
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(N, 3, 8, 8, generator=generator)
    x[1::2] += 3.0
    g = torch.randn(N, 4, generator=generator)
    return x, g


def precision_reference_state():
    """Full-batch float32 training of the same net: what synced low-precision training approximates."""
    net = precision_net().train()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, g = precision_data()
    for _ in range(STEPS):
        optimizer.zero_grad()
        ((net(x) * g).sum() / N).backward()
        optimizer.step()
    return net.state_dict()


def precision_rank(rank: int, world_size: int, precisions: list[str]) -> dict:
    """Worker: one Lightning Trainer per precision inside an already-initialized gloo world
    (Lightning sees the torchrun-style variables and joins it: one spawn for every precision)."""
    import os

    from bnsurgeon.integrations.lightning import BNSurgeonLayerSync

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    from bnsurgeon.runtime import sync_op

    op_calls = [0]
    eager_statistics = sync_op.global_stats

    def counted(*args, **kwargs):
        op_calls[0] += 1
        return eager_statistics(*args, **kwargs)

    sync_op.global_stats = counted  # counts the sync layers run through the compiled path's custom op
    states = {}
    for run in precisions:
        precision, _, compiled = run.partition(" ")
        module = PrecisionModule()
        op_calls[0] = 0
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp",
            sync_batchnorm=True,
            plugins=[BNSurgeonLayerSync()],
            max_steps=STEPS,
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(torch.compile(module, backend="aot_eager") if compiled else module)
        states[run] = {name: value.float().clone() for name, value in module.net.state_dict().items()}
        states[run]["compiled sync layer calls"] = op_calls[0]
    return states
