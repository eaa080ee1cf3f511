"""Never a silent mis-sync, never an endless hang: 2 gloo ranks that disagree about
which layer, call, dtype or batch they are at raise a named error on every rank; a rank
that stays away is a timeout naming the layer, with the user's own process group; plus
the API cases that need a process group (subgroup deepcopy/pickle, DDP-wrapped convert,
no deprecation warning from a synced step)."""

from __future__ import annotations

import time

import pytest
from _dist import run_world
from _missync_cases import SCENARIOS, scenarios_rank, skipped_layer_timeout_rank

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_world(2, scenarios_rank, SCENARIOS, timeout=240)  # the group's timeout: the run's, a hang detector


def _both(outcomes, name) -> list[str]:
    return [outcomes[rank][name] for rank in (0, 1)]


def test_synced_step_emits_no_future_warning(outcomes):
    for text in _both(outcomes, "no_future_warning"):
        assert text == "ok: no warnings", text


@pytest.mark.parametrize("named", [True, False])
def test_layers_taken_in_swapped_order_raise_naming_each_ranks_layer(outcomes, named):
    for text in _both(outcomes, "swapped_layers" if named else "swapped_unnamed_layers"):
        assert text.startswith("DistributedMismatchError"), text
        if named:
            assert "rank 0: 'first' forward call 1" in text and "rank 1: 'second' forward call 1" in text, text
        else:  # built directly, called outside any module: named by what holds them where they are called
            assert "rank 0: 'ModuleDict.first (the 1st layer to synchronize over ranks [0, 1])' forward call 1" in text
            assert "rank 1: 'ModuleDict.second (the 1st layer to synchronize over ranks [0, 1])' forward call 1" in text


def test_extra_train_forward_on_one_rank_raises_instead_of_hanging(outcomes):
    for text in _both(outcomes, "extra_forward"):
        assert text.startswith("DistributedMismatchError"), text
        assert "rank 0: '0' forward call 2" in text and "rank 1: '0' backward call 1" in text, text


def test_input_dtype_mismatch_is_named(outcomes):
    for text in _both(outcomes, "dtype_mismatch"):
        assert text.startswith("DistributedMismatchError"), text
        assert "(4 channels, float32)" in text and "(4 channels, bfloat16)" in text, text


def test_one_value_per_channel_over_the_global_batch_raises_on_every_rank(outcomes):
    for text in _both(outcomes, "one_value_per_channel"):
        assert text.startswith("ValueError: Expected more than 1 value per channel when training"), text


def test_debug_switch_names_a_skipped_last_layer(outcomes):
    for text in _both(outcomes, "debug_skip_last_layer"):
        assert text.startswith("DistributedMismatchError"), text
        assert "rank 0: '2' forward call 1 (6 channels" in text and "rank 1: '0' backward call 1 (4 channels" in text


def test_subgroup_model_deepcopies_sharing_the_group_and_pickles_without_it(outcomes):
    for text in _both(outcomes, "subgroup_deepcopy_and_pickle"):
        assert text.startswith("ok: deepcopy shares the group"), text
        assert "UsageError" in text and "ranks [0, 1]" in text and "process_group=" in text, text


def test_ddp_wrapped_model_copy_conversion_is_refused_with_the_fix(outcomes):
    for text in _both(outcomes, "ddp_wrapped_convert"):
        assert text.startswith("ok: copy refused with [UsageError"), text
        assert "ddp.module" in text and "inplace=True" in text, text


def test_timeout_variable_bounds_the_collective_with_a_users_own_process_group(tmp_path):
    """BNSURGEON_DIST_TIMEOUT (3 s) fires inside a group whose own timeout is 200 s, and is named as the one."""
    started = time.monotonic()
    results = run_world(
        2,
        skipped_layer_timeout_rank,
        "3",
        str(tmp_path / "done"),
        timeout=240,
        collective_timeout=200,
        allow_errors=True,
    )
    assert time.monotonic() - started < 150  # not the group's 200 s
    status, text = results[0]
    assert status == "ok" and text.startswith("DistributedTimeoutError"), results
    seconds = float(text.split(" after ")[1].split(" s")[0])
    assert 2.5 < seconds < 60, text
    assert "'0' forward call 1" in text and "did not complete within 3 s (BNSURGEON_DIST_TIMEOUT)" in text, text


def test_the_process_groups_own_shorter_timeout_is_named_when_it_fires(tmp_path):
    """A user's group made with a 3 s timeout while BNSURGEON_DIST_TIMEOUT is 600 s: gloo's own timeout ends
    the wait, and the error says so instead of claiming 600 s (BNSURGEON_DIST_TIMEOUT) had passed."""
    results = run_world(
        2, skipped_layer_timeout_rank, "600", str(tmp_path / "done"), 3.0, timeout=240, allow_errors=True
    )
    status, text = results[0]
    assert status == "ok" and text.startswith("DistributedTimeoutError"), results
    assert "did not complete within 3 s, the process group's own timeout" in text, text
    assert "BNSURGEON_DIST_TIMEOUT is 600 s" in text and "within 600 s" not in text, text
