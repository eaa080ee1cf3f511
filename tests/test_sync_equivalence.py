"""W gloo ranks of bnsurgeon's sync layers == one process of plain BN on the whole batch.

Outputs and input gradients per slice, parameter gradients summed over ranks, running
mean/var and num_batches_tracked: within 1e-5 relative in fp32, bf16/fp16 within their
precision. Low precision three ways: bf16 input to an fp32 layer; the whole model cast
(``.to(bfloat16)``, ``.half()``) against plain BN in float32 on the same rounded values;
CPU autocast bf16, whose statistics must stay float32 (fp32 tolerance when the input is fp32).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _sync_cases import STEPS, pair_variant, reference, subgroup_rank, sync_rank

pytestmark = pytest.mark.distributed

SPLITS = {
    2: {"even": [4, 4], "uneven": [1, 7], "empty": [0, 8]},
    3: {"even": [3, 3, 2], "uneven": [6, 1, 1], "empty": [5, 0, 3]},
}


def _cases() -> list[dict]:
    base = []
    for name, shape in {"2d": (8, 5), "3d": (8, 5, 7), "4d": (8, 5, 4, 3), "5d": (8, 5, 3, 2, 2)}.items():
        base.append({"name": f"{name}", "shape": shape})
    base += [
        {"name": "4d-channels-last", "shape": (8, 6, 4, 3), "memory": "channels_last"},
        {"name": "5d-channels-last-3d", "shape": (8, 6, 3, 2, 2), "memory": "channels_last"},
        {"name": "momentum-none", "shape": (8, 5, 4, 3), "momentum": None},
        {"name": "affine-false", "shape": (8, 5, 4, 3), "affine": False},
        {"name": "no-running-stats", "shape": (8, 5, 4, 3), "trs": False},
        {"name": "act-relu-inplace", "shape": (8, 5, 4, 3), "act": "relu", "inplace": True},
        {"name": "act-silu", "shape": (8, 5, 4, 3), "act": "silu", "inplace": False},
        {"name": "large-mean", "shape": (8, 4, 4, 4), "offset": 1e4, "scale": 1.0, "loose": True},
        {"name": "bf16", "shape": (8, 5, 4, 3), "dtype": "bfloat16"},
        {"name": "model-bf16", "shape": (8, 5, 4, 3), "dtype": "bfloat16", "model_dtype": "bfloat16"},
        {"name": "model-fp16", "shape": (8, 5, 4, 3), "dtype": "float16", "model_dtype": "float16"},
        {"name": "model-bf16-2d", "shape": (8, 5), "dtype": "bfloat16", "model_dtype": "bfloat16"},
        {"name": "autocast-bf16", "shape": (8, 5, 4, 3), "autocast": "bfloat16"},
        {"name": "autocast-bf16-input", "shape": (8, 5, 4, 3), "dtype": "bfloat16", "autocast": "bfloat16"},
    ]
    cases = []
    for case in base:
        for split in ("even", "uneven", "empty"):
            cases.append(dict(case, name=f"{case['name']}-{split}", splits={w: SPLITS[w][split] for w in SPLITS}))
    return cases


CASES = _cases()


def _tolerance(case: dict) -> dict:
    if case.get("dtype") == "bfloat16":  # 8 significant bits: one rounding of the output is 4e-3 relative
        return {"rtol": 2e-2, "atol": 2e-2}
    if case.get("dtype") == "float16":  # 11 significant bits
        return {"rtol": 4e-3, "atol": 4e-3}
    if case.get("loose"):  # |mean| = 1e4: fp32 resolves x - mean only to ~1e-3, in the reference too
        return {"rtol": 1e-3, "atol": 5e-3}
    return {"rtol": 1e-5, "atol": 1e-5}


def _compare(case: dict, ranks: list[dict], expected: dict) -> None:
    tol = _tolerance(case)
    for step in range(STEPS):
        y = torch.cat([r["y"][step] for r in ranks])
        dx = torch.cat([r["dx"][step] for r in ranks])
        torch.testing.assert_close(
            y, expected["y"][step], **tol, msg=lambda m: f"{case['name']} output step {step}: {m}"
        )
        torch.testing.assert_close(dx, expected["dx"][step], **tol, msg=lambda m: f"{case['name']} input grad: {m}")
    for name in ("weight_grad", "bias_grad"):
        if expected[name] is None:
            assert all(r[name] is None for r in ranks)
            continue
        summed = sum(r[name] for r in ranks)
        scale = max(1.0, expected[name].abs().max().item())
        torch.testing.assert_close(
            summed,
            expected[name],
            rtol=tol["rtol"],
            atol=tol["atol"] * scale,
            msg=lambda m: f"{case['name']} {name}: {m}",
        )
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        for rank, result in enumerate(ranks):
            if expected[name] is None:
                assert result[name] is None
                continue
            torch.testing.assert_close(
                result[name], expected[name], **tol, msg=lambda m: f"{case['name']} {name} on rank {rank}: {m}"
            )
    assert all(r["layout_kept"] for r in ranks), f"{case['name']}: channels_last layout not kept"


@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_matches_plain_bn_on_whole_batch(world_size):
    per_rank = run_world(world_size, sync_rank, CASES, timeout=270)
    for index, case in enumerate(CASES):
        _compare(case, [per_rank[rank][index] for rank in range(world_size)], reference(case))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fused_kernel_path_matches_plain_bn():
    """Two gloo ranks on CUDA tensors (NCCL refuses two ranks on one GPU) exercise the CUDA path
    (device_path.py), every case including the bfloat16 and half ones."""
    cases = [dict(c, device="cuda") for c in CASES]
    per_rank = run_world(2, sync_rank, cases, timeout=120)
    for index, case in enumerate(cases):
        _compare(dict(case, loose=True), [per_rank[rank][index] for rank in range(2)], reference(case))


def test_process_group_subgroups_sync_only_within_their_pair():
    case = {"name": "pairs", "shape": (8, 5, 4, 3), "splits": {2: [3, 5]}}
    results = run_world(4, subgroup_rank, case, timeout=240)
    for pair in (0, 1):
        _compare(dict(case, name=f"pair {pair}"), results[2 * pair : 2 * pair + 2], reference(pair_variant(case, pair)))


def test_variance_is_exact_when_mean_dwarfs_std():
    """Chan merge: mean 1e4, std 1 gives the right variance (E[x^2]-E[x]^2 would not)."""
    from bnsurgeon.runtime.sync_function import merge_stats

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1000, generator=generator, dtype=torch.float64) + 1e4
    rows = []
    for part in x:
        rows.append(
            torch.cat(
                [
                    torch.tensor([part.numel()], dtype=torch.float64),
                    part.mean().view(1),
                    part.var(unbiased=False).view(1),
                ]
            )
        )
    gathered = torch.stack(rows).float()
    total, mean, var = merge_stats(gathered, 1)
    true_var = x.flatten().var(unbiased=False).item()
    assert total.item() == 4000
    assert abs(var.item() - true_var) / true_var < 1e-5
    naive = (gathered[:, 0] * (gathered[:, 2] + gathered[:, 1] ** 2)).sum() / 4000 - mean**2
    assert abs(naive.item() - true_var) / true_var > 1e-2, "the naive formula should fail this case"


@pytest.mark.parametrize("layout", ["planar", "planar_3d", "channels_last", "2d"])
def test_local_stats_are_exact_when_mean_dwarfs_std(layout):
    """CPU local statistics against float64 with |mean| up to 5e4 x std.

    NCHW-contiguous inputs take the centred two-pass path, which must be exact to float32
    rounding. Channels-last and (N, C) inputs use torch's own vectorized kernel, the one
    native BN uses: its mean is rounded in float32 before the second pass, so it may be
    off by (mean error / std)^2 (~1e-4 here), but never catastrophically.
    """
    from bnsurgeon.runtime.kernels import GenericKernels

    generator = torch.Generator().manual_seed(1)
    shape = {"planar": (6, 5, 7, 9), "channels_last": (6, 5, 7, 9), "2d": (300, 5), "planar_3d": (4, 5, 80)}[layout]
    x = torch.randn(shape, generator=generator) + 1e4 * torch.arange(1, 6).view((1, 5) + (1,) * (len(shape) - 2))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    mean, var, centred = GenericKernels.local_stats(x)
    planar = layout.startswith("planar")
    assert (centred is not None) == planar
    dims = [0, *range(2, x.dim())]
    exact = x.double()
    true_mean, true_var = exact.mean(dims), exact.var(dims, unbiased=False)
    assert torch.allclose(mean.double(), true_mean, rtol=1e-6, atol=0)  # float32 ulp is 6e-8
    var_error = ((var.double() - true_var).abs() / true_var).max().item()
    assert var_error < (1e-5 if planar else 1e-3)


@pytest.mark.parametrize("total", [0, 1, 37])
def test_device_count_path_matches_host_count_path(total):
    """The CUDA path keeps the global count on the device (no host sync); CPU reads it on the host.

    Both branches of the running-stat update and of the generic input gradient must agree,
    including an empty global batch (statistics untouched) and a single sample.
    """
    from bnsurgeon.runtime.kernels import GenericKernels
    from bnsurgeon.runtime.sync_function import update_running_stats

    generator = torch.Generator().manual_seed(2)
    mean, var = torch.randn(4, generator=generator), torch.rand(4, generator=generator) + 0.5
    buffers = {}
    for kind, count in (("host", total), ("device", torch.tensor([float(total)]))):
        running_mean, running_var = torch.zeros(4), torch.ones(4)
        update_running_stats(running_mean, running_var, mean, var, count, 0.1)
        buffers[kind] = (running_mean, running_var)
    torch.testing.assert_close(buffers["host"], buffers["device"], rtol=0, atol=0)
    if total == 0:
        assert torch.equal(buffers["host"][0], torch.zeros(4)) and torch.equal(buffers["host"][1], torch.ones(4))

    x, dy = torch.randn(3, 4, 5, generator=generator), torch.randn(3, 4, 5, generator=generator)
    weight, invstd = torch.rand(4, generator=generator) + 0.5, torch.rsqrt(var + 1e-5)
    sums = torch.randn(4, generator=generator), torch.randn(4, generator=generator)
    host = GenericKernels.grad_input(dy, x, weight, mean, var, invstd, 1e-5, *sums, total)
    device = GenericKernels.grad_input(dy, x, weight, mean, var, invstd, 1e-5, *sums, torch.tensor([float(total)]))
    torch.testing.assert_close(host, device, rtol=1e-6, atol=1e-6)
