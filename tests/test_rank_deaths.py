"""However a rank dies, the rank harness (``checks.multiproc``) turns it into one error, soon, and the
process then exits: a rank killed (SIGKILL, as the out-of-memory killer does) before, while or after it
reads a task, while the parent is still writing a large task to it, right after it starts, while the
other rank waits for it; a rank that runs out of open files, or aborts under a low open-file limit; a
limit too low to start; processes the machine refuses to start; the fork server killed. The machine's
doing is a ``HostFailureError`` (exit 16) naming the rank and the cause, not a failed check; and verify
says so in one line.

The scenarios run in one fresh interpreter, as ``bnsurgeon verify`` does, because the hang this guards
against came at interpreter exit (a task pickled into a dead rank's queue, the queue's feeder thread
joined at exit); every scenario's test fails when that process does not exit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

TESTS = Path(__file__).parent
#: idle, all scenarios take about 15 s together; a hang detector sized for a loaded 2-core machine
SCRIPT_TIMEOUT_S = 240
#: each scenario ends in 1-3 s idle; what it must never wait for is a 600 s collective or a 300 s task
SCENARIO_S = 60

SCENARIOS = """
import errno, json, os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
from _rank_probe import (aborted, environment_and_modules, killed_after_its_result, killed_in_a_collective,
                         killed_while_the_other_works, out_of_open_files, stopped_in_a_collective)
from bnsurgeon.checks import multiproc
from bnsurgeon.checks.multiproc import RankPool, run_world

def alive(pid):  # a zombie is not running: an orphaned rank's is reaped by whoever adopted it, when it does
    return multiproc.running(pid)

def scenario(name, body):
    started, pids, outcome = time.monotonic(), [], {{"error": None, "message": ""}}
    try:
        outcome["value"] = repr(body(pids))
    except Exception as error:
        outcome = {{"error": type(error).__name__, "message": str(error)}}
    outcome.update(name=name, seconds=time.monotonic() - started, left=[p for p in pids if alive(p)])
    print(json.dumps(outcome), flush=True)

def pool_pids(pool, pids):
    pids.extend(pool.pids)

def killed_idle(pids):  # before it receives a task; the task is larger than a pipe holds
    with RankPool(2) as pool:
        pool_pids(pool, pids)
        pool.run(2, environment_and_modules, "X")
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.5)
        return pool.run(2, environment_and_modules, "X" * 4_000_000)

def killed_receiving(pids):  # while the parent writes it a 64 MB task: stopped, then killed mid-write
    with RankPool(2) as pool:
        pool_pids(pool, pids)
        pool.run(2, environment_and_modules, "X")
        os.kill(pids[1], signal.SIGSTOP)
        threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
        return pool.run(2, environment_and_modules, "X" * 64_000_000)

def killed_running(pids):  # while the other rank waits for it in a collective with a 600 s timeout
    with RankPool(2, collective_timeout=600) as pool:
        pool_pids(pool, pids)
        return pool.run(2, killed_in_a_collective)

def killed_after(pids):  # after it reported its result: the next task learns of it
    with RankPool(2) as pool:
        pool_pids(pool, pids)
        first = pool.run(2, killed_after_its_result)
        time.sleep(1.0)
        assert first == [0, 1], first
        return pool.run(2, environment_and_modules, "X")

def killed_starting(pids):  # the moment it has started, before its prologue is done
    with RankPool(2) as pool:
        pool_pids(pool, pids)
        os.kill(pids[1], signal.SIGKILL)
        return pool.run(2, environment_and_modules, "X")

def out_of_files(pids):  # ulimit -n reached in rank 0 while rank 1 waits on its store
    with RankPool(2, collective_timeout=600) as pool:
        pool_pids(pool, pids)
        return pool.run(2, out_of_open_files)

def start_refused(pids):  # the machine refuses the processes (EAGAIN: too many processes)
    def refuse(processes, stopped_bound):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    real, multiproc.start_ranks = multiproc.start_ranks, refuse
    try:
        return RankPool(2)
    finally:
        multiproc.start_ranks = real

def with_open_files(limit, body):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        return body()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

def too_few_files(pids):  # ulimit -n 20 and 3 ranks: refused before any process starts, no traceback
    return with_open_files(20, lambda: RankPool(3))

def aborted_few_files(pids):  # a rank aborts (as gloo does on EMFILE, from a thread) under ulimit -n 48
    def body():
        with RankPool(2) as pool:
            pool_pids(pool, pids)
            return pool.run(2, aborted)
    return with_open_files(48, body)

def aborted_plainly(pids):  # the same abort with the usual limit: a crash, a failed check, not the machine
    with RankPool(2) as pool:
        pool_pids(pool, pids)
        return pool.run(2, aborted)

def server_killed(pids):  # the fork server (400 MB: a likely victim of the out-of-memory killer) dies
    import multiprocessing.forkserver as forkserver
    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
    time.sleep(0.5)
    with RankPool(2) as pool:  # started again, on our terms: the timm.py in this directory is not imported
        pool_pids(pool, pids)
        return pool.run(2, environment_and_modules, "X")[0][1]

def server_killed_under_ranks(pids):  # the fork server dies while its ranks live: they cannot be watched any more
    import multiprocessing.forkserver as forkserver
    with RankPool(2) as pool:
        pool_pids(pool, pids)
        pool.run(2, environment_and_modules, "X")
        os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
        time.sleep(multiproc.LAST_RESULT_S + 1.0)  # their status pipes closed: seen as ended, exit 255
        pool.run(2, environment_and_modules, "X")  # they still run: the check goes on (was: a failed check)
        os.kill(pids[1], signal.SIGKILL)  # and one dies with no server to say how: the machine's doing
        return pool.run(2, environment_and_modules, "X")

def stopped_running(pids):  # SIGSTOP (a debugger, a cgroup freezer) while the other waits; the run's timeout is 5 s
    with RankPool(2, collective_timeout=5) as pool:
        pool_pids(pool, pids)
        return pool.run(2, stopped_in_a_collective, timeout=300)

def killed_while_other_busy(pids):  # run_world: rank 0 busy for 300 s, rank 1 killed: do not wait for rank 0
    return run_world(2, killed_while_the_other_works, 300.0, timeout=400)

def server_stopped_under_ranks(pids):  # the fork server stopped (SIGSTOP) once the ranks ran: neither the pool's
    with RankPool(2) as pool:            # close nor the interpreter's exit waits for the exit statuses it relays
        pool_pids(pool, pids)
        pool.run(2, environment_and_modules, "X")
        server = multiproc.fork_server_pid()
        os.kill(server, signal.SIGSTOP)
        while not multiproc.stopped(server):  # a signal takes effect a moment after it is sent
            time.sleep(0.01)
        closing = time.monotonic()
    return round(time.monotonic() - closing, 1)

if __name__ == "__main__":
    for name, body in list(globals().items()):
        if name in {names}:
            scenario(name, body)
    print("exiting", flush=True)
"""
NAMES = [
    "killed_idle",
    "killed_receiving",
    "killed_running",
    "killed_after",
    "killed_starting",
    "out_of_files",
    "start_refused",
    "too_few_files",
    "aborted_few_files",
    "aborted_plainly",
    "server_killed",
    "server_killed_under_ranks",
    "killed_while_other_busy",
    "stopped_running",
    "server_stopped_under_ranks",
]


@pytest.fixture(scope="module")
def deaths(tmp_path_factory) -> dict:
    """Run in a directory holding a ``timm.py`` that no rank or fork server may import."""
    work = tmp_path_factory.mktemp("deaths")
    shadowed = work / "shadow-imported"
    (work / "timm.py").write_text(f"open({str(shadowed)!r}, 'w').close()\n")
    script = SCENARIOS.format(tests=str(TESTS), names=set(NAMES))
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=work
        )
        stdout, stderr, exited = done.stdout, done.stderr, done.returncode == 0 and "exiting" in done.stdout
    except subprocess.TimeoutExpired as hung:
        stdout, stderr, exited = _text(hung.stdout), _text(hung.stderr), False
    outcomes = {o["name"]: o for o in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}
    return {"outcomes": outcomes, "stderr": stderr, "exited": exited, "stdout": stdout, "shadowed": shadowed.exists()}


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _outcome(deaths: dict, name: str) -> dict:
    assert name in deaths["outcomes"], f"{name} never finished: {deaths['stdout'][-2000:]}{deaths['stderr'][-2000:]}"
    assert deaths["exited"], f"the process did not exit after its scenarios: {deaths['stderr'][-2000:]}"
    outcome = deaths["outcomes"][name]
    assert outcome["seconds"] < SCENARIO_S, outcome
    assert outcome["left"] == [], f"rank processes left running: {outcome}"
    return outcome


@pytest.mark.parametrize(
    "name",
    ["killed_idle", "killed_receiving", "killed_running", "killed_after", "killed_starting", "killed_while_other_busy"],
)
def test_a_killed_rank_is_one_host_failure_naming_it_and_nothing_waits_for_it(deaths, name):
    outcome = _outcome(deaths, name)
    assert outcome["error"] == "HostFailureError", outcome
    assert outcome["message"].startswith("rank 1 was killed by SIGKILL (out of memory?)"), outcome


def test_a_rank_out_of_open_files_is_a_host_failure_and_the_waiting_rank_prints_no_stack(deaths):
    outcome = _outcome(deaths, "out_of_files")
    assert outcome["error"] == "HostFailureError", outcome
    assert outcome["message"].startswith("rank 0 hit the limit on open files (ulimit -n 3)"), outcome
    assert "Too many open files" in outcome["message"] and "\n" not in outcome["message"], outcome
    assert "frame #" not in deaths["stderr"] and "Traceback" not in deaths["stderr"], deaths["stderr"][-3000:]


def test_a_stopped_rank_is_named_after_the_runs_timeout_not_the_tasks(deaths):
    """SIGSTOP on a rank while its peer waits: named as the machine's doing (exit 16 in verify) once the run's
    timeout (the group's, BNSURGEON_DIST_TIMEOUT in verify) has passed, not a failed check after the task's 300 s;
    the stopped process is killed, and the waiting rank prints no C++ stack (was: one per store retry)."""
    outcome = _outcome(deaths, "stopped_running")
    assert outcome["error"] == "HostFailureError", outcome
    assert outcome["message"].startswith("rank 1 (pid "), outcome
    assert "was stopped for" in outcome["message"] and outcome["seconds"] < 30, outcome
    assert "frame #" not in deaths["stderr"], deaths["stderr"][-3000:]


def test_processes_the_machine_refuses_are_a_host_failure(deaths):
    outcome = _outcome(deaths, "start_refused")
    assert outcome["error"] == "HostFailureError", outcome
    assert outcome["message"].startswith("the ranks could not be started: "), outcome
    assert "[Errno 11] Resource temporarily unavailable" in outcome["message"], outcome


KILLED = """
import os, signal
import torch
import torch.distributed as dist
from torch import nn


class KilledInRankOne(nn.Module):
    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:  # what the out-of-memory killer does to a rank
            os.kill(os.getpid(), signal.SIGKILL)
        return x


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), KilledInRankOne(), nn.Conv2d(4, 2, 1))
"""


def test_verify_with_a_rank_killed_exits_16_with_one_line_not_a_failed_check(tmp_path, monkeypatch):
    """Finding 5 at the command line: the checks that ran passed; the machine killed a rank. Exit 1 would say
    the outputs differ."""
    from _modules import install_module
    from typer.testing import CliRunner

    from bnsurgeon.cli.commands import app

    install_module(tmp_path, monkeypatch, "killed", KILLED)
    runner = CliRunner()
    converted = tmp_path / "k.sync.safetensors"
    made = runner.invoke(app, ["convert", "killed:build", "-o", str(converted), "--input-shape", "2,3,8,8"])
    assert made.exit_code == 0, made.output
    args = ["verify", "killed:build", str(converted), "--converted-model", "killed:build", "--input-shape", "2,3,8,8"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 16, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 1 was killed by SIGKILL (out of memory?)"], result.output
    assert "fix: nothing was written" in result.output and "Traceback" not in result.output, result.output


def test_a_fork_server_that_died_is_started_again_on_the_same_terms(deaths):
    """multiprocessing starts a dead fork server again by itself, but as plain ``python -c`` in the working
    directory: a ``timm.py`` there would become every rank's timm (the hole that starting it on our terms closed, reopened by a death)."""
    outcome = _outcome(deaths, "server_killed")
    assert outcome["error"] is None and outcome["value"] == "True", outcome  # timm preloaded: the ranks ran
    assert not deaths["shadowed"], "the restarted fork server imported timm.py from the working directory"


def test_an_open_file_limit_too_low_for_the_ranks_is_one_line_before_anything_starts(deaths):
    """Under ulimit -n 24, starting 3 ranks made the fork server itself fail to receive their pipes: its
    traceback, then the error. A limit below what rank 0 needs is refused first."""
    outcome = _outcome(deaths, "too_few_files")
    assert outcome["error"] == "HostFailureError", outcome
    assert outcome["message"].startswith("the open-file limit (ulimit -n 20) is too low for 3 ranks"), outcome


def test_a_rank_that_aborts_under_a_low_open_file_limit_is_said_to_be_out_of_files(deaths):
    """gloo aborts a rank (SIGABRT, from a thread) when it cannot make a socket: under a low limit that is the
    machine's doing; under the usual limit the same abort is a crash, a failed check (RankFailure)."""
    outcome = _outcome(deaths, "aborted_few_files")
    assert outcome["error"] == "HostFailureError", outcome
    # the abort, or (as torch 2.4's gloo does at times) a peer that cannot connect while it goes
    assert re.match(
        r"rank \d (crashed with SIGABRT|lost its peers while connecting) \(out of open files\? ulimit -n "
        r"is 48\)",
        outcome["message"],
    ), outcome
    plain = _outcome(deaths, "aborted_plainly")
    assert plain["error"] == "RankFailure" and plain["message"] == "rank 1 crashed with SIGABRT", plain


def test_a_fork_server_stopped_under_its_ranks_holds_up_neither_the_close_nor_the_exit(deaths):
    """verify printed "all checks passed" and never exited: the pool's close, then multiprocessing's join at
    interpreter exit, waited for exit statuses the stopped server relays. The server is killed at the close."""
    outcome = _outcome(deaths, "server_stopped_under_ranks")
    assert outcome["error"] is None and float(outcome["value"]) < 15.0, outcome


STOPPED_SERVER_START = """
import os, signal, subprocess, threading, time
from bnsurgeon.checks import multiproc
from bnsurgeon.core.errors import HostFailureError, Interrupted

server = subprocess.Popen(["sleep", "600"])
if {stop}:
    os.kill(server.pid, signal.SIGSTOP)
multiproc.fork_server_pid = lambda: server.pid  # the ranks' fork server: stopped, or hung (it answers nothing)

class Waiting:  # a start that waits for the server's answer, as multiprocessing's does
    pid = None
    def start(self):
        threading.Event().wait()

if {interrupt}:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
started = time.monotonic()
try:
    multiproc.start_ranks([Waiting()], {bound})
except (HostFailureError, Interrupted) as error:
    print(type(error).__name__, round(time.monotonic() - started, 1), server.wait(5), error)
"""


@pytest.mark.parametrize("server, interrupt", [("stopped", False), ("stopped", True), ("hung", True)])
def test_a_start_waiting_on_a_stopped_fork_server_is_bounded_and_answers_signals(server, interrupt):
    """The fork server stopped before it forked the ranks: verify hung for good, Ctrl-C and SIGTERM held (the start
    waited in the server's pipe, signals deferred). Now a server stopped for the run's timeout is named and killed
    (exit 16), and a signal meanwhile is answered at once; where the server hangs without being stopped, after a
    few seconds' grace (a start takes milliseconds)."""
    from _forked import run_python

    script = STOPPED_SERVER_START.format(
        stop=server == "stopped", interrupt=interrupt, bound=60.0 if interrupt else 1.0
    )
    done = run_python(script, timeout=60)
    kind, seconds, status, message = done.stdout.split(" ", 3)
    assert status == "-9", done.stdout + done.stderr  # the server that answered nothing was killed
    if interrupt:
        assert kind == "Interrupted" and float(seconds) < (10 if server == "stopped" else 20), done.stdout
    else:
        assert kind == "HostFailureError" and 1.0 <= float(seconds) < 10, done.stdout
        assert "the fork server that starts the ranks (pid" in message and "was stopped for 1 s" in message


@pytest.mark.parametrize("limit, connecting", [(48, True), (1024, True), (None, True), (48, False)])
def test_a_peer_lost_while_the_group_connects_is_out_of_files_only_under_a_low_limit(monkeypatch, limit, connecting):
    """At torch 2.4, a rank under ulimit -n 48 could see its peer go while gloo connected ("Connection closed by
    peer": the peer, out of sockets, said nothing): a failed check, though the machine's limit did it. A peer lost
    once connected is a peer that failed, and says so itself."""
    from bnsurgeon.checks import multiproc

    monkeypatch.setattr(multiproc, "open_file_limit", lambda: limit)
    error = RuntimeError(
        "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
        "by peer [127.0.0.1]:39660"
    )
    cause = multiproc.machine_cause(error, connecting=connecting)
    if limit == 48 and connecting:
        assert cause is not None and cause[0].startswith(
            "lost its peers while connecting (out of open files? ulimit -n is 48): RuntimeError: "
        ), cause
        assert cause[1] == multiproc.FILES_HINT
    else:  # under the usual limit, or once connected, the same words are a crash of the peer, not the machine's
        assert cause is None


def test_a_fork_server_killed_under_its_ranks_is_a_host_failure_not_a_failed_check(deaths):
    """Killed while its ranks lived, the server can no longer report how they end: multiprocessing said exit 255
    for each, which read as a failed check (exit 1, "max |diff| inf" in verify) though they still worked. Now
    they are watched by their pid: the check goes on, a rank that then dies is the machine's doing (exit 16),
    and none is left running."""
    outcome = _outcome(deaths, "server_killed_under_ranks")
    assert outcome["error"] == "HostFailureError", outcome
    assert "rank 1 ended after the fork server that started it was killed" in outcome["message"], outcome
