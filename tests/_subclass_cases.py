"""Tensor subclasses through bnsurgeon's sync layers: the input kinds, and a script that trains with them.

Run by tests/test_tensor_subclasses.py as ``torchrun --nproc-per-node 2 -m bnsurgeon run _subclass_cases.py OUT
SECTION...`` on 2 CPU gloo ranks; each rank saves OUT/SECTION.rankR.pt (plain tensors and names only). The test
imports this file too, for the kinds and the one-process references.

- ``subclasses``: each input kind through a layer torch's converter made (bnsurgeon's, under ``bnsurgeon run``),
  rank r on its slice of every batch (an uneven split), two steps of a plain-sum loss: eagerly, checkpointed
  (non-reentrant and reentrant) and compiled (aot_eager); and ``fullgraph=True``'s refusal.
- ``monai-syncbatch``, ``monai-converted``: MONAI's DDP tutorial (``unet_training_ddp.py``) as its users change
  it, on small synthetic 3-D volumes in float64: ``UNet(norm="syncbatch")`` (torch's SyncBatchNorm, built by
  MONAI's norm factory) and ``UNet(norm="batch")`` plus torch's converter, trained with MONAI's DiceLoss(sigmoid=True)
  and Adam under DistributedDataParallel, the batches collated by MONAI (batched MetaTensors).

The kinds: MONAI's MetaTensor (where MONAI is installed), torchvision's ``tv_tensors.Image``, a subclass whose own
``new_empty``/``new_zeros``/``new_full``/``view`` take narrower arguments than torch's (non-contiguous and
channels_last_3d too), and one that keeps itself and a tag through every op and logs what it is given.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch
from torch import nn

HAS_MONAI = importlib.util.find_spec("monai") is not None
CHANNELS = 3
SPLIT = [1, 3]  # uneven: rank 0 holds one sample
STEPS = 2
SEED = 7


class NarrowTensor(torch.Tensor):
    """A subclass whose own allocation and view methods take narrower arguments than torch's, as MONAI's
    ``MetaTensor.new_empty`` takes no int size: any internal call of them with torch's other forms raises."""

    def new_empty(self, size, **kwargs):  # type: ignore[override]
        if not isinstance(size, tuple):
            raise TypeError("NarrowTensor.new_empty takes its size as one tuple")
        return super().new_empty(size, **kwargs)

    def new_zeros(self, size, **kwargs):  # type: ignore[override]
        if not isinstance(size, tuple):
            raise TypeError("NarrowTensor.new_zeros takes its size as one tuple")
        return super().new_zeros(size, **kwargs)

    def new_full(self, size, fill_value, **kwargs):  # type: ignore[override]
        if not isinstance(size, tuple):
            raise TypeError("NarrowTensor.new_full takes its size as one tuple")
        return super().new_full(size, fill_value, **kwargs)

    def view(self, *shape):  # type: ignore[override]
        if len(shape) != 1 or not isinstance(shape[0], tuple):
            raise TypeError("NarrowTensor.view takes its shape as one tuple")
        return super().view(shape[0])


class TaggedTensor(torch.Tensor):
    """Keeps itself and its ``tag`` through every op (each tensor result is a TaggedTensor with the tag of its
    first TaggedTensor argument), and logs the name of every function its ``__torch_function__`` is given."""

    tag = ""
    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        result = super().__torch_function__(func, types, args, kwargs or {})
        tag = next((a.tag for a in args if isinstance(a, TaggedTensor)), "")
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, TaggedTensor):
                value.tag = tag
        return result


def kinds() -> list[str]:
    """The input kinds: MONAI's only where MONAI is installed."""
    names = ["image", "narrow", "narrow-non-contiguous", "narrow-channels-last-3d", "tagged"]
    return (["metatensor", "metatensor-channels-last-3d"] if HAS_MONAI else []) + names


def spatial(kind: str) -> tuple[int, ...]:
    return (4, 5) if kind == "image" else (3, 4, 2)  # tv_tensors.Image is (N, C, H, W)


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, upstream gradient) of the whole batch, float64 plain tensors, in the kind's layout."""
    generator = torch.Generator().manual_seed(SEED * 100 + step)
    shape = (sum(SPLIT), CHANNELS, *spatial(kind))
    if kind.endswith("non-contiguous"):  # every other value of a wider tensor: strided, neither layout
        wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=generator, dtype=torch.float64)
        x = wide[..., ::2]
    else:
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
    x = x * 3 + 1.5
    if kind.endswith("channels-last-3d"):
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return x, torch.randn(shape, generator=generator, dtype=torch.float64)


def wrap(kind: str, x: torch.Tensor, where: str) -> torch.Tensor:
    """``x`` as the kind, named by ``where`` (its metadata or tag), as a leaf that requires grad."""
    if kind.startswith("metatensor"):
        from monai.data import MetaTensor

        affine = torch.diag(torch.tensor([1.5, 2.0, 2.5, 1.0], dtype=torch.float64))
        wrapped = MetaTensor(x, affine=affine, meta={"filename_or_obj": where})
    elif kind == "image":
        from torchvision import tv_tensors

        wrapped = tv_tensors.Image(x)
    elif kind.startswith("narrow"):
        wrapped = x.as_subclass(NarrowTensor)
    else:
        wrapped = x.as_subclass(TaggedTensor)
        wrapped.tag = where
    return wrapped.detach().requires_grad_()


def describe(kind: str, y: torch.Tensor, x: torch.Tensor) -> dict:
    """What the output kept of the input: its class, its metadata or tag, its layout."""
    kept = True
    if kind.startswith("metatensor"):
        kept = y.meta.get("filename_or_obj") == x.meta.get("filename_or_obj") and torch.equal(y.affine, x.affine)
    elif kind == "tagged":
        kept = y.tag == x.tag
    layout = torch.channels_last_3d if kind.endswith("channels-last-3d") else torch.contiguous_format
    return {"type": type(y).__name__, "kept": kept, "layout_kept": y.is_contiguous(memory_format=layout)}


def plain(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().as_subclass(torch.Tensor).clone()


def batch_norm(kind: str) -> nn.Module:
    """torch's BN for the kind's dimensions, with non-trivial parameters and running statistics."""
    module = (nn.BatchNorm2d if kind == "image" else nn.BatchNorm3d)(CHANNELS).double()
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        module.weight.copy_(torch.rand(CHANNELS, generator=generator, dtype=torch.float64) + 0.5)
        module.bias.copy_(torch.randn(CHANNELS, generator=generator, dtype=torch.float64))
        module.running_mean.copy_(torch.randn(CHANNELS, generator=generator, dtype=torch.float64))
        module.running_var.copy_(torch.rand(CHANNELS, generator=generator, dtype=torch.float64) + 0.5)
    return module


def train(kind: str, module: nn.Module, rows: slice, where: str, run=None, around=contextlib.nullcontext) -> dict:
    """STEPS of forward and backward of a plain-sum loss on ``rows`` of each batch, inside ``around()``: outputs,
    input gradients, parameter gradients, running statistics, and what each output kept of its input."""
    run = run if run is not None else module
    out: dict = {"y": [], "dx": [], "described": [], "seen": []}
    for step in range(STEPS):
        x, g = batch(kind, step)
        leaf = wrap(kind, x[rows], f"{where}, step {step}")  # outside ``around``: torch 2.4 makes no subclass in a mode
        TaggedTensor.seen.clear()
        with around():
            y = run(leaf)
            seen = len(TaggedTensor.seen)
            (y * g[rows]).sum().backward()
        out["seen"].append(seen)
        out["described"].append(describe(kind, y, leaf))
        out["y"].append(plain(y))
        out["dx"].append(plain(leaf.grad))
    layer = module[0] if isinstance(module, nn.Sequential) else module
    for name in ("weight", "bias"):
        out[f"{name}_grad"] = plain(getattr(layer, name).grad)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        out[name] = plain(getattr(layer, name))
    return out


def runner(path: str, model: nn.Module):
    """How ``model`` is called on the path: as it is, or inside torch's activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    if path.startswith("checkpoint"):
        reentrant = path == "checkpoint-reentrant"
        return lambda x: checkpoint(model, x, use_reentrant=reentrant)
    if path == "compiled":
        return torch.compile(model, backend="aot_eager")
    return model


def reference(kind: str, path: str = "eager") -> dict:
    """torch's BN on the whole batch in one process, called as on ``path`` (compiled: eagerly; torch's layer does
    not compile a subclass input that requires grad). Checkpointed, torch's layer counts the batch and moves its
    statistics twice (forward and recompute): compare its calls of the subclass, not its statistics."""
    module = batch_norm(kind)
    return train(kind, module, slice(None), "whole batch", runner("eager" if path == "compiled" else path, module))


def rank_rows(rank: int) -> slice:
    return slice(sum(SPLIT[:rank]), sum(SPLIT[: rank + 1]))


def converted(kind: str) -> nn.Module:
    """The layer as a script gets it: torch's converter (bnsurgeon's, under ``bnsurgeon run``)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(batch_norm(kind)))


def attempt(run) -> dict:
    """``run()``'s result, or the error it raised (the same op raises on every rank: the launch goes on, and the
    test names the error of each case)."""
    import traceback

    try:
        return run()
    except Exception:
        return {"error": traceback.format_exc(limit=-6)}


PATHS = ["eager", "checkpoint-non-reentrant", "checkpoint-reentrant", "compiled"]


def subclasses_section(rank: int, world: int) -> dict:
    results: dict = {}
    rows = rank_rows(rank)
    for kind in kinds():
        for path in PATHS:
            model = converted(kind)
            results[kind, path] = attempt(lambda: train(kind, model, rows, f"rank {rank}", runner(path, model)))
    torch._dynamo.reset()
    model = converted("narrow")
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(wrap("narrow", batch("narrow", 0)[0][rows], ""))
        results["fullgraph"] = "compiled"
    except Exception as error:  # dynamo's refusal, quoting the layer's reason
        results["fullgraph"] = str(error)
    return results


# ---- MONAI's DDP tutorial (acceleration/distributed_training/unet_training_ddp.py), small and on CPU ----

VOLUMES, SIDE, MONAI_STEPS = 4, 16, 2


def unet(norm: str) -> nn.Module:
    """The tutorial's UNet at a test's size (its channels (16, 32, 64, 128, 256) on 96^3 crops), in float64."""
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    return UNet(
        spatial_dims=3, in_channels=1, out_channels=1, channels=(4, 8, 16), strides=(2, 2), num_res_units=2, norm=norm
    ).double()


def volumes(step: int) -> list[dict]:
    """Synthetic image/segmentation pairs as MONAI's transforms give them: channel-first MetaTensors."""
    import numpy as np
    from monai.data import MetaTensor, create_test_image_3d

    samples = []
    for index in range(VOLUMES):
        state = np.random.RandomState(1000 * step + index)
        image, seg = create_test_image_3d(
            SIDE, SIDE, SIDE, num_objs=3, rad_max=5, rad_min=2, num_seg_classes=1, channel_dim=0, random_state=state
        )
        meta = {"filename_or_obj": f"img{index}.nii.gz"}
        samples.append(
            {
                "img": MetaTensor(torch.as_tensor(image, dtype=torch.float64), meta=dict(meta)),
                "seg": MetaTensor(torch.as_tensor(seg, dtype=torch.float64), meta=dict(meta)),
            }
        )
    return samples


def collated(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    from monai.data import list_data_collate

    batch_data = list_data_collate(samples)
    return batch_data["img"], batch_data["seg"]


def monai_train(model: nn.Module, samples_of) -> dict:
    """The tutorial's loop: DiceLoss(sigmoid=True), Adam(1e-3), zero_grad/forward/loss/backward/step."""
    from monai.losses import DiceLoss

    loss_function = DiceLoss(sigmoid=True)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    out: dict = {"loss": [], "output_type": [], "meta_kept": []}
    model.train()
    for step in range(MONAI_STEPS):
        inputs, labels = collated(samples_of(volumes(step)))
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = loss_function(outputs, labels)
        loss.backward()
        optimizer.step()
        out["loss"].append(float(loss.detach()))
        out["output_type"].append(type(outputs).__name__)
        out["meta_kept"].append(list(outputs.meta.get("filename_or_obj", [])) == list(inputs.meta["filename_or_obj"]))
    inner = model.module if hasattr(model, "module") else model
    out["state"] = {name: plain(value) for name, value in inner.state_dict().items()}
    out["classes"] = sorted(
        {f"{type(m).__module__}.{type(m).__name__}" for m in inner.modules() if "BatchNorm" in type(m).__name__}
    )
    return out


def monai_reference() -> dict:
    """One process, ``norm="batch"``, the whole batch."""
    return monai_train(unet("batch"), lambda samples: samples)


def monai_section(rank: int, world: int, norm: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = unet(norm)
    if norm == "batch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DistributedDataParallel(model)  # the tutorial's device_ids=[device] is a GPU's
    return monai_train(model, lambda samples: samples[rank::world])  # DistributedSampler's deal, unshuffled


def main() -> None:
    import torch.distributed as dist

    out, sections = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for section in sections:
        if section == "subclasses":
            result = subclasses_section(rank, world)
        else:
            norm = {"monai-syncbatch": "syncbatch", "monai-converted": "batch"}[section]
            result = attempt(lambda: monai_section(rank, world, norm))
        torch.save(result, os.path.join(out, f"{section}.rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
