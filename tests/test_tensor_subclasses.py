"""Tensor subclasses (MONAI's MetaTensor, torchvision's tv_tensors, users' own) through bnsurgeon's sync layers.

Every input torch's BatchNorm accepts, the layers accept on every path, and the output has the class torch's layer
returns for it (a ``__torch_function__`` subclass wraps the result as it wraps ``F.batch_norm``'s: a MetaTensor
with its metadata, a tv_tensors.Image as a plain tensor). Where the layer synchronizes it is entered once through
the subclass's ``__torch_function__`` and runs on the plain tensor, so nothing inside meets the subclass's own
methods (MetaTensor's ``new_empty`` takes no int size, which stopped MONAI's DDP tutorial in bnsurgeon's gather).

In this process: one process (bit for bit torch's layer), the CUDA path (strict stand-ins, two identical ranks),
nn.DataParallel's replicas. One torchrun launch of tests/_subclass_cases.py under ``-m bnsurgeon run``: each kind
on 2 gloo ranks, eagerly, checkpointed and compiled, against one process on the whole batch; and MONAI's DDP
tutorial's UNet, ``norm="syncbatch"`` and ``norm="batch"`` plus torch's converter, trained with MONAI's DiceLoss
(skipped with the reason where MONAI is not installed: it is the optional extra ``monai``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import _subclass_cases as cases
import pytest
import torch
from test_data_parallel import cpu_replicate, data_parallel_step  # noqa: F401  (a fixture and its helper)
from torch import nn

import bnsurgeon
from bnsurgeon.runtime.layers import SyncBatchNorm

CASES = Path(cases.__file__)
KINDS = cases.kinds()
EXACT = dict(rtol=1e-12, atol=1e-12)
NO_MONAI = "MONAI is not installed (optional extra: pip install 'bnsurgeon[monai]')"
#: torchrun starts 3 interpreters that import torch (and MONAI), then compiles: generous on a busy 2-core machine
LAUNCH_TIMEOUT = 280


def _ours(kind: str) -> nn.Module:
    return bnsurgeon.convert(nn.Sequential(cases.batch_norm(kind)), "sync").model


def _assert_same(got: dict, want: dict, what: str, **tolerance) -> None:
    """Outputs and input gradients per step, parameter gradients, running statistics: equal, or within ``tolerance``."""
    for name in ("y", "dx"):
        for step, (a, b) in enumerate(zip(got[name], want[name])):
            torch.testing.assert_close(a, b, **tolerance, msg=lambda m: f"{what}: {name} step {step}: {m}")
    for name in ("weight_grad", "bias_grad", "running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(got[name], want[name], **tolerance, msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_process_is_torchs_batch_norm_bit_for_bit(kind, mode):
    """No process group: torch's F.batch_norm on the input as given, so the class, metadata, layout and every bit
    are what torch's BatchNorm gives, and the subclass is called as often as there."""
    theirs, ours = cases.batch_norm(kind), _ours(kind)
    if mode == "eval":
        theirs.eval(), ours.eval()
    want = cases.train(kind, theirs, slice(None), "one process")
    got = cases.train(kind, ours, slice(None), "one process")
    assert got["described"] == want["described"] and got["seen"] == want["seen"], (got, want)
    _assert_same(got, want, f"{kind} {mode}", rtol=0, atol=0)


def _named_layer(kind: str) -> nn.Module:
    model = _ours(kind)
    model[0].layer_name = "0"
    return model


def _doubled_reference(kind: str) -> dict:
    """torch's layer on each batch concatenated with itself (two identical ranks), cut to one copy: the output
    and input gradient of one rank, half the parameter gradients."""
    module = cases.batch_norm(kind)
    out: dict = {"y": [], "dx": [], "described": []}
    for step in range(cases.STEPS):
        x, g = cases.batch(kind, step)
        both = cases.wrap(kind, torch.cat([x, x]), "one rank")
        y = module(both)
        (y * torch.cat([g, g])).sum().backward()
        n = x.shape[0]
        out["y"].append(cases.plain(y)[:n])
        out["dx"].append(cases.plain(both.grad)[:n])
        out["described"].append(cases.describe(kind, y, both)["type"])
    out["weight_grad"], out["bias_grad"] = module.weight.grad / 2, module.bias.grad / 2
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        out[name] = cases.plain(getattr(module, name))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_path_takes_every_kind_and_returns_what_torch_does(kind, monkeypatch):
    """The device path (device_path.py) through the strict stand-ins of the CUDA kernels, two identical ranks: the
    class torch's layer returns, the metadata or tag kept, the subclass called only to enter, torch's values.
    (The stand-in kernels without _cuda_standin's strict device: under a dispatch mode torch 2.4's default
    __torch_function__ cannot wrap any result in a subclass, torch's F.batch_norm's included.)"""
    import _cuda_standin

    from bnsurgeon.runtime import sync_function

    for name in _cuda_standin.KERNELS:
        monkeypatch.setattr(torch, name, getattr(_cuda_standin, name))
    monkeypatch.setattr(sync_function, "uses_device_path", lambda x: True)
    monkeypatch.setattr(sync_function, "counts_on_host", lambda x: False)
    monkeypatch.setattr(SyncBatchNorm, "_sync_group", lambda self: (None, 2))
    _cuda_standin.identical_ranks(monkeypatch)
    want = _doubled_reference(kind)
    got = cases.train(kind, _named_layer(kind), slice(None), "one rank")
    assert [d["type"] for d in got["described"]] == want["described"], (got["described"], want["described"])
    assert all(d["kept"] and d["layout_kept"] for d in got["described"]), got["described"]
    if kind == "tagged":  # the input check and the entry, as torch's layer: its input check and F.batch_norm
        assert got["seen"] == [2] * cases.STEPS, got["seen"]
    _assert_same(got, want, f"{kind} on the CUDA path", **EXACT)


@pytest.mark.parametrize("kind", KINDS)
def test_data_parallel_replicas_take_every_kind(kind, cpu_replicate):  # noqa: F811
    """nn.DataParallel's replicas (torch's replicate, a thread each): each replica's slice as the kind, the whole
    batch's statistics, torch's values and class."""
    module = cases.batch_norm(kind)
    model = _ours(kind).train()
    sizes = (2, 2)
    for step in range(cases.STEPS):
        x, g = cases.batch(kind, step)
        reference_x = cases.wrap(kind, x, "whole batch")
        want = module(reference_x)
        (want * g).sum().backward()
        ours_x = cases.wrap(kind, x, "whole batch")
        got = data_parallel_step(model, ours_x, g, sizes, cpu_replicate)
        torch.testing.assert_close(cases.plain(got), cases.plain(want), **EXACT)
        torch.testing.assert_close(cases.plain(ours_x.grad), cases.plain(reference_x.grad), **EXACT)
        assert type(got).__name__ == type(want).__name__, (type(got), type(want))
    layer = model[0]
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(layer, name).grad, getattr(module, name).grad, **EXACT)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(layer, name), getattr(module, name), **EXACT)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    return env


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """torchrun --nproc-per-node 2 -m bnsurgeon run _subclass_cases.py OUT SECTION..., once for the module."""
    from _dist import torchrun

    out = tmp_path_factory.mktemp("subclasses")
    sections = ["subclasses"] + (["monai-syncbatch", "monai-converted"] if cases.HAS_MONAI else [])
    command = torchrun("-m", "bnsurgeon", "run", "-q", str(CASES), str(out), *sections)
    done = subprocess.run(command, cwd=out, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        section: [torch.load(out / f"{section}.rank{rank}.pt", weights_only=False) for rank in range(2)]
        for section in sections
    }


@pytest.mark.distributed
@pytest.mark.parametrize("path", cases.PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_process_for_every_kind(launched, kind, path):
    """2 gloo ranks (an uneven split) against torch's BN on the whole batch in one process, float64, two steps:
    outputs and input gradients per slice, parameter gradients summed, running statistics and the batch count
    (once per step, checkpointed or not) on each rank; each output of the class torch's layer returns for the
    rank's slice, with its metadata, tag and layout; the subclass called as often as under torch's layer (its input
    check and the layer's entry), but compiled, where dynamo traces it."""
    ranks = [results[kind, path] for results in launched["subclasses"]]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}: {result['error']}"
    want = cases.reference(kind)
    got = {
        "y": [torch.cat([r["y"][step] for r in ranks]) for step in range(cases.STEPS)],
        "dx": [torch.cat([r["dx"][step] for r in ranks]) for step in range(cases.STEPS)],
        "weight_grad": sum(r["weight_grad"] for r in ranks),
        "bias_grad": sum(r["bias_grad"] for r in ranks),
    }
    for rank, result in enumerate(ranks):
        state = {name: result[name] for name in ("running_mean", "running_var", "num_batches_tracked")}
        _assert_same({**got, **state}, want, f"{kind} {path} rank {rank}", **EXACT)
        types = [d["type"] for d in result["described"]]
        assert types == [d["type"] for d in want["described"]], (rank, types)
        assert all(d["kept"] and d["layout_kept"] for d in result["described"]), (rank, result["described"])
        if path != "compiled":
            seen = cases.reference(kind, path)["seen"]
            assert result["seen"] == seen, (rank, result["seen"], seen)
    for name in ("running_mean", "running_var"):
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{kind} {path}: {name} differs between the ranks"


@pytest.mark.distributed
def test_fullgraph_compile_of_a_subclass_names_why_and_what_to_do(launched):
    """torch.compile(fullgraph=True) refuses the eager entry, quoting the layer's reason and the two ways out (where
    dynamo reaches the layer: torch 2.4's refuses the subclass itself first, as it does before torch's layer)."""
    for results in launched["subclasses"]:
        said = results["fullgraph"]
        assert said != "compiled"
        if "UserDefinedObjectVariable(NarrowTensor)" in said:
            continue
        assert "a sync batch norm layer given a tensor subclass" in said, said
        assert "compile without fullgraph=True" in said and "x.as_subclass(torch.Tensor)" in said, said


@pytest.mark.distributed
@pytest.mark.skipif(not cases.HAS_MONAI, reason=NO_MONAI)
@pytest.mark.parametrize("section", ["monai-syncbatch", "monai-converted"])
def test_monais_ddp_tutorial_trains_exactly(launched, section):
    """MONAI's unet_training_ddp.py as its users change it for sync BN: UNet(norm="syncbatch") (torch's layer,
    adopted at DDP) and norm="batch" plus torch's converter, MetaTensor batches, DiceLoss(sigmoid=True), Adam: the
    ranks' weights and statistics bit-identical after two steps, equal to one process on the whole batch (float64),
    the mean of the ranks' losses its loss, and the network's output a MetaTensor with the batch's metadata."""
    ranks = launched[section]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank}: {result['error']}"
    want = cases.monai_reference()
    for rank, result in enumerate(ranks):
        assert result["classes"] == ["bnsurgeon.runtime.layers.SyncBatchNorm"], (rank, result["classes"])
        assert result["output_type"] == ["MetaTensor"] * cases.MONAI_STEPS and all(result["meta_kept"]), result
    for name, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][name]), f"{section}: {name} differs between the ranks"
        torch.testing.assert_close(value, want["state"][name], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    for step in range(cases.MONAI_STEPS):
        mean = sum(result["loss"][step] for result in ranks) / len(ranks)
        assert abs(mean - want["loss"][step]) < 1e-12, (step, mean, want["loss"][step])
