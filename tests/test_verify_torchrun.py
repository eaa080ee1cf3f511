"""`torchrun --nproc-per-node 2 -m bnsurgeon verify`: each torchrun process is one rank of the check, rank 0
reports, and the result equals `-w 2`'s (same checks, same verdicts, the same tensors blamed). A rank that dies
or stops is exit 16, named; torchrun's restarts, a world of one and a -w that disagrees are refused. Below
float64 the ranks are judged against plain BN's own error, measured in the same run. Every rank's running
statistics are judged, the ranks prove they read the same bytes (exit 4 on every rank where not), and rank 0's
verdict is every rank's exit code, on every node (two torchrun "nodes" on this machine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import free_port, run_world, torchrun
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app

pytestmark = pytest.mark.distributed
CASES = Path(__file__).with_name("_torchrun_verify_cases.py")
SHAPE = "2,3,16,16"
#: one launch: two ranks importing torch on a busy 2-core machine, then the checks (about 10 s idle)
LAUNCH_TIMEOUT = 240
runner = CliRunner()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    shutil.copy(CASES, tmp_path / "tvmodels.py")
    return tmp_path


def _env(work: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "PYTHONPATH", "TORCHELASTIC"))}
    path = os.pathsep.join([str(work), str(CASES.parents[1])])  # the project too, where it is not installed (a GPU box)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    env.update(COLUMNS="200", **extra)
    return env


def _torchrun_verify(work: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = torchrun("-m", "bnsurgeon", "verify", *args)
    return subprocess.run(
        command, cwd=work, env=env or _env(work), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )


def _local_w2(work: Path, monkeypatch, *args: str) -> dict:
    """The same verify with -w 2 (bnsurgeon's own gloo ranks), in this process: its JSON document."""
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    sys.modules.pop("tvmodels", None)
    result = runner.invoke(app, ["verify", *args, "-w", "2", "--json", "-q"], env={"COLUMNS": "200"})
    return json.loads(result.stdout)


def _verdicts(document: dict) -> list:
    """Each check's name, verdict and what it blames (the tensors that differ, the first divergent module)."""
    return [
        (c["name"], c["passed"], re.findall(r"differs: (.*)$", c["detail"]), c["first_divergence"])
        for c in document["checks"]
    ]


def test_a_timm_model_against_its_checkpoint_equals_the_local_check(work, monkeypatch):
    """SOURCE a timm name, CONVERTED a checkpoint file, --json: rank 0 prints the one document (same schema),
    the same checks and verdicts as -w 2, both within float64 round-off."""
    out = work / "m.safetensors"
    assert runner.invoke(app, ["convert", "mobilenetv3_small_050", "-o", str(out), "-q"]).exit_code == 0
    args = ("timm:mobilenetv3_small_050", str(out), "--input-shape", "2,3,32,32")
    done = _torchrun_verify(work, *args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(done.stdout)  # exactly one JSON document: the other rank printed nothing
    local = _local_w2(work, monkeypatch, *args)
    assert set(document) == set(local) and document["schema_version"] == local["schema_version"]
    assert _verdicts(document) == _verdicts(local)
    assert [c["name"] for c in document["checks"] if "ranks" in c["name"]] == ["2 ranks", "2 ranks (perturbed)"]
    for check in document["checks"]:
        assert check["passed"] is True, check
        if "ranks" in check["name"]:
            assert "float64 on cpu (gloo)" in check["detail"] and check["max_abs_diff"] < 1e-9, check
    assert done.stderr.count("all checks passed") == 1


def test_a_failing_conversion_is_blamed_as_the_local_check_blames_it(work, monkeypatch):
    """SOURCE and CONVERTED factories; one layer of CONVERTED does not synchronize: eval and one process pass, the
    N-rank checks fail on the same tensors as -w 2's (exit 1 from rank 0, so torchrun fails)."""
    args = ("tvmodels:source", "tvmodels:unsynced", "--input-shape", SHAPE)
    done = _torchrun_verify(work, *args, "--json")
    assert done.returncode != 0
    document = json.loads(done.stdout)
    local = _local_w2(work, monkeypatch, *args)
    assert _verdicts(document) == _verdicts(local)
    failed = [c["name"] for c in document["checks"] if c["passed"] is False]
    assert failed == ["2 ranks", "2 ranks (perturbed)"], document
    assert "grad 4.weight" in document["checks"][-1]["detail"] or "output of sample" in document["checks"][-1]["detail"]
    assert "2 ranks failed" in done.stderr


def test_a_killed_rank_is_the_machines_fault_exit_16_named(work):
    done = _torchrun_verify(
        work, "tvmodels:source", "tvmodels:killed_on_rank_1",
        "--input-shape", SHAPE, "--json",
    )  # fmt: skip
    assert done.returncode != 0
    error = json.loads(done.stdout)["error"]
    assert error["exit_code"] == 16, error
    assert re.match(r"rank 1 \(pid \d+\) died", error["message"]), error
    assert "Traceback" not in done.stderr.split("torch/distributed/elastic")[0]


def test_a_stopped_rank_ends_the_check_after_the_runs_timeout_named(work):
    """SIGSTOP on rank 1: rank 0 waits BNSURGEON_DIST_TIMEOUT (5 s), then names it, kills it, exit 16."""
    done = _torchrun_verify(
        work, "tvmodels:source", "tvmodels:stopped_on_rank_1",
        "--input-shape", SHAPE, "--json",
        env=_env(work, BNSURGEON_DIST_TIMEOUT="5"),
    )  # fmt: skip
    error = json.loads(done.stdout)["error"]
    assert error["exit_code"] == 16 and "was stopped" in error["message"] and "(5 s)" in error["message"], error


def test_a_failure_on_one_rank_or_every_rank_is_said_once_and_a_hang_is_named(work):
    """A factory failing on rank 1 alone: rank 1 says why, rank 0 stops at once with its exit code and writes the
    one JSON document; failing on every rank: said once; a rank hanging in its share: named by rank 0 after the
    run's timeout, exit 1 (a failed check, as -w N's bound makes it), not a silent wait or an internal error."""
    import time

    env = _env(work, BNSURGEON_DIST_TIMEOUT="5")
    started = time.monotonic()
    one = _torchrun_verify(work, "tvmodels:source", "tvmodels:raises_on_rank_1", "--json", env=env)
    assert time.monotonic() - started < 60, one.stderr[-2000:]
    error = json.loads(one.stdout)["error"]
    assert error["exit_code"] == 2 and "rank 1 stopped before the check" in error["message"], error
    # rank 1's own words: its fix kept, no class name of bnsurgeon's before its message
    assert error["message"].startswith("rank 1 stopped before the check: factory 'tvmodels:raises_on_rank_1'"), error
    assert error["fix"] == "fix the factory or its --model-arg values", error
    assert one.stderr.count("error:") == 1 and "boom on rank 1" in one.stderr, one.stderr[-2000:]
    every = _torchrun_verify(work, "tvmodels:source", "tvmodels:always_raises", "--json", env=env)
    assert json.loads(every.stdout)["error"]["exit_code"] == 2
    assert every.stderr.count("boom everywhere") == 1, every.stderr[-2000:]
    hang = _torchrun_verify(work, "tvmodels:source", "tvmodels:hangs_on_rank_1", "--json", env=env)
    error = json.loads(hang.stdout)["error"]
    assert error["exit_code"] == 1 and re.match(r"rank 1 \(pid \d+\) did not answer", error["message"]), error
    assert "internal error" not in hang.stderr and hang.stderr.count("error:") == 1, hang.stderr[-2000:]


@pytest.mark.parametrize(
    ("env", "args", "says"),
    [
        ({"TORCHELASTIC_MAX_RESTARTS": "3"}, [], "torchrun --max-restarts 3"),
        ({"WORLD_SIZE": "1", "RANK": "0"}, [], "torchrun started 1"),
        ({}, ["-w", "3"], "-w 3 under torchrun, which started 2 ranks"),
        ({}, ["-w", "2", "-w", "3"], "-w 2 -w 3 under torchrun"),
    ],
    ids=["restarts", "world-of-one", "other-world", "two-worlds"],
)
def test_torchrun_refusals_are_one_line_from_rank_0_only(work, env, args, says):
    """Refused before any file is read or any process group starts: rank 0 says it once, exit 2; the other
    ranks and torchrun's restarts exit 2 silently."""
    base = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "t", "COLUMNS": "300", **env}
    verify = ["verify", "tvmodels:source", "tvmodels:source", "--input-shape", SHAPE, *args]
    said = runner.invoke(app, verify, env=base)
    assert said.exit_code == 2 and says in said.output and said.output.count("error:") == 1, said.output
    for quiet in ({"RANK": "1"}, {"TORCHELASTIC_RESTART_COUNT": "1"}):
        silent = runner.invoke(app, verify, env={**base, **quiet})
        assert silent.exit_code == 2 and silent.output == "", silent.output


@pytest.mark.parametrize("flag", [["--precision", "float32"], ["--device", "cuda"]])
def test_device_and_precision_need_torchrun(flag):
    result = runner.invoke(app, ["verify", "resnet18", "resnet18", *flag], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "applies to the check under torchrun" in result.output, result.output


def test_below_float64_the_ranks_are_judged_against_plain_bns_measured_error():
    """float32 and bf16 autocast pass a good conversion and fail one unsynchronized layer; the CUDA branch's glue
    (the strict CPU stand-ins of its kernels) passes in float32 too; float64 is judged as -w N judges it."""
    cases = ["float64 good", "float32 good", "bf16-autocast good", "float32 unsynced", "float32 good standin"]
    results = run_world(2, _measured, cases, timeout=240)[0]
    for case in cases:
        expected = "unsynced" not in case
        assert results[case]["passed"] is expected, (case, results[case])
    assert "within 1e-06 relative" in results["float64 good"]["detail"]
    assert "plain BN's own error in float32" in results["float32 good"]["detail"]
    assert "plain BN's own error in bf16-autocast" in results["bf16-autocast good"]["detail"]
    assert "differs:" in results["float32 unsynced"]["detail"]


def _measured(rank, world_size, cases):
    sys.path.insert(0, str(CASES.parent))
    from _torchrun_verify_cases import measured_rank

    return measured_rank(rank, world_size, cases)


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", ["float64", "float32", "bf16-autocast"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_on_the_gpu(work, device, precision):
    """The real device: 2 ranks on the GPU(s) (sharing one over gloo where there is one: NCCL refuses two ranks on
    one GPU), the fused kernels, the tolerance measured on the device."""
    done = _torchrun_verify(
        work, "tvmodels:source", "tvmodels:unsynced", "--input-shape", SHAPE,
        "--json", "--device", device, "--precision", precision,
    )  # fmt: skip
    unsynced = json.loads(done.stdout)
    good = json.loads(_torchrun_verify(
        work, "tvmodels:source", "tvmodels:converted", "--input-shape", SHAPE, "--json", "--device", device,
        "--precision", precision,
    ).stdout)  # fmt: skip
    ranks = [c for c in good["checks"] if "ranks" in c["name"]]
    assert ranks and all(c["passed"] for c in ranks) and all("on cuda:" in c["detail"] for c in ranks), ranks
    assert [c["passed"] for c in unsynced["checks"] if "ranks" in c["name"]] == [False, False], unsynced


def test_a_script_calling_verify_under_torchrun_keeps_its_own_ranks(work, monkeypatch):
    """Only the command is a torchrun rank: a training script that calls bnsurgeon's verify on rank 0 under
    torchrun gets -w N's own ranks, and its process group is never joined or torn down."""
    import bnsurgeon.checks.torchrun_ranks as torchrun_ranks
    import bnsurgeon.checks.verify as verify_module
    from bnsurgeon import api

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.syspath_prepend(str(work))
    sys.modules.pop("tvmodels", None)
    monkeypatch.setattr(torchrun_ranks, "join_torchrun_world", lambda *a, **k: pytest.fail("joined torchrun's world"))
    seen = {}
    monkeypatch.setattr(verify_module, "verify_models", lambda *a, **k: seen.update(k) or "checked")
    assert api.verify("tvmodels:source", "tvmodels:converted", input_shape=(2, 3, 16, 16)) == "checked"
    assert seen["torchrun"] is None and seen["world_sizes"] == (2,)


def test_a_peers_end_is_read_from_its_process_and_ctrl_c_is_not_the_machines():
    """What rank 0 reads of a peer on its node: killed (SIGKILL) is the machine's, stopped is named, SIGTERM or
    SIGINT (torchrun forwards Ctrl-C and preemption to every rank) is an interruption, and a pid that another
    process took since the rank joined is the rank gone."""
    import signal
    import time

    from bnsurgeon.checks.torchrun_ranks import _process_state, this_process

    def child():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def settled(process, want):
        for _ in range(200):  # the kernel shows the state a moment after the signal
            state = _process_state(process.pid)
            if state is not None and state[0] == want:
                return state
            time.sleep(0.02)
        return _process_state(process.pid)

    processes = [child() for _ in range(4)]
    try:
        killed, stopped, interrupted, running = processes
        killed.send_signal(signal.SIGKILL)
        stopped.send_signal(signal.SIGSTOP)
        interrupted.send_signal(signal.SIGTERM)
        assert settled(killed, "died") == ("died", ": killed by SIGKILL (out of memory?)")
        assert settled(stopped, "was stopped")[0] == "was stopped"
        assert settled(interrupted, "was interrupted") == ("was interrupted", "")
        assert _process_state(running.pid) is None
        assert _process_state(running.pid, b"1") == ("gone", "")  # another process took the pid since
        mine = this_process()
        assert mine[1] == os.getpid() and mine[2] is not None and _process_state(mine[1], mine[3]) is None
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_every_ranks_running_statistics_are_judged(work):
    """Rank 1's CONVERTED holds another running_var (code, so no file digest tells it): its outputs and gradients
    are exact, and its running statistics after the step are not: the N-rank check fails naming rank 1 (rank 0's
    own statistics were all that was judged, so this passed with exit 0)."""
    done = _torchrun_verify(
        work, "tvmodels:source", "tvmodels:stale_statistics_on_rank_1", "--input-shape", SHAPE, "--json"
    )
    document = json.loads(done.stdout)
    verdicts = {c["name"]: c for c in document["checks"]}
    assert verdicts["2 ranks"]["passed"] is False, verdicts["2 ranks"]
    assert "differs: 4.running_var (rank 1)" in verdicts["2 ranks"]["detail"], verdicts["2 ranks"]
    assert verdicts["2 ranks (perturbed)"]["passed"] is True  # perturbing sets every rank's statistics alike
    assert done.returncode != 0


def _convert(work: Path, monkeypatch, *args: str) -> None:
    """``bnsurgeon convert`` in this process, the factories of ``work`` importable."""
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    sys.modules.pop("tvmodels", None)
    made = runner.invoke(app, ["convert", *args, "-q"])
    assert made.exit_code == 0, made.output


def _torchrun_nodes(work: Path, directories: list[Path], *args: str, env: dict | None = None) -> list:
    """``verify`` as a 2-node torchrun job on this machine, one rank per node, node N started in ``directories[N]``
    (a relative CONVERTED is read there): (torchrun's exit status, the rank's own exit code, stdout, stderr) per
    node, as a per-node CI step sees them."""
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "-m",
                "tvmodels",
                "verify",
                *args,
            ],
            cwd=directory,
            env=env or _env(work),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node, directory in enumerate(directories)
    ]
    try:
        outputs = [node.communicate(timeout=LAUNCH_TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    codes = [directory / f"exit-{node}" for node, directory in enumerate(directories)]
    return [
        (node.returncode, int(code.read_text()) if code.exists() else None, *output)
        for node, code, output in zip(nodes, codes, outputs, strict=True)
    ]


def test_ranks_that_read_different_bytes_are_refused_on_every_node(work, monkeypatch):
    """Node 1 started in another directory, where CONVERTED (a relative path) is a stale copy with one running_var
    changed: every rank stops before any check with exit 4, and rank 0 says it once, naming rank 1 and the file
    (each rank judged only by rank 0's statistics passed all checks, exit 0 on both nodes)."""
    first, second = work / "node0", work / "node1"
    first.mkdir()
    second.mkdir()
    good = first / "conv.safetensors"
    _convert(work, monkeypatch, "tvmodels:source", "-o", str(good))
    from _torchrun_verify_cases import save_stale_copy

    save_stale_copy(str(good), str(second / "conv.safetensors"))
    args = ("tvmodels:source", "conv.safetensors", "--input-shape", SHAPE, "--json")
    (status0, code0, out0, err0), (status1, code1, out1, err1) = _torchrun_nodes(work, [first, second], *args)
    assert (code0, code1) == (4, 4), (err0[-2000:], err1[-2000:])
    assert status0 != 0 and status1 != 0
    error = json.loads(out0)["error"]
    assert error["exit_code"] == 4, error
    assert re.match(
        r"rank 1 \(pid \d+\) read other bytes than rank 0 for CONVERTED conv\.safetensors", error["message"]
    )
    assert f"{first / 'conv.safetensors'}, rank 1 {second / 'conv.safetensors'}" in error["message"], error
    assert "sha256sum" in error["fix"], error
    assert out1 == "" and "error:" not in err1 and err0.count("error:") == 1, (err0[-2000:], err1[-2000:])


@pytest.mark.parametrize(
    ("converted", "extra", "code"),
    [("tvmodels:unsynced", [], 1), ("fused.safetensors", ["--compare-at", "0"], 2)],
    ids=["failed-check", "fused-refused-on-rank-0"],
)
def test_rank_0s_verdict_is_every_nodes_exit_code(work, monkeypatch, converted, extra, code):
    """What rank 0 alone decides (the judged N-rank checks, the one-process checks, the fused checks) ends every
    rank with its exit code, so a CI step per node fails on every node (node 1 exited 0)."""
    if converted.endswith(".safetensors"):
        _convert(work, monkeypatch, "tvmodels:source", "--to", "fused", "-o", str(work / converted))
    args = ("tvmodels:source", converted, "--input-shape", SHAPE, *extra)
    nodes = _torchrun_nodes(work, [work, work], *args)
    assert [(status != 0, own) for status, own, _, _ in nodes] == [(True, code), (True, code)], [
        err[-2000:] for *_, err in nodes
    ]
    assert nodes[1][3].count("error:") == 0 and nodes[0][3].count("error:") <= 1, nodes[1][3][-2000:]


def test_a_rank_0_that_dies_while_the_others_wait_for_its_verdict_is_named_exit_16(work):
    """Rank 0 killed (SIGKILL) in the checks it runs alone: rank 1, on another node, waiting for the verdict, names
    it and ends with exit 16 (it had exited 0 before rank 0 even ran them)."""
    args = ("tvmodels:source", "tvmodels:killed_on_rank_0_alone", "--input-shape", SHAPE)
    (_, code0, _, _), (status1, code1, out1, err1) = _torchrun_nodes(work, [work, work], *args)
    assert code0 is None and status1 != 0 and code1 == 16, err1[-2000:]
    assert re.search(r"error: rank 0 \(pid \d+\) died", err1), err1[-2000:]


def test_a_file_mismatch_names_the_ranks_that_differ_and_where_each_read():
    """The first rank that read a file is the yardstick; a rank that could not read it is left to its load (which
    says why); several ranks that differ are listed; the same path on each is said once."""
    from bnsurgeon.checks.torchrun_ranks import TorchrunWorld, files_mismatch

    here = ("this-host", 1000, None, None)
    world = TorchrunWorld(0, 3, torch.device("cpu"), "gloo", None, 5.0, [here, here, here])

    def read(sha256, where="/shared/c.safetensors"):
        return [("SOURCE", "resnet18", "resnet18", None), ("CONVERTED", "c.safetensors", where, sha256)]

    a, b = "a" * 64, "b" * 64
    assert files_mismatch(world, [read(a), read(a), read(a)]) is None
    assert files_mismatch(world, [read(None), read(a), read(a)]) is None  # rank 0's own load says it has none
    one = files_mismatch(world, [read(a), read(a, "/node1/c.safetensors"), read(a)])
    assert one is None  # other paths, the same bytes: a copy on each node is fine
    error = files_mismatch(world, [read(None), read(a), read(b, "/node2/c.safetensors")])
    assert error is not None and error.exit_code == 4
    assert error.message.startswith(
        "rank 2 (pid 1000 on this-host) read other bytes than rank 1 for CONVERTED c.safetensors (sha256 "
        "bbbbbbbbbbbb against aaaaaaaaaaaa; rank 1 read /shared/c.safetensors, rank 2 /node2/c.safetensors)"
    ), error.message
    both = files_mismatch(world, [read(a), read(b), read(b)])
    assert both is not None and both.message.startswith("ranks 1, 2 read other bytes than rank 0"), both.message
    assert "(sha256 bbbbbbbbbbbb against aaaaaaaaaaaa; /shared/c.safetensors on each)" in both.message


def test_leaving_the_group_never_deadlocks_in_gloos_teardown(tmp_path):
    """After the N-rank checks every rank meets and destroys the group. On torch 2.4 a gloo worker that dropped the
    barrier's work last (and the gather it held) waited for the GIL while holding the lock the group's destructor
    takes with the GIL held: about 1 in 40 teardowns hung for good (a rank of a 2-node check never exited). 200
    rounds where that gloo runs (all hang-free 0.6% of the time before the fix); 40 on newer torch, which never hung:
    the same teardown, checked once per suite rather than hunted."""
    rounds = 200 if torch.__version__ < (2, 5) else 40  # TorchVersion compares as versions
    program = f"from _torchrun_verify_cases import leave_in_rounds; leave_in_rounds({str(tmp_path)!r}, {rounds})"
    done = subprocess.run(
        [sys.executable, "-c", program],
        env={**_env(tmp_path), "PYTHONPATH": os.pathsep.join([str(CASES.parent), str(CASES.parents[1])])},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
