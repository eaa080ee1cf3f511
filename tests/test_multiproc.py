"""The rank harness (``checks.multiproc``): ranks fork from a server that has imported torch and
timm once, and still see the parent's environment as it is at the call, not as it was when the
server started."""

from __future__ import annotations

import os

import pytest
from _rank_probe import environment_and_modules

from bnsurgeon.checks.multiproc import RankPool, run_world

pytestmark = pytest.mark.distributed


def test_ranks_start_with_the_heavy_imports_done_and_see_the_environment_of_the_call(monkeypatch):
    name = "BNSURGEON_TEST_PROBE"
    monkeypatch.setenv(name, "first")
    first = run_world(2, environment_and_modules, name, timeout=120)
    monkeypatch.setenv(name, "second")  # after the fork server started: it must still reach the ranks
    second = run_world(2, environment_and_modules, name, timeout=120)
    monkeypatch.delenv(name)
    third = run_world(1, environment_and_modules, name, timeout=120)
    assert [r[0] for r in first] == ["first"] * 2
    assert [r[0] for r in second] == ["second"] * 2
    assert third[0][0] is None
    assert all(r[1] for r in first + second + third), "timm was imported again in a rank instead of preloaded"
    for call in (first, second):  # a process per rank, none of them this one
        assert len({r[2] for r in call}) == 2 and os.getpid() not in {r[2] for r in call}


def test_a_pool_sees_the_environment_it_was_started_with(monkeypatch):
    name = "BNSURGEON_TEST_PROBE"
    monkeypatch.setenv(name, "pool")
    with RankPool(2) as pool:
        monkeypatch.setenv(name, "later")
        results = pool.run(2, environment_and_modules, name, timeout=120)
    assert [r[0] for r in results] == ["pool", "pool"]
    assert all(r[1] for r in results)


def test_without_a_fork_server_ranks_are_spawned(monkeypatch):
    """Windows has no fork server: the harness falls back to spawn instead of failing to start ranks."""
    import torch.multiprocessing as mp

    from bnsurgeon.checks import multiproc

    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])
    assert multiproc.forked_context().get_start_method() == "spawn"
    monkeypatch.undo()
    assert multiproc.forked_context().get_start_method() == "forkserver"
