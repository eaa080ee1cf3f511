"""``bnsurgeon run``: a training script, unedited, trains with bnsurgeon's exact sync BN.

One torchrun launch (2 CPU gloo ranks, different data per rank, DDP with buffer broadcast off)
runs tests/_run_cases.py through ``-m bnsurgeon run``: torch's classmethod with a process group,
timm's function imported by name at the top of the script, and a Lightning Trainer with
``sync_batchnorm=True``. The other tests run scripts in one process (most import nothing heavy).
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

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from bnsurgeon.cli.commands import app
from bnsurgeon.launch.converters import ConversionLog, patched_converters
from bnsurgeon.launch.script import ScriptRaised, run_script
from bnsurgeon.runtime.layers import SyncBatchNorm, SyncBatchNormAct

CASES = Path(__file__).with_name("_run_cases.py")
ROOT = Path(__file__).resolve().parent.parent
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
SECTIONS = ["torch", "timm"] + (["lightning"] if HAS_LIGHTNING else [])
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
    from bnsurgeon.checks.multiproc import free_port

    work = tmp_path_factory.mktemp("run")
    shutil.copy(CASES, work / "train.py")
    out = work / "out"
    out.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command = [
        *launcher,
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "bnsurgeon",
        "run",
        "--report",
        str(out / "report.json"),
        "train.py",
        str(out),
        *SECTIONS,
    ]
    done = subprocess.run(command, cwd=work, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {
        section: [torch.load(out / f"{section}.rank{rank}.pt", weights_only=True) for rank in range(2)]
        for section in SECTIONS
    }
    return results, done.stderr, out


@pytest.mark.distributed
@pytest.mark.parametrize("section", SECTIONS)
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


def test_an_unhandled_bn_class_stops_the_run_before_training(tmp_path):
    script = tmp_path / "unhandled.py"
    script.write_text(textwrap.dedent(UNHANDLED))
    marker = tmp_path / "stepped"
    result = CliRunner().invoke(app, ["run", str(script), str(marker)])
    assert result.exit_code == 7, result.output
    assert "MyBN" in result.output and "unhandled.py:" in result.output and "--allow-unhandled" in result.output
    assert not marker.exists()
    # opted in, as with convert: the run goes on, the class left as it was and listed in the report
    result = CliRunner().invoke(
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
    cases = (("raises.py", 1), ("exits.py", 3), ("says.py", 1), ("broken.py", 1), ("interrupted.py", -2))
    for name, code in cases:
        script = str(tmp_path / name)
        plain = _python(script, cwd=tmp_path)
        ran = _python("-m", "bnsurgeon", "run", script, cwd=tmp_path)
        assert plain.returncode == ran.returncode == code, ran.stderr
        assert (ran.stdout, ran.stderr) == (plain.stdout, plain.stderr)
        assert "bnsurgeon" not in ran.stderr and "runpy" not in ran.stderr


PROBE = """
    import json, sys
    print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
                      "main": sys.modules["__main__"].__file__, "torch": "torch" in sys.modules}))
"""


def test_the_script_sees_what_python_gives_it(tmp_path):
    """__name__, __file__, sys.argv, sys.path[0] (the script's real directory), sys.modules['__main__'];
    arguments that look like options (--help, -m) belong to the script. Nothing imports torch for it."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(textwrap.dedent(PROBE))
    script, args = str(tmp_path / "scripts" / "probe.py"), ["--help", "-m", "x"]
    plain = json.loads(_python(script, *args, cwd=tmp_path).stdout)
    ran = json.loads(_python("-m", "bnsurgeon", "run", script, *args, cwd=tmp_path).stdout)
    assert ran == plain and plain["name"] == "__main__" and plain["argv"][1:] == args and not ran["torch"]
    plain = json.loads(_python("-m", "pkg.probe", *args, cwd=tmp_path).stdout)
    ran = json.loads(_python("-m", "bnsurgeon", "run", "-m", "pkg.probe", *args, cwd=tmp_path).stdout)
    assert ran == plain and plain["path0"] == str(tmp_path)


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
