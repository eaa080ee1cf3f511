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
            kinds = sorted({f"{type(m).__name__}:{type(m.act).__name__}" for m in self.net.modules() if hasattr(m, "act")})
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
