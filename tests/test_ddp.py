"""A converted timm model trains under DDP exactly like one process on the whole batch,
and a rank that skips a layer fails fast instead of hanging."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _ddp_cases import SPLIT, ddp_rank, only_bn_trains, skip_layer_rank, tiny_timm_model, train
from _dist import run_world, torchrun

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]


def test_ddp_three_sgd_steps_match_single_process_full_batch():
    ranks = run_world(2, ddp_rank, timeout=270)
    reference = train(only_bn_trains(tiny_timm_model()), slice(None), 1.0 / sum(SPLIT)).state_dict()
    for name, expected in reference.items():
        for rank, state in enumerate(ranks):
            torch.testing.assert_close(
                state[name], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} on rank {rank}: {m}"
            )
    assert any("bn" in name and "running_var" in name for name in reference)


def test_skipped_layer_is_named_with_debug_switch():
    results = run_world(2, skip_layer_rank, True, timeout=120)  # named before any timeout: the group's is the run's
    for text in results:
        assert "DistributedMismatchError" in text, text
        assert "'0' forward call 1 (4 channels" in text and "'2' forward call 1 (6 channels" in text, text


def test_skipped_layer_without_debug_fails_within_timeout_instead_of_hanging():
    started = time.monotonic()
    results = run_world(2, skip_layer_rank, False, timeout=120, collective_timeout=5, allow_errors=True)
    assert time.monotonic() - started < 100
    # gloo either raises in both ranks or aborts the process on the size mismatch: both end, neither hangs
    assert any(status != "ok" or value != "no error" for status, value in results), results


def test_train_ddp_script_under_torchrun(tmp_path):
    from bnsurgeon.api import convert_source

    checkpoint = tmp_path / "b0.sync.safetensors"
    convert_source("efficientnet_b0", checkpoint, model_args={"num_classes": 4})
    env = dict(os.environ, OMP_NUM_THREADS="1", BNSURGEON_DIST_TIMEOUT="200")  # a hang detector, under the 240 s
    command = torchrun(
        str(ROOT / "scripts" / "train_ddp.py"), str(checkpoint), "--steps", "2", "--batch", "2", "--size", "32"
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 1: loss" in done.stdout
    assert "running stats identical across 2 ranks: True" in done.stdout
