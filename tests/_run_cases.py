"""A training script as users write it, run by tests/test_run.py under ``torchrun -m bnsurgeon run``.

It converts with each converter exactly as the projects that call it do (torch's classmethod
with a process group; timm's function imported by name at the top, before any call; a
Lightning Trainer with ``sync_batchnorm=True``), trains two steps with DDP and buffer
broadcast off on 2 CPU ranks whose data differ, and saves each rank's BN running statistics
and layer classes to OUT/SECTION.rankR.pt. The tests load this file as a module too, for the
model, the data and the one-process reference.

usage: case.py OUT SECTION...   (SECTION: torch, timm, lightning, built)

``built`` calls no converter: its models build torch's ``nn.SyncBatchNorm`` themselves, as OpenMMLab's registry
(``norm_cfg=dict(type='SyncBN')``), detectron2's ``get_norm("SyncBN")`` and a model's own ``__init__`` do, one
more is unpickled whole, and one trains without DDP; each optimizer is built before DDP wraps the model.

Without torchrun, ``case.py OUT spawn lightning`` starts the ranks as users do without it: ``spawn``
runs the torch section in 2 workers of the script's own ``torch.multiprocessing.spawn``, ``lightning``
lets Lightning's launcher start rank 1 as ``python case.py ...`` (that rank skips ``spawn``).
"""

import os
import sys

import torch
import torch.distributed as dist
from timm.layers import BatchNormAct2d, convert_sync_batchnorm
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

N, STEPS, LR = 8, 2, 0.1


def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),
        BatchNormAct2d(4, act_layer=nn.ReLU),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4),
        FrozenBatchNorm2d(4),
    )
    return model.double()


def data():
    """Every odd sample shifted by +3: the ranks (samples r, r+2, ...) see different distributions, so BN
    statistics that are not synchronized end far from the whole batch's."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(N, 3, 6, 6, generator=generator, dtype=torch.float64)
    x[1::2] += 3
    g = torch.randn(N, 4, 4, 4, generator=generator, dtype=torch.float64)
    return x, g


def statistics(model):
    return {
        name: buffer.detach().clone()
        for name, buffer in model.named_buffers()
        if name.endswith(("running_mean", "running_var"))
    }


def layers(model):
    """What each BN-family layer is, with its activation: 'Class' or 'Class/Act'."""
    return [
        type(m).__name__ + (f"/{type(m.act).__name__}" if hasattr(m, "act") else "")
        for m in model.modules()
        if "BatchNorm" in type(m).__name__
    ]


def train(model, x, g, world):
    """STEPS of SGD on a loss whose DDP-averaged gradient is the whole batch's gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        ((model(x) * g).sum() * world / N).backward()
        optimizer.step()


def reference():
    """One process, plain BN, the whole batch."""
    model = build_model().train()
    train(model, *data(), world=1)
    return statistics(model)


def with_ddp(model, rank, world):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    x, g = data()
    train(ddp, x[rank::world], g[rank::world], world)
    return model


def torch_section(rank, world):
    group = dist.new_group(list(range(world)))
    model = build_model()
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    groups_kept = all(m.process_group is group for m in model.modules() if isinstance(m, nn.SyncBatchNorm))
    result = {"same_object": converted is model, "groups_kept": groups_kept, "layers": layers(converted)}
    with_ddp(converted, rank, world)
    return {**result, "stats": statistics(converted)}


def timm_section(rank, world):
    model = build_model()
    converted = convert_sync_batchnorm(model)
    result = {"same_object": converted is model, "layers": layers(converted)}
    with_ddp(converted, rank, world)
    return {**result, "stats": statistics(converted)}


def lightning_section(rank, world):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    seen = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()

        def training_step(self, batch, index):
            if self.global_step == 0:
                seen["layers"] = layers(self.net)
            x, g = batch
            return (self.net(x) * g).sum() * self.trainer.world_size / N

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):  # the distributed sampler deals samples r, r+2, ... to rank r
            return DataLoader(TensorDataset(*data()), batch_size=N // self.trainer.world_size, shuffle=False)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(broadcast_buffers=False),
        sync_batchnorm=True,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return {
        "layers": seen["layers"],
        "after_fit": layers(module.net),
        "stats": statistics(module.net),
        "rank": trainer.global_rank,
    }


#: a registry that captured the classes when the script was imported, as mmcv's MODELS registry does
NORM_LAYERS = {"BN": nn.BatchNorm2d, "SyncBN": nn.SyncBatchNorm}


def get_norm(norm, channels):
    """detectron2's ``get_norm``: a name -> a norm layer built on the spot."""
    return {"BN": nn.BatchNorm2d, "SyncBN": lambda c: nn.SyncBatchNorm(c)}[norm](channels)


def norm_layer(how, channels):
    if how == "constructor":
        return nn.SyncBatchNorm(channels)
    if how == "registry":
        return NORM_LAYERS["SyncBN"](channels)
    if how == "get_norm":
        return get_norm("SyncBN", channels)
    return nn.BatchNorm2d(channels)  # "plain": the one-process reference


class Built(nn.Module):
    """A model that builds its own norm layers (conv -> norm -> relu -> conv -> norm -> frozen BN)."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = norm_layer(how, 4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = norm_layer(how, 4)
        self.frozen = FrozenBatchNorm2d(4)

    def forward(self, x):
        return self.frozen(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


BUILT = ["constructor", "registry", "get_norm", "unpickled", "without_ddp"]


def built_model(how):
    if how == "unpickled":  # a whole module saved with torch.save and loaded back, as a script loads one
        import io

        buffer = io.BytesIO()
        torch.save(Built("constructor").double(), buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    return Built("constructor" if how == "without_ddp" else how).double()


def built_reference():
    """One process, BatchNorm2d, the whole batch."""
    model = Built("plain").double().train()
    train(model, *data(), world=1)
    return statistics(model)


def built_section(rank, world):
    results = {}
    x, g = data()
    for how in BUILT:
        model = built_model(how)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # before DDP: it must keep training them
        params = [id(p) for p in model.parameters()]
        if how == "without_ddp":  # synchronized gradients by hand; the layers run under the process group
            net = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model, broadcast_buffers=False)
        for _ in range(STEPS):
            optimizer.zero_grad()
            ((net(x[rank::world]) * g[rank::world]).sum() * world / N).backward()
            if how == "without_ddp":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
        results[how] = {
            "stats": statistics(model),
            "layers": layers(model),
            "isinstance": all(isinstance(m, nn.SyncBatchNorm) for m in (model.bn1, model.bn2)),
            "same_params": params == [id(p) for p in model.parameters()],
            "keys": sorted(model.state_dict()),
        }
    return results


def spawn_worker(rank, out, port):
    """A worker of the script's own torch.multiprocessing.spawn: a fresh interpreter, not bnsurgeon run."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.save(torch_section(rank, 2), f"{out}/spawn.rank{rank}.pt")
    dist.barrier()  # both past their last collective before either tears the group down (gloo aborts otherwise)
    dist.destroy_process_group()


def without_torchrun(out, sections):
    if "spawn" in sections and "LOCAL_RANK" not in os.environ:  # not in the rank Lightning's launcher started
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(spawn_worker, args=(out, port), nprocs=2)
    if "lightning" in sections:
        result = lightning_section(None, 2)
        torch.save(result, f"{out}/launcher.rank{result['rank']}.pt")


def main():
    out, sections = sys.argv[1], sys.argv[2:]
    if "spawn" in sections or "RANK" not in os.environ:
        return without_torchrun(out, sections)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for section in sections:
        result = globals()[f"{section}_section"](rank, world)
        torch.save(result, f"{out}/{section}.rank{rank}.pt")
    dist.barrier()  # both past their last collective before either tears the group down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
