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
    if "forkserver" in mp.get_all_start_methods():
        assert multiproc.forked_context().get_start_method() == "forkserver"


INTERRUPTED_POOL = """
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with Ctrl-C ignored
sys.path.insert(0, {tests!r})
from pathlib import Path
from _rank_probe import environment_and_modules, sleeping
from bnsurgeon.checks.multiproc import RankPool

def interrupt_the_group():  # what Ctrl-C in a terminal does: SIGINT to every process of the group
    while not Path({marker!r}).exists():
        time.sleep(0.05)
    os.killpg(os.getpgid(0), signal.SIGINT)

if __name__ == "__main__":
    try:
        with RankPool(3) as pool:
            seen = pool.run(3, environment_and_modules, "X", timeout=120)  # every rank up and running
            assert all(r[1] for r in seen), "timm not preloaded"
            threading.Thread(target=interrupt_the_group, daemon=True).start()
            pool.run(2, sleeping, 60.0, {marker!r}, timeout=120)  # two ranks busy, one waiting for work
    except KeyboardInterrupt:  # the pool is closed by now: its ranks stopped
        print(f"interrupted; stopped {{time.time() - os.path.getmtime({marker!r}):.1f}} s after the task began")
"""


def test_a_pool_in_a_users_directory_never_imports_from_it_and_stops_at_once_on_ctrl_c(tmp_path):
    """The fork server runs as ``python -c``: started naively, the working directory comes first on its path,
    so a ``timm.py`` where the user runs verify would be every rank's timm. And Ctrl-C reaches the ranks too:
    they leave the stopping to the parent, which kills them at once, so the user sees the command's one line,
    not a KeyboardInterrupt traceback from every rank."""
    import subprocess
    import sys
    from pathlib import Path

    marker, shadowed = tmp_path / "began", tmp_path / "shadow-imported"
    (tmp_path / "timm.py").write_text(f"open({str(shadowed)!r}, 'w').close()\n")
    script = INTERRUPTED_POOL.format(tests=str(Path(__file__).parent), marker=str(marker))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        start_new_session=True,
    )
    assert not shadowed.exists(), "a rank imported timm.py from the working directory"
    assert done.returncode == 0 and "interrupted" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    seconds = float(done.stdout.split("stopped ")[1].split(" s")[0])
    assert seconds < 8, done.stdout  # not the task's 60 s, nor 10 s of waiting per rank
