"""A script that ``torchrun --nproc-per-node 2 -m bnsurgeon run`` runs: models that build torch's ``nn.SyncBatchNorm``
themselves, where one rank did something the other did not before training (test_trust_round_six.py).

usage: _history_cases.py OUT SCENARIO...

Each scenario trains in float64 on CPU/gloo and saves what it trained to OUT/SCENARIO.rankR.pt: the running
statistics and the outputs of each step, or the error a rank met. torch's SyncBatchNorm syncs nothing in eval
mode, so whatever one rank does in eval mode, or builds and never runs, must change nothing: every scenario but
``mismatch`` trains exactly as one process with BatchNorm2d on the whole batch (``reference``).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

N, STEPS, LR = 8, 2, 0.1


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, 6, 6, generator=generator, dtype=torch.float64)
    g = torch.randn(N, 4, 4, 4, generator=generator, dtype=torch.float64)
    return x, g


def norm(kind, channels):
    return nn.BatchNorm2d(channels) if kind == "plain" else nn.SyncBatchNorm(channels)


class Net(nn.Module):
    """conv -> norm -> relu -> conv -> norm: two layers built at two lines of this file."""

    def __init__(self, kind, seed=0, channels_in=3):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(channels_in, 4, 3, bias=False)
        self.bn1 = norm(kind, 4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = norm(kind, 4)

    def forward(self, x):
        return self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))


class Head(nn.Module):
    """A second model, built at other lines: 4 -> 4 channels, same spatial size."""

    def __init__(self, kind, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = norm(kind, 4)

    def forward(self, x):
        return self.bn(self.conv(x))


class Pair(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(self.first(x))


def statistics(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def train(net, model, rank, world, by_hand=False):
    """STEPS of SGD on this rank's share (every world-th sample); gradients averaged by DDP or by hand."""
    x, g = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outputs = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        y = net(x[rank::world])
        ((y * g[rank::world]).sum() * world / N).backward()
        if by_hand and world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        outputs.append(y.detach().clone())
    return {"stats": statistics(model), "outputs": outputs, "types": sorted({type(m).__module__ for m in bns(model)})}


def bns(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, broadcast_buffers=False)


def eval_peek_section(rank, world):
    """Rank 0 alone runs one eval forward before DDP (a shape print, a summary, FLOPs)."""
    model = Net("sync").double()
    if rank == 0:
        model.eval()
        with torch.no_grad():
            model(data()[0][:2])
        model.train()
    after_peek = type(model.bn1).__module__
    return {**train(ddp(model), model, rank, world), "after_peek": after_peek}


def ema_peek_section(rank, world):
    """timm's way: an EMA deep-copied before DDP; rank 0 alone looks at it in eval mode."""
    model = Net("sync").double()
    ema = copy.deepcopy(model).eval()
    if rank == 0:
        with torch.no_grad():
            ema(data()[0][:2])
    return train(ddp(model), model, rank, world)


def extra_layer_section(rank, world):
    """No DDP: rank 0 builds one more layer first, by the model's own helper, never run."""
    if rank == 0:
        extra = norm("sync", 4).double()  # noqa: F841 - built, kept alive, never run
    model = Net("sync").double()
    return train(model, model, rank, world, by_hand=True)


def build_order_section(rank, world):
    """No DDP: two models built in a different order on each rank, run in the same order."""
    if rank == 0:
        first, second = Net("sync").double(), Head("sync").double()
    else:
        second = Head("sync").double()
        first = Net("sync").double()
    model = Pair(first, second)
    return train(model, model, rank, world, by_hand=True)


def native_extra_section(rank, world):
    """bnsurgeon's own layers built directly (no converter, no adoption): rank 0 builds one more first."""
    from bnsurgeon.runtime import SyncBatchNorm

    if rank == 0:
        extra = SyncBatchNorm(4).double()  # noqa: F841
    model = Net("plain").double()
    model.bn1, model.bn2 = SyncBatchNorm(4).double(), SyncBatchNorm(4).double()
    return train(model, model, rank, world, by_hand=True)


def compiled_section(rank, world, fullgraph=True):
    """Compiled with fullgraph=True before the first forward under the group: the adoption happens outside the
    trace, with no graph break and no warning from dynamo (after a reset, which clears dynamo's callbacks)."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Net("sync").double()
    compiled = torch.compile(model, fullgraph=fullgraph, backend="eager")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("torch").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train(compiled, model, rank, world, by_hand=True)
    finally:
        logging.getLogger("torch").removeHandler(handler)
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["warnings"] = [str(w.message) for w in caught if "dynamo" in str(w.filename) or "_dynamo" in str(w.message)]
    result["warnings"] += records
    return result


def compiled_default_section(rank, world):
    """The same without fullgraph: no graph break either, and nothing said by dynamo."""
    return compiled_section(rank, world, fullgraph=False)


class Branchy(nn.Module):
    """Two layers of one width; which one runs is the rank's (a data-dependent branch)."""

    def __init__(self, pick):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1, self.bn2 = norm("sync", 4), norm("sync", 4)
        self.pick = pick

    def forward(self, x):
        return self.bn1(self.conv(x)) if self.pick == 0 else self.bn2(self.conv(x))


def compiled_mismatch_section(rank, world):
    """A real mismatch under torch.compile: rank 0 runs bn1, rank 1 bn2 (the compiled path read no call stack, so
    both were 'the 1st layer to synchronize' and trained mixed)."""
    from bnsurgeon.core.errors import DistributedMismatchError

    model = torch.compile(Branchy(rank).double(), backend="eager")
    try:
        model(data()[0][rank::world])
    except DistributedMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def compiled_one_rank_mismatch_section(rank, world):
    """Rank 0 runs the model compiled, rank 1 eagerly: the layers are named alike (no false mismatch in the
    forward), and the backwards, which sum different quantities, are refused by name instead of mixed."""
    from bnsurgeon.core.errors import DistributedMismatchError

    model = Net("sync").double()
    call = torch.compile(model, backend="eager") if rank == 0 else model
    try:
        train(call, model, rank, world, by_hand=True)
    except DistributedMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def compiled_in_place_section(rank, world):
    """model.compile(fullgraph=True) in place, and each layer of a second model compiled in place: the frame dynamo
    compiles first is the layer's own forward, which the start callback adopted meanwhile."""
    model = Net("sync").double()
    model.compile(fullgraph=True, backend="eager")
    result = train(model, model, rank, world, by_hand=True)
    per_layer = Net("sync").double()
    per_layer.bn1.compile(fullgraph=True, backend="eager")
    per_layer.bn2.compile(fullgraph=True, backend="eager")
    result["per_layer"] = train(per_layer, per_layer, rank, world, by_hand=True)["stats"]
    return result


def mismatch_section(rank, world):
    """A real mismatch: rank 0 builds and runs one model, rank 1 another, of the same width, each built by the
    same helper line; neither rank ever built the other's layer."""
    from bnsurgeon.core.errors import DistributedMismatchError

    x = data()[0][rank::world]
    try:
        if rank == 0:
            Net("sync").double()(x)
        else:
            Head("sync").double()(torch.zeros(x.shape[0], 4, 4, 4, dtype=torch.float64))
    except DistributedMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def reference(scenario):
    """One process, BatchNorm2d, the whole batch."""
    model = Pair(Net("plain").double(), Head("plain").double()) if scenario == "build_order" else Net("plain").double()
    return train(model, model, 0, 1)


def main():
    out, scenarios = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for scenario in scenarios:
        try:
            result = globals()[f"{scenario}_section"](rank, world)
        except Exception as error:  # saved, so that the test names the scenario that failed and why
            result = {"failed": f"{type(error).__name__}: {error}"}
        torch.save(result, os.path.join(out, f"{scenario}.rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
