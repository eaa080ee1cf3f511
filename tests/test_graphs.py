"""The sync layer under torch.compile(fullgraph=True) and under activation checkpointing,
on 2 gloo ranks, against one process of plain BN on the whole batch (float64, 1e-6).

timm's ``test_efficientnet`` has 13 BatchNormAct2d with in-place SiLU: the model torch's
own SyncBatchNorm cannot compile without graph breaks, and the in-place activation after a
graph break is what failed in backward before the sync layer became a custom op.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_world
from _graph_cases import STEPS, checkpoint_rank, compile_rank, reference

pytestmark = pytest.mark.distributed

MODES = ["none", "reentrant", "non-reentrant", "timm", "reentrant-unrecognised"]
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _assert_state(state: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


@pytest.fixture(scope="module")
def expected() -> dict:
    return reference()


@pytest.fixture(scope="module")
def checkpointed() -> list[dict]:
    return run_world(2, checkpoint_rank, MODES, timeout=270)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_training_equals_plain_bn_with_one_update_and_two_collectives_per_layer(
    checkpointed, expected, mode
):
    """Recompute reuses the original statistics: 2 collectives per layer per step (not 3),
    num_batches_tracked counts optimizer steps, outputs and gradients as without checkpointing.
    An unrecognised recompute (the stash cannot serve it) synchronizes again (one more
    collective per recompute) and is still exact, with the running statistics updated once."""
    for rank, results in enumerate(checkpointed):
        result = results[mode]
        _assert_state(result["state"], expected, f"{mode} rank {rank}")
        counters = [v for k, v in result["state"].items() if k.endswith("num_batches_tracked")]
        assert counters and all(int(c) == STEPS for c in counters), f"{mode}: num_batches_tracked {counters}"
        assert (result["recomputes"] > 0) == (mode != "none"), (mode, result["recomputes"])
        fallbacks = result["recomputes"] if mode.endswith("-unrecognised") else 0
        assert result["collectives"] == result["layers"] * 2 * STEPS + fallbacks, (
            mode,
            result["collectives"],
            fallbacks,
        )


def test_fullgraph_compile_has_no_graph_break_and_trains_like_plain_bn(expected):
    """torch.compile(fullgraph=True) in train mode under a process group (aot_eager, as CI
    affords): 0 graph breaks in dynamo's explanation of the whole converted timm model, and two
    compiled SGD steps (in-place SiLU after every sync layer) equal plain BN on the whole batch,
    with one collective per layer each way (the compiled graph recomputes no sync op)."""
    for rank, result in enumerate(run_world(2, compile_rank, "aot_eager", timeout=270)):
        assert result["breaks"] == 0 and result["graphs"] == 1, result["reasons"]
        _assert_state(result["state"], expected, f"compiled rank {rank}")
        assert result["collectives"] == result["layers"] * 2 * STEPS, result["collectives"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_fullgraph_compile_and_checkpointing_match_plain_bn(expected, device, backend):
    """The same on CUDA tensors (2 gloo ranks, the fused kernels; NCCL refuses two ranks on one
    GPU): fullgraph compile with 0 breaks, and checkpointing with 2 collectives per layer per step plus
    one per recompute (a device layer stashes nothing: recompute.py). Bounded at 150 + 90 s, inside
    pytest's 300 s per test."""
    for rank, result in enumerate(run_world(2, compile_rank, backend, device, timeout=150)):
        assert result["breaks"] == 0 and result["graphs"] == 1, result["reasons"]
        _assert_state(result["state"], expected, f"compiled ({backend}) cuda rank {rank}")
    modes = ["reentrant", "non-reentrant", "timm"]
    for rank, results in enumerate(run_world(2, checkpoint_rank, modes, device, timeout=90)):
        for mode in modes:
            _assert_state(results[mode]["state"], expected, f"{mode} cuda rank {rank}")
            result = results[mode]
            assert result["recomputes"] > 0, (mode, result["recomputes"])
            assert result["collectives"] == result["layers"] * 2 * STEPS + result["recomputes"], (
                mode,
                result["collectives"],
                result["recomputes"],
            )


def _max_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    return (value.double() - truth.double()).abs().max().item() if value.numel() else 0.0


def test_compiled_layer_equals_the_eager_layer_for_every_input_kind():
    """The compiled path's traced statistics, normalization and gradients (runtime/sync_op.py)
    against the eager layer's kernels, on 2 gloo ranks, two steps each: 1d/2d/3d inputs,
    channels_last, no affine, cumulative momentum, no running stats, a rank with an empty
    batch, |mean| >> std in float32, a bf16 model, and autocast. float64 cases agree to 1e-9;
    below float64, the compiled result is no further from the float64 truth than twice the
    eager layer's error plus a few units of the dtype's rounding."""
    from _compiled_cases import CASES, compiled_vs_eager_rank

    for rank, per_case in enumerate(run_world(2, compiled_vs_eager_rank, list(CASES), timeout=270)):
        for case, (eager, compiled, truth) in per_case.items():
            for step, (want, got) in enumerate(zip(eager, compiled)):
                assert want.keys() == got.keys(), (case, want.keys(), got.keys())
                for name, value in want.items():
                    what = f"{case}, rank {rank}, step {step}, {name}"
                    if not value.is_floating_point():  # num_batches_tracked
                        assert torch.equal(got[name], value), (what, got[name], value)
                        continue
                    if truth is None:
                        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")
                        continue
                    exact = truth[step][name]
                    rounding = (
                        4 * torch.finfo(value.dtype).eps * max(exact.abs().max().item() if exact.numel() else 0, 1)
                    )
                    compiled_error, eager_error = _max_error(got[name], exact), _max_error(value, exact)
                    assert compiled_error <= 2 * eager_error + rounding, (what, compiled_error, eager_error, rounding)


def test_rank_with_an_empty_batch_keeps_its_collectives_under_inductor():
    """A rank whose batch is empty must still issue every collective, in order. Traced, its
    statistics and gradients are zero-element tensors with no data dependency, and inductor
    dropped its backward sum (the other rank then waited for it); the layer now runs eagerly
    for an empty batch (a graph break) and matches the eager layer on both ranks."""
    from _compiled_cases import compiled_vs_eager_rank

    results = run_world(2, compiled_vs_eager_rank, ["empty-rank"], "inductor", timeout=270)
    for rank, per_case in enumerate(results):
        eager, compiled, _ = per_case["empty-rank"]
        for step, (want, got) in enumerate(zip(eager, compiled)):
            for name, value in want.items():
                torch.testing.assert_close(
                    got[name], value, rtol=1e-9, atol=1e-9, msg=lambda m: f"rank {rank}, step {step}, {name}: {m}"
                )


def test_compiled_and_checkpointed_training_is_exact_with_one_update_per_step(expected):
    """torch.compile over timm's grad checkpointing: AOTAutograd recomputes the checkpointed sync
    layers in the compiled backward. A compiled recompute synchronizes again on every rank
    alike (its traced statistics need not match the original bit for bit, so nothing is
    stashed): exact, running statistics updated once per step, one more collective per
    recomputed layer and step."""
    from _graph_cases import compile_checkpoint_rank

    for rank, result in enumerate(run_world(2, compile_checkpoint_rank, "aot_eager", timeout=270)):
        _assert_state(result["state"], expected, f"compiled checkpointed rank {rank}")
        counters = [v for k, v in result["state"].items() if k.endswith("num_batches_tracked")]
        assert counters and all(int(c) == STEPS for c in counters), counters
        recomputed = result["checkpointed layers"] * STEPS
        assert result["collectives"] == result["layers"] * 2 * STEPS + recomputed, (result["collectives"], recomputed)


def test_compiled_layer_with_dynamic_shapes_equals_the_eager_layer():
    """``torch.compile(dynamic=True)`` (what torch switches to after a shape change, as in
    detection training): batch and image sizes change every step and differ between ranks;
    the compiled layer (aot_eager) matches the eager one in float64. Inductor is not run here:
    in torch 2.14.1 it fails on conv + BN under dynamic shapes with plain BN as well."""
    from _compiled_cases import dynamic_shapes_rank

    worst = run_world(2, dynamic_shapes_rank, timeout=270)
    assert max(worst) < 1e-9, worst
