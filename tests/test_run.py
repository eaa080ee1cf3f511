"""``bnsurgeon run``: a training script, unedited, trains with bnsurgeon's exact sync BN.

One torchrun launch (2 CPU gloo ranks, different data per rank, DDP with buffer broadcast off)
runs tests/_run_cases.py through ``-m bnsurgeon run``: torch's classmethod with a process group,
timm's function imported by name at the top of the script, and a Lightning Trainer with
``sync_batchnorm=True``. One launch without torchrun runs the same script as ``bnsurgeon run train.py
OUT spawn lightning``: its own torch.multiprocessing.spawn workers, then a Lightning Trainer(devices=2)
whose launcher starts rank 1 as plain ``python train.py``; both must inherit the replaced converters.
The other tests run scripts in one process or in short subprocesses (most import nothing heavy).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app
from bnsurgeon.launch.converters import ConversionLog, patched_converters
from bnsurgeon.launch.script import ScriptRaised, put_back, run_script
from bnsurgeon.runtime.layers import SyncBatchNorm, SyncBatchNormAct

CASES = Path(__file__).with_name("_run_cases.py")
ROOT = Path(__file__).resolve().parent.parent
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
CONVERTERS = ["torch", "timm"] + (["lightning"] if HAS_LIGHTNING else [])
SECTIONS = [*CONVERTERS, "built"]
#: torchrun starts 3 interpreters that import torch (and Lightning): generous for a busy 2-core machine
LAUNCH_TIMEOUT = 300


def _case():
    import runpy

    return runpy.run_path(str(CASES), run_name="run_cases")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    return env


def _python(*args, cwd, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """torchrun --nproc-per-node 2 -m bnsurgeon run train.py OUT SECTION... --report, once for the module."""
    from _dist import torchrun

    work = tmp_path_factory.mktemp("run")
    shutil.copy(CASES, work / "train.py")
    out = work / "out"
    out.mkdir()
    command = torchrun(
        "-m",
        "bnsurgeon",
        "run",
        "--report",
        str(out / "report.json"),
        "train.py",
        str(out),
        *SECTIONS,
    )
    done = subprocess.run(command, cwd=work, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {
        section: [torch.load(out / f"{section}.rank{rank}.pt", weights_only=True) for rank in range(2)]
        for section in SECTIONS
    }
    return results, done.stderr, out


@pytest.fixture(scope="module")
def children_launched(tmp_path_factory):
    """bnsurgeon run --report ... train.py OUT spawn lightning, without torchrun: the ranks are processes the
    script (or Lightning) starts, not bnsurgeon run."""
    work = tmp_path_factory.mktemp("children")
    shutil.copy(CASES, work / "train.py")
    out = work / "out"
    out.mkdir()
    sections = ["spawn"] + (["lightning"] if HAS_LIGHTNING else [])
    gaps = ["--stats", str(out / "gaps.json")]  # the ranks are children: they record, and their rank 0 writes
    command = ["-m", "bnsurgeon", "run", "--report", str(out / "report.json"), *gaps, "train.py", str(out), *sections]
    done = _python(*command, cwd=work, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr, out


@pytest.mark.distributed
def test_processes_the_script_starts_inherit_the_converters(children_launched):
    """torch.multiprocessing.spawn workers and the rank Lightning's launcher starts as `python train.py` convert
    with bnsurgeon's layers (torch's refuse CPU tensors: the run would fail), train synchronized and exact; the
    reports of all the run's processes are numbered in the order written."""
    stderr, out = children_launched
    reference = _case()["reference"]()
    for name in ["spawn"] + (["launcher"] if HAS_LIGHTNING else []):
        ranks = [torch.load(out / f"{name}.rank{rank}.pt", weights_only=True) for rank in range(2)]
        assert (
            ranks[0]["layers"] == ranks[1]["layers"] == ["SyncBatchNormAct/ReLU", "SyncBatchNorm", "FrozenBatchNorm2d"]
        )
        for key, expected in reference.items():
            assert torch.equal(ranks[0]["stats"][key], ranks[1]["stats"][key]), (name, key)
            torch.testing.assert_close(ranks[0]["stats"][key], expected, rtol=1e-12, atol=1e-12, msg=key)
    names = ["report.json", *(f"report.{n}.json" for n in range(2, len(list(out.glob("report*"))) + 1))]
    sources = [json.loads((out / name).read_text())["source"] for name in names]
    expected = ["torch.nn.SyncBatchNorm.convert_sync_batchnorm at train.py"]  # spawn's rank 0
    if HAS_LIGHTNING:
        expected += ["torch.nn.SyncBatchNorm.convert_sync_batchnorm at layer_sync.py", "Lightning TorchSyncBatchNorm"]
    assert len(sources) == len(expected) and all(s.startswith(e) for s, e in zip(sources, expected)), sources
    conversions = [
        line for line in stderr.splitlines() if line.startswith("bnsurgeon run:") and "sync changed" not in line
    ]
    assert len(conversions) == len(expected)


@pytest.mark.distributed
def test_stats_is_recorded_by_the_ranks_the_script_starts(children_launched):
    """--stats under the script's own spawn workers and Lightning's launcher (ranks that are children of the run):
    each world's rank 0 writes one document of 2 ranks, and says one verdict line."""
    stderr, out = children_launched
    documents = [json.loads(path.read_text()) for path in sorted(out.glob("gaps*.json"))]
    assert len(documents) == 1 + HAS_LIGHTNING, [p.name for p in out.iterdir()]
    for document in documents:
        assert document["world_size"] == 2 and document["layers"], document
    verdicts = [line for line in stderr.splitlines() if "sync changed batch means" in line]
    assert len(verdicts) == len(documents), stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("section", CONVERTERS)
def test_each_converter_trains_synchronized_and_exact(launched, section):
    """The ranks see different data and DDP does not broadcast buffers, so only synchronized BN makes
    their running statistics equal: bit-identical between ranks, and the whole batch's in one process."""
    results, _, _ = launched
    reference = _case()["reference"]()
    for rank in range(2):
        assert set(results[section][rank]["stats"]) == set(reference)
    for name, expected in reference.items():
        rank0, rank1 = (results[section][rank]["stats"][name] for rank in range(2))
        assert torch.equal(rank0, rank1), name
        torch.testing.assert_close(rank0, expected, rtol=1e-12, atol=1e-12, msg=name)
    # bnsurgeon's layers while training: BatchNormAct2d keeps its ReLU; torchvision's frozen BN stays frozen
    assert results[section][0]["layers"] == ["SyncBatchNormAct/ReLU", "SyncBatchNorm", "FrozenBatchNorm2d"]


@pytest.mark.distributed
def test_returned_module_process_group_and_revert(launched):
    results, _, _ = launched
    assert results["torch"][0]["same_object"] and results["timm"][0]["same_object"]  # in place, as the originals
    assert results["torch"][0]["groups_kept"] and results["torch"][1]["groups_kept"]
    if HAS_LIGHTNING:  # after fit, Lightning's revert gives back the exact classes, activation included
        assert results["lightning"][0]["after_fit"] == ["BatchNormAct2d/ReLU", "BatchNorm2d", "FrozenBatchNorm2d"]


@pytest.mark.distributed
def test_rank_zero_prints_one_line_per_conversion_and_writes_reports(launched):
    _, stderr, out = launched
    lines = [line for line in stderr.splitlines() if line.startswith("bnsurgeon run:")]
    expected = ["torch.nn.SyncBatchNorm.convert_sync_batchnorm at train.py", "timm.layers.convert_sync_batchnorm at"]
    if HAS_LIGHTNING:  # Lightning's apply is torch's classmethod; its revert after fit goes back to plain
        expected += ["torch.nn.SyncBatchNorm.convert_sync_batchnorm at layer_sync.py", "TorchSyncBatchNorm.revert"]
    expected += [*["adopted at DistributedDataParallel at train.py:"] * 4, "adopted at their first forward"]
    assert len(lines) == len(expected), lines  # rank 0 only: two ranks would print each twice
    for line, text in zip(lines, expected):
        assert text in line
    assert "2 modules to bnsurgeon's exact sync BN" in lines[0] and "1 kept, 0 unhandled" in lines[0]
    reports = [out / "report.json", *(out / f"report.{n}.json" for n in range(2, len(expected) + 1))]
    documents = [json.loads(path.read_text()) for path in reports]
    assert [d["target"] for d in documents[:2]] == ["sync", "sync"]
    assert documents[1]["source"].startswith("timm.layers.convert_sync_batchnorm")
    assert {c["from_class"].rsplit(".", 1)[1] for c in documents[0]["changed"]} == {"BatchNormAct2d", "BatchNorm2d"}
    assert [k["cls"].rsplit(".", 1)[1] for k in documents[0]["kept"]] == ["FrozenBatchNorm2d"]


@pytest.mark.distributed
def test_sync_batchnorm_a_model_builds_itself_trains_synchronized_and_exact(launched):
    """No converter is called: torch's nn.SyncBatchNorm built by a constructor call, a registry that captured the
    class on import (mmcv's), detectron2's get_norm, an unpickled module, and one trained without DDP. Each trains
    as bnsurgeon's layer in place: ranks bit-identical, the whole batch's statistics in one process, the same
    Parameter objects the optimizer was built with, torch's isinstance and state_dict keys. (Without the run
    each stops at DDP, or at its first forward, with torch's 'SyncBatchNorm layers only work with GPU modules'.)"""
    results, _, out = launched
    case = _case()
    reference = case["built_reference"]()
    keys = sorted(case["Built"]("plain").state_dict())
    for how in case["BUILT"]:
        ranks = [results["built"][rank][how] for rank in range(2)]
        for name, expected in reference.items():
            assert torch.equal(ranks[0]["stats"][name], ranks[1]["stats"][name]), (how, name)
            torch.testing.assert_close(ranks[0]["stats"][name], expected, rtol=1e-12, atol=1e-12, msg=(how, name))
        assert ranks[0]["layers"] == ["SyncBatchNorm", "SyncBatchNorm", "FrozenBatchNorm2d"], how
        assert ranks[0]["isinstance"] and ranks[0]["same_params"] and ranks[0]["keys"] == keys, how
    count = len(list(out.glob("report*.json")))
    documents = [json.loads((out / f"report{'' if n == 1 else f'.{n}'}.json").read_text()) for n in range(1, count + 1)]
    adopted = [d for d in documents if "the model built" in d["source"]]
    assert len(adopted) == 5
    wrapped = adopted[0]
    assert [c["path"] for c in wrapped["changed"]] == ["bn1", "bn2"]
    assert {c["from_class"] for c in wrapped["changed"]} == {"torch.nn.modules.batchnorm.SyncBatchNorm"}
    assert [c["cls"] for c in wrapped["kept"]] == ["torchvision.ops.misc.FrozenBatchNorm2d"]
    built_at = [c["notes"][0] for d in adopted for c in d["changed"]]
    assert built_at[:2] == [f"built at train.py:{_line_of('return nn.SyncBatchNorm(channels)')}"] * 2, built_at
    assert built_at[4] == f"built at train.py:{_line_of('lambda c: nn.SyncBatchNorm(c)')}"  # get_norm's
    assert built_at[6].startswith("unpickled or copied at train.py:"), built_at


def _line_of(text: str) -> int:
    return next(n for n, line in enumerate(CASES.read_text().splitlines(), 1) if text in line)


def test_the_case_fails_without_the_patches():
    """Unsynchronized BN on a rank's half ends far from the whole batch (the equality above can fail), and
    the unpatched converters build torch's and timm's layers, not bnsurgeon's (the layer check can fail)."""
    case = _case()
    reference = case["reference"]()
    model = case["build_model"]().train()
    x, g = case["data"]()
    case["train"](model, x[0::2], g[0::2], world=2)
    assert (model[1].running_mean - reference["1.running_mean"]).abs().max() > 0.1
    assert type(case["convert_sync_batchnorm"](case["build_model"]())[1]) is not SyncBatchNormAct
    assert type(nn.SyncBatchNorm.convert_sync_batchnorm(case["build_model"]())[3]) is nn.SyncBatchNorm


def test_in_process_patches_cover_names_bound_before_and_are_undone():
    """A module that bound timm's function by name before the run (this test module's copy of the case) gets
    the replacement; torch's classmethod keeps torch's contract for a bare BN root (a new module, sharing
    the Parameters); everything is restored afterwards."""
    import timm.layers

    case = _case()
    original_timm, original_torch = (
        timm.layers.convert_sync_batchnorm,
        nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"],
    )
    holder = type(sys)("holder_module")
    holder.convert_sync_batchnorm = original_timm
    sys.modules["holder_module"] = holder
    try:
        log = ConversionLog(quiet=True)
        with patched_converters(log):
            assert holder.convert_sync_batchnorm is not original_timm
            converted = holder.convert_sync_batchnorm(case["build_model"]())
            assert type(converted[1]) is SyncBatchNormAct and type(converted[3]) is SyncBatchNorm
            root = nn.BatchNorm2d(3)
            new_root = nn.SyncBatchNorm.convert_sync_batchnorm(root)
            assert type(new_root) is SyncBatchNorm and new_root is not root and new_root.weight is root.weight
            assert type(root) is nn.BatchNorm2d
        assert [c.converter.split(".")[0] for c in log.conversions] == ["timm", "torch"]
        assert holder.convert_sync_batchnorm is original_timm and timm.layers.convert_sync_batchnorm is original_timm
        assert nn.SyncBatchNorm.__dict__["convert_sync_batchnorm"] is original_torch
    finally:
        del sys.modules["holder_module"]


UNHANDLED = """
    import sys
    import torch
    from torch import nn

    class MyBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), MyBN(4)))
    open(sys.argv[1], "w").write("the first step ran")
"""


def test_an_unhandled_bn_class_stops_the_run_before_training(tmp_path, cli):
    script = tmp_path / "unhandled.py"
    script.write_text(textwrap.dedent(UNHANDLED))
    marker = tmp_path / "stepped"
    result = cli.invoke(app, ["run", str(script), str(marker)])
    assert result.exit_code == 7, result.output
    assert "MyBN" in result.output and "unhandled.py:" in result.output and "--allow-unhandled" in result.output
    assert not marker.exists()
    # opted in, as with convert: the run goes on, the class left as it was and listed in the report
    put_back()
    result = cli.invoke(
        app, ["run", "--allow-unhandled", "--report", str(tmp_path / "r.json"), str(script), str(marker)]
    )
    assert result.exit_code == 0, result.output
    assert marker.exists()
    assert [u["cls"].rsplit(".", 1)[1] for u in json.loads((tmp_path / "r.json").read_text())["unhandled"]] == ["MyBN"]


def test_the_scripts_traceback_and_exit_code_come_through_unchanged(tmp_path):
    (tmp_path / "raises.py").write_text(
        textwrap.dedent(
            """
            def parse(text):
                return int(text)

            try:
                parse("x")
            except ValueError as error:
                raise ValueError("bad configuration") from error
            """
        )
    )
    (tmp_path / "exits.py").write_text("import sys\nprint('trained')\nsys.exit(3)\n")
    (tmp_path / "says.py").write_text("import sys\nsys.exit('no data found')\n")
    (tmp_path / "broken.py").write_text("x = (\n")  # no traceback at all, as python prints it
    (tmp_path / "interrupted.py").write_text("raise KeyboardInterrupt\n")  # python dies by SIGINT
    (tmp_path / "unprintable.py").write_text(  # python prints "<exception str() failed>"
        "class E(Exception):\n    def __str__(self):\n        raise RuntimeError\n\nraise E()\n"
    )
    (tmp_path / "no_main").mkdir()  # python: "can't find '__main__' module in ..."
    cases = (
        ("raises.py", 1),
        ("exits.py", 3),
        ("says.py", 1),
        ("broken.py", 1),
        ("interrupted.py", -2),
        ("unprintable.py", 1),
        ("no_main", 1),
    )
    for name, code in cases:
        script = str(tmp_path / name)
        plain = _python(script, cwd=tmp_path)
        ran = _python("-m", "bnsurgeon", "run", script, cwd=tmp_path)
        assert plain.returncode == ran.returncode == code, ran.stderr
        assert (ran.stdout, ran.stderr) == (plain.stdout, plain.stderr)
        assert "bnsurgeon" not in ran.stderr and "runpy" not in ran.stderr
    # -m: a package without __main__ is python's one line; a package whose __init__ fails to import something
    # is its traceback, exit 1 (only a module that does not exist is bnsurgeon's "no module named", exit 2)
    (tmp_path / "no_main_pkg").mkdir()
    (tmp_path / "no_main_pkg" / "__init__.py").write_text("")
    (tmp_path / "broken_pkg").mkdir()
    (tmp_path / "broken_pkg" / "__init__.py").write_text("import a_module_that_is_not_there\n")
    (tmp_path / "broken_pkg" / "mod.py").write_text("print('ran')\n")
    for name in ("no_main_pkg", "broken_pkg.mod"):
        plain = _python("-m", name, cwd=tmp_path)
        ran = _python("-m", "bnsurgeon", "run", "-m", name, cwd=tmp_path)
        assert plain.returncode == ran.returncode == 1, ran.stderr
        assert ran.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1], ran.stderr
    assert "broken_pkg/__init__.py" in ran.stderr and "Traceback" in ran.stderr
    missing = _python("-m", "bnsurgeon", "run", "-m", "no_such_pkg.mod", cwd=tmp_path)
    assert missing.returncode == 2 and "no module named 'no_such_pkg.mod'" in missing.stderr


PROBE = """
    import json, sys
    print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "path": sys.path,
                      "main": sys.modules["__main__"].__file__, "torch": "torch" in sys.modules,
                      "package": __package__, "loader": type(__loader__).__name__,
                      "hook": sys.excepthook is sys.__excepthook__}))
"""


def test_the_script_sees_what_python_gives_it(tmp_path):
    """__name__, __file__, __package__, __loader__, sys.argv, sys.path (the script's real directory first, not
    bnsurgeon's, --rules or not), sys.modules['__main__'], python's sys.excepthook (not Typer's); arguments that
    look like options (--help, -m) belong to the script. Nothing imports torch for it."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(textwrap.dedent(PROBE))
    script, args = str(tmp_path / "scripts" / "probe.py"), ["--help", "-m", "x"]
    plain = json.loads(_python(script, *args, cwd=tmp_path).stdout)
    ran = json.loads(_python("-m", "bnsurgeon", "run", script, *args, cwd=tmp_path).stdout)
    assert ran == plain and plain["name"] == "__main__" and plain["argv"][1:] == args and not ran["torch"]
    assert plain["package"] is None and plain["loader"] == "SourceFileLoader" and plain["hook"]
    (tmp_path / "my_rules.py").write_text("RULES = []\n")
    ran = _python("-m", "bnsurgeon", "run", "--rules", "my_rules:RULES", script, *args, cwd=tmp_path)
    assert {**json.loads(ran.stdout), "torch": False} == plain, ran.stderr  # registering rules imports torch
    plain = json.loads(_python("-m", "pkg.probe", *args, cwd=tmp_path).stdout)
    ran = json.loads(_python("-m", "bnsurgeon", "run", "-m", "pkg.probe", *args, cwd=tmp_path).stdout)
    assert ran == plain and plain["path"][0] == str(tmp_path) and plain["package"] == "pkg"


def test_run_script_raises_the_scripts_exception_without_bnsurgeon_frames(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("def inner():\n    raise KeyError('k')\n\ninner()\n")
    with pytest.raises(ScriptRaised) as raised:
        run_script(str(script))
    error = raised.value.error
    assert isinstance(error, KeyError)
    assert error.__traceback__.tb_frame.f_code.co_filename == str(script)  # the first frame is the script's
    saved = list(sys.path)
    with pytest.raises(SystemExit) as exited:
        run_script(_write(tmp_path, "exits.py", "raise SystemExit(4)"))
    assert exited.value.code == 4 and sys.path == saved


def _write(directory: Path, name: str, text: str) -> str:
    (directory / name).write_text(text)
    return str(directory / name)


def test_help_explains_run_with_torchrun_first_and_imports_no_torch():
    probe = (
        "import sys; from typer.testing import CliRunner; from bnsurgeon.cli.commands import app; "
        "r = CliRunner().invoke(app, ['run', '--help']); print(r.output); print('torch' in sys.modules)"
    )
    done = _python("-c", probe, cwd=ROOT)
    text, imported = done.stdout.rsplit("\n", 2)[0], done.stdout.split()[-1]
    assert imported == "False", done.stderr
    assert text.index("torchrun --nproc-per-node 2 -m bnsurgeon run") < text.index("bnsurgeon run -m")
    for needed in (
        "convert_sync_batchnorm",
        "sync_batchnorm=True",
        "revert_sync_batchnorm",
        "--allow-unhandled",
        "--report",
        "Not covered",
        "builds torch.nn.SyncBatchNorm itself",
        "frozen BN stays frozen",
    ):
        assert needed in " ".join(text.split()), needed


@pytest.mark.skipif(
    importlib.util.find_spec("mmengine") is None, reason="mmengine is not installed (optional extra: openmmlab)"
)
def test_mmengine_converters():
    """The two functions OpenMMLab's runner calls (sync_bn="torch"; the revert when not distributed), imported
    by name as the runner imports them (its module needs OpenCV, so it is not imported here)."""
    log = ConversionLog(quiet=True)
    with patched_converters(log):
        from mmengine.model import convert_sync_batchnorm, revert_sync_batchnorm

        model = _case()["build_model"]()
        synced = convert_sync_batchnorm(model, "torch")
        assert synced is model and type(synced[1]) is SyncBatchNormAct and type(synced[1].act) is nn.ReLU
        assert type(synced[4]).__name__ == "FrozenBatchNorm2d"
        reverted = revert_sync_batchnorm(synced)
        assert [type(m).__name__ for m in reverted][1:4] == ["BatchNormAct2d", "Conv2d", "BatchNorm2d"]
    assert [c.converter.rsplit(".", 1)[1] for c in log.conversions] == [
        "convert_sync_batchnorm",
        "revert_sync_batchnorm",
    ]


def test_the_package_ships_a_py_typed_marker():
    """PEP 561: without it, type checkers ignore the public API's annotations in users' scripts."""
    from setuptools.config.pyprojecttoml import read_configuration

    assert (ROOT / "bnsurgeon" / "py.typed").is_file()
    package_data = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["bnsurgeon"]


def test_a_second_call_a_models_own_sync_bn_and_timms_freeze_keep_the_originals_semantics():
    """torch's converter rebuilds every _BatchNorm with the group given (None: the default group), so a second
    call regroups bnsurgeon's layers; Lightning's revert turns a model's own nn.SyncBatchNorm into _BatchNormXd
    (not BatchNorm2d: it runs on (N, C) input); timm's freeze_batch_norm_2d keeps the act variant's activation."""
    import timm.layers

    group = object()  # a stand-in: the layers only hold it until a forward
    with patched_converters(ConversionLog(quiet=True)):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), process_group=group)
        assert model[0].process_group is group
        assert nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=None)[0].process_group is None
        built = _case()["build_model"]()
        frozen = timm.layers.freeze_batch_norm_2d(timm.layers.convert_sync_batchnorm(built))
        assert type(frozen[1]) is timm.layers.FrozenBatchNormAct2d and type(frozen[1].act) is nn.ReLU
        assert type(frozen[3]).__name__ == "FrozenBatchNorm2d"
        if HAS_LIGHTNING:
            from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

            layer_sync = TorchSyncBatchNorm()
            own = layer_sync.revert(layer_sync.apply(nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4))))
            assert type(own[1]).__name__ == "_BatchNormXd"
            assert own.eval()(torch.randn(5, 3)).shape == (5, 4)


AFTER_MAIN = """
    import atexit, pickle, sys, threading, time
    from torch import nn

    class Checkpoint:
        pass

    def later():
        time.sleep(0.3)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)))
        print("thread:", type(model[0]).__module__, flush=True)

    atexit.register(lambda: print("atexit:", len(pickle.dumps(Checkpoint())) > 0, sys.argv[1:], flush=True))
    threading.Thread(target=later).start()
"""


def test_threads_and_atexit_handlers_run_after_the_script_in_its_state(tmp_path):
    """A non-daemon thread converting after the main body gets bnsurgeon's converter; an atexit handler pickles a
    class of the script's __main__ and sees its sys.argv, as under python."""
    script = _write(tmp_path, "after.py", textwrap.dedent(AFTER_MAIN))
    ran = _python("-m", "bnsurgeon", "run", "-q", script, "arg", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["thread: bnsurgeon.runtime.layers", "atexit: True ['arg']"]


CONVERTS = """
    import os, sys
    import torch
    from torch import nn

    os.chdir(sys.argv[1])  # as Hydra does
    for _ in range(int(sys.argv[2])):
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    open("ran", "w").close()
"""


def test_the_report_path_is_checked_before_the_script_starts(tmp_path, monkeypatch, cli):
    """A relative --report is the start's working directory's; existing reports need --force, which removes them
    all (no report of an earlier run reads as this run's); never the script; an unwritable place or a directory
    stops the run before the script's first line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    script = _write(tmp_path, "train.py", textwrap.dedent(CONVERTS))
    elsewhere, marker = str(tmp_path / "elsewhere"), tmp_path / "elsewhere" / "ran"

    def run(*options: str, conversions: int) -> Any:
        result = cli.invoke(app, ["run", *options, script, elsewhere, str(conversions)])
        put_back()
        os.chdir(tmp_path)  # the script's chdir is the process's
        return result

    result = run("--report", "run.json", conversions=2)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run.json").is_file() and (tmp_path / "run.2.json").is_file()
    assert not list((tmp_path / "elsewhere").glob("*.json")) and marker.exists()
    marker.unlink()
    for refused in (
        ["--report", "run.json"],  # exists
        ["--report", "train.py", "--force"],  # the script itself
        ["--report", "/proc/run.json"],  # a directory where no file can be created
        ["--report", "elsewhere"],  # a directory
    ):
        result = run(*refused, conversions=1)
        assert result.exit_code == 8 and not marker.exists(), (refused, result.output)
    assert (tmp_path / "train.py").read_text() == textwrap.dedent(CONVERTS)
    result = run("--report", "run.json", "--force", conversions=0)
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "run.json").exists() and not (tmp_path / "run.2.json").exists()
    assert "no converter was called" in result.output


def test_a_broken_rules_module_is_one_line_with_the_other_commands_exit_code(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_rules_for_run.py").write_text("raise RuntimeError('rules module broken')\n")
    script = _write(tmp_path, "noop.py", "")
    ran = cli.invoke(app, ["run", "--rules", "broken_rules_for_run:RULES", script])
    other = CliRunner().invoke(app, ["inspect", "resnet18", "--rules", "broken_rules_for_run:RULES"])
    assert ran.exit_code == other.exit_code != 1 and "Traceback" not in ran.output, ran.output
    assert ran.output.startswith("error:") and "rules module broken" in ran.output


def test_the_summary_line_escapes_control_characters_of_the_file_name(tmp_path, capsys):
    script = _write(
        tmp_path,
        "ev\x1b[31mil\r.py",
        "import torch\ntorch.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm2d(2))\n",
    )
    run_script(script)
    err = capsys.readouterr().err
    assert "ev\\x1b[31mil\\r.py:2" in err and "\x1b" not in err and "\r" not in err


def test_script_raised_is_public():
    import bnsurgeon

    assert bnsurgeon.ScriptRaised is ScriptRaised and "ScriptRaised" in bnsurgeon.__all__


CHILD = """
    import subprocess, sys
    probe = "import os, sys, sitecustomize; print(sitecustomize.MARK, any('launch/_child' in p for p in sys.path), 'BNSURGEON_RUN' in os.environ)"
    print(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip())
"""


def test_a_child_runs_the_users_own_sitecustomize_and_the_environment_is_put_back(tmp_path, monkeypatch, capsys):
    """The bootstrap chains to the sitecustomize it hides and leaves the child's sys.path; run_script puts
    PYTHONPATH and BNSURGEON_RUN back as they were."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("MARK = 'theirs'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.delenv("BNSURGEON_RUN", raising=False)
    run_script(_write(tmp_path, "child.py", textwrap.dedent(CHILD)))
    assert capsys.readouterr().out.strip() == "theirs False True"
    assert os.environ["PYTHONPATH"] == str(tmp_path / "site") and "BNSURGEON_RUN" not in os.environ
