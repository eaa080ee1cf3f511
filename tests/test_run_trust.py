"""Trust, round five: ``bnsurgeon run`` as careful with other people's processes and files as the CLI is.

Each test is one class of the attack on ``launch/`` (issue 53) and fails on the code before it: the child
start hook (A), report files (B), bnsurgeon's own I/O inside the script's converter call (C), ``--rules`` in
children (D), ``timm:NAME`` (F), order and exit codes (G), a replacement kept after the run (H). Most run in this
process; the children are short interpreters, and only two of them import torch.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from bnsurgeon.cli.commands import app
from bnsurgeon.launch.log import ConversionLog
from bnsurgeon.launch.script import put_back, run_script
from bnsurgeon.runtime.layers import SyncBatchNorm
from bnsurgeon.surgery.report import Report


def _run(tmp_path: Path, body: str, *args: str, **options) -> ConversionLog:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    return run_script(str(script), list(args), **options)


# A. the child start hook

CHILDREN = """
    import json, os, subprocess, sys
    probe = "import json, os, sys; print(json.dumps({'torch': 'torch' in sys.modules, 'path': sys.path, "
    probe += "'pythonpath': os.environ.get('PYTHONPATH')}))"
    mine = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    other = subprocess.run([sys.argv[1], "-c", "print('other interpreter ran')"], capture_output=True, text=True)
    plain = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True)
    open(sys.argv[2], "w").write(json.dumps({
        "mine": json.loads(mine.stdout), "plain": json.loads(plain.stdout),
        "other": [other.returncode, other.stdout, other.stderr],
    }))
"""


def test_a_child_that_never_imports_torch_runs_as_under_python_and_other_interpreters_never_see_the_hook(tmp_path):
    """A child of this interpreter imports no torch at start-up and keeps python's sys.path and PYTHONPATH; a
    child of another interpreter (the base python, without bnsurgeon or torch) runs normally: before, every one
    ran bnsurgeon's sitecustomize through PYTHONPATH, imported torch, and the other interpreter was killed (exit 1)."""
    other = getattr(sys, "_base_executable", None) or sys.executable
    out = tmp_path / "seen.json"
    saved = os.environ.get("PYTHONPATH")
    _run(tmp_path, CHILDREN, other, str(out), quiet=True)
    seen = json.loads(out.read_text())
    assert seen["other"][0] == 0 and "other interpreter ran" in seen["other"][1], seen["other"]
    assert seen["mine"]["torch"] is False
    assert seen["mine"]["pythonpath"] == saved
    assert not any("launch/_child" in entry or "launch" + os.sep + "_child" in entry for entry in seen["mine"]["path"])
    assert [e for e in seen["mine"]["path"] if e] == [
        e for e in seen["plain"]["path"] if e and e in seen["mine"]["path"]
    ]


# B. report files


def test_the_file_that_runs_is_never_a_report_force_or_not(tmp_path, cli):
    """A directory's __main__.py, and a hard link to the script, are the file run: refused (exit 8), intact."""
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    main = app_dir / "__main__.py"
    main.write_text("print('ran')\n")
    result = cli.invoke(app, ["run", "--report", str(main), "--force", str(app_dir)])
    assert result.exit_code == 8, result.output
    assert "would write over the script" in result.output and main.read_text() == "print('ran')\n"
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    os.link(script, tmp_path / "hard.py")
    result = cli.invoke(app, ["run", "--report", str(tmp_path / "hard.py"), "--force", str(script)])
    assert result.exit_code == 8, result.output
    assert script.read_text() == "print('ran')\n"


def test_force_replaces_only_reports_never_a_packages_init_or_a_module_of_the_script(tmp_path, monkeypatch, cli):
    """-m pkg.sub.train runs pkg/__init__.py and pkg/sub/__init__.py too: each was replaced by the report with
    --force (exit 0, the package's source gone); so was a module the script imports. --force removes only a file
    that holds a bnsurgeon report."""
    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    sources = {
        tmp_path / "pkg" / "__init__.py": "X = 1\n",
        sub / "__init__.py": "Y = 2\n",
        sub
        / "train.py": "import helper\nfrom torch import nn\nnn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))\n",
        tmp_path / "helper.py": "Z = 3\n",
    }
    for path, text in sources.items():
        path.write_text(text)
    monkeypatch.chdir(tmp_path)
    for victim in (tmp_path / "pkg" / "__init__.py", sub / "__init__.py", sub / "train.py", tmp_path / "helper.py"):
        for force in (["--force"], []):  # never told to pass --force, which could not make it usable
            result = cli.invoke(app, ["run", "--report", str(victim), *force, "-m", "pkg.sub.train"])
            put_back()
            assert result.exit_code == 8, (victim, result.output)
            assert "Traceback" not in result.output and "pass --force" not in result.output, result.output
    assert {path: path.read_text() for path in sources} == sources
    report = tmp_path / "run.json"
    for _ in range(2):  # an earlier run's report is replaced with --force
        result = cli.invoke(app, ["run", "--report", str(report), "--force", "-m", "pkg.sub.train"])
        put_back()
        assert result.exit_code == 0, result.output
        assert json.loads(report.read_text())["target"] == "sync"


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("ending", ["/", "/.", "/.."])
def test_a_report_name_ending_in_a_slash_names_a_directory_and_is_refused(tmp_path, cli, existing, ending):
    """--report newdir/ wrote a file named newdir (the slash dropped); --report x.json/ --force replaced x.json;
    so did x.json/. (tidied as text, where the system refuses it: Not a directory)."""
    script = tmp_path / "train.py"
    script.write_text("from torch import nn\nnn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))\n")
    name = tmp_path / ("x.json" if existing else "newdir")
    if existing:
        name.write_text("{}")
    result = cli.invoke(app, ["run", "--report", f"{name}{ending}", "--force", str(script)])
    assert result.exit_code == 8, result.output
    assert "names a directory" in result.output and "Traceback" not in result.output
    assert (name.read_text() == "{}") if existing else not os.path.lexists(name)


def test_a_report_path_through_a_missing_directory_is_read_as_the_system_reads_it(tmp_path, cli, monkeypatch):
    """nodir/../r.json was tidied to r.json and written, where open() fails (nodir does not exist); through a
    linked directory, .. is the link target's parent, not the link's."""
    script = tmp_path / "train.py"
    script.write_text("from torch import nn\nnn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))\n")
    monkeypatch.chdir(tmp_path)
    result = cli.invoke(app, ["run", "--report", "nodir/../r.json", str(script)])
    assert result.exit_code == 8 and "does not exist" in result.output, result.output
    assert not (tmp_path / "r.json").exists()
    put_back()
    (tmp_path / "deep" / "target").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "deep" / "target")
    result = cli.invoke(app, ["run", "--report", "link/../r.json", str(script)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "deep" / "r.json").is_file() and not (tmp_path / "r.json").exists()


def test_what_is_not_a_regular_file_is_refused_without_the_force_advice_and_never_removed(tmp_path, cli):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    for report in (str(fifo), "/dev/stdout"):
        for force in ([], ["--force"]):
            result = cli.invoke(app, ["run", "--report", report, *force, str(script)])
            assert result.exit_code == 8, result.output
            assert (
                "not a regular file" in result.output
                or "is a FIFO" in result.output
                or "symbolic link" in result.output
            )
            assert "--force" not in result.output, result.output
    assert fifo.exists() and os.path.exists("/dev/stdout")


THREADS = """
    import threading
    import torch
    from torch import nn

    def convert():
        nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))

    threads = [threading.Thread(target=convert) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
"""


def test_every_conversion_keeps_its_own_report_and_the_umask(tmp_path, capsys):
    """8 threads converting at once: 8 reports (before: 1 or 2 survived), each with the umask's mode."""
    report = tmp_path / "run.json"
    old = os.umask(0o027)
    try:
        _run(tmp_path, THREADS, report=report)
    finally:
        os.umask(old)
    names = sorted(tmp_path.glob("run*.json"))
    assert len(names) == 8, names
    assert all(json.loads(name.read_text())["target"] == "sync" for name in names)
    assert {oct(name.stat().st_mode & 0o777) for name in names} == {oct(0o640)}
    assert capsys.readouterr().err.count("bnsurgeon run:") == 8
    assert not [entry for entry in tmp_path.iterdir() if entry.name.startswith(".")]


def test_a_child_whose_rank_is_not_known_says_which_process_it_is(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    log = ConversionLog(child=True, report_path=tmp_path / "r.json")
    log.record("torch.nn.SyncBatchNorm.convert_sync_batchnorm", "train.py:3", Report(target="sync"))
    assert f"(process {os.getpid()}: its rank is not known yet)" in capsys.readouterr().err
    assert (tmp_path / "r.json").exists()


FORKED_POOL = """
import multiprocessing, sys
from torch import nn

def convert(_):
    nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))

if __name__ == "__main__":
    convert(0)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        pool.map(convert, [0])
"""


def test_a_forked_worker_says_which_process_it_is_not_the_runs_rank(tmp_path):
    """A fork-start pool's worker inherited the run's log: its line read as the run's own (rank 0). And a
    child whose RANK is the run's own (torch.multiprocessing.spawn under torchrun) only inherited it."""
    from _forked import run_python

    (tmp_path / "pool.py").write_text(FORKED_POOL)
    done = run_python(
        "import os\nfrom bnsurgeon.launch.script import run_script\nrun_script('pool.py', report='r.json')\n"
        "print(os.getpid())\n",
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "RANK"},
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("bnsurgeon run")]
    assert len(lines) == 2 and lines[0].startswith("bnsurgeon run: "), lines
    worker = lines[1].split("(process ", 1)[1].split(":", 1)[0]
    assert worker.isdigit() and worker != done.stdout.strip(), lines
    assert sorted(path.name for path in tmp_path.glob("r*.json")) == ["r.2.json", "r.json"]
    sources = sorted(json.loads(path.read_text())["source"] for path in tmp_path.glob("r*.json"))
    assert [f"(process {worker}:" in source for source in sources].count(True) == 1, sources  # its report too


@pytest.mark.parametrize(
    "rank, parents, known", [("0", "0", None), ("3", "0", 3), (None, "0", None), ("2", "2", 2), ("0", None, 0)]
)
def test_a_childs_rank_is_its_own_not_the_one_it_inherited(monkeypatch, rank, parents, known):
    """RANK=0 only inherited from torchrun's rank 0 (its spawn workers) is no rank: the child names itself; one
    inherited from rank 2 keeps the child as silent as rank 2 (it printed for each of rank k's children); a RANK
    its own launcher gave it is its own."""
    monkeypatch.delenv("RANK", raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    assert ConversionLog(child=True, run_rank=parents).rank() == known
    monkeypatch.setenv("RANK", "0")
    assert ConversionLog().rank() == 0  # the run's own process: torchrun's RANK is its own


def test_a_process_group_a_fork_copied_gives_no_rank(monkeypatch):
    """A worker forked from rank 0 after init_process_group holds a copy of its group: it spoke as rank 0."""
    import types

    from bnsurgeon.launch.log import rank

    group = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 0)
    monkeypatch.setitem(sys.modules, "torch.distributed", group)
    monkeypatch.setenv("RANK", "0")
    assert rank(child=True, inherited="0", group_copied=True) is None
    assert rank(child=True, inherited="0") == 0  # a group it joined itself


KILLED_WHILE_WRITING = """
import os
from pathlib import Path
from bnsurgeon.launch import log

def killed(*args, **kwargs):  # the process ends (a SIGKILL, a script's handler calling os._exit) mid-write
    os._exit(42)

os.link = killed
log.write_report(Path("r.json"), "{}")
"""


def test_a_report_write_cut_short_leaves_no_file_behind(tmp_path):
    """A script whose SIGTERM handler ends the process with os._exit while a report was written left a hidden
    .bnsurgeon-report-*.tmp behind (5 kills in 6). The report is written to a file with no name until it is
    linked."""
    from _forked import run_python

    done = run_python(KILLED_WHILE_WRITING, cwd=tmp_path)
    assert done.returncode == 42, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_report_name_is_judged_by_its_own_length(tmp_path, cli):
    """300 bytes: the name is the problem, one line (before: a traceback); 245 bytes fits with room for
    NAME.999.json, and is written (before: refused with advice about the directory, by a longer probe name)."""
    script = tmp_path / "train.py"
    script.write_text("from torch import nn\nnn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))\n")
    result = cli.invoke(app, ["run", "--report", str(tmp_path / ("r" * 295 + ".json")), str(script)])
    assert result.exit_code == 8, result.output
    assert "file name is too long" in result.output and "Traceback" not in result.output
    put_back()
    fits = tmp_path / ("r" * 240 + ".json")
    result = cli.invoke(app, ["run", "--report", str(fits), str(script)])
    assert result.exit_code == 0, result.output
    assert json.loads(fits.read_text())["target"] == "sync"


# C. bnsurgeon's own I/O never changes how the script behaves


class _Broken:
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


class _NoFlush:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text


class _Raising:
    """A script's own stderr wrapper that raises what no I/O error is."""

    def write(self, text):
        raise NotImplementedError("no write")

    def flush(self):
        pass


@pytest.mark.parametrize("stream", [_Broken(), _NoFlush(), _Raising(), "closed"])
def test_the_summary_line_never_stops_the_script(tmp_path, monkeypatch, stream):
    if stream == "closed":
        stream = open(os.devnull, "w")  # noqa: SIM115
        stream.close()
    monkeypatch.setattr(sys, "stderr", stream)
    marker = tmp_path / "trained"
    _run(
        tmp_path,
        """
        import sys
        from torch import nn
        nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)))
        open(sys.argv[1], "w").write("trained")
        """,
        str(marker),
    )
    assert marker.read_text() == "trained"


def test_writing_the_report_takes_no_lock_and_holds_no_signal(tmp_path):
    """Another process holding the directory's lock no longer makes the conversion wait (a SIGTERM meanwhile
    reached bnsurgeon's handler, not the script's)."""
    import fcntl

    handle = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(handle, fcntl.LOCK_EX)
    log = ConversionLog(quiet=True, report_path=tmp_path / "r.json")
    writer = threading.Thread(target=log.record, args=("torch", "train.py:1", Report(target="sync")), daemon=True)
    try:
        writer.start()
        writer.join(60)
        assert not writer.is_alive()
    finally:
        os.close(handle)
    assert (tmp_path / "r.json").exists()


# D and G: children's rules, and a refusal in a child

RULES = """
    from bnsurgeon.rules import Rule, to_frozen, to_plain, to_sync
    from torch import nn

    class {name}(nn.BatchNorm2d):
        pass

    RULES = [Rule("{name}", ({name},), {{"sync": to_sync, "plain": to_plain, "frozen": to_frozen}})]
"""

CHILD_WITH_RULES = """
    import os, subprocess, sys
    os.chdir(sys.argv[1])  # as Hydra does
    child = "import sys, torch; from bnsurgeon.rules import default_registry; "
    child += "print([r.name for r in default_registry() if r.name in ('Mine', 'Other')], sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", child, "x"], capture_output=True, text=True)
    open(sys.argv[2], "w").write(done.stdout + done.stderr)
"""


def test_children_load_the_runs_rules_from_where_the_run_loaded_them(tmp_path, monkeypatch):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    (run_dir / "my_rules.py").write_text(textwrap.dedent(RULES.format(name="Mine")))
    (elsewhere / "my_rules.py").write_text(textwrap.dedent(RULES.format(name="Other")))
    monkeypatch.chdir(run_dir)
    out = tmp_path / "child.txt"
    try:
        _run(tmp_path, CHILD_WITH_RULES, str(elsewhere), str(out), quiet=True, rules=["my_rules:RULES"])
    finally:
        sys.modules.pop("my_rules", None)
    assert out.read_text().strip() == "['Mine'] ['x']", out.read_text()


UNHANDLED_CHILD = """
    import subprocess, sys
    child = "import torch; from torch import nn\\nclass MyBN(nn.BatchNorm2d): pass\\n"
    child += "nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(MyBN(2)))"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    open(sys.argv[1], "w").write(f"{done.returncode}\\n{done.stderr}")
"""


def test_a_rules_file_named_like_a_module_loaded_before_it_is_named_not_ignored(tmp_path):
    """A timeit.py of rules: the standard library's timeit was imported first, so the file was never read, and the
    message said "timeit has no 'RULES'"."""
    from bnsurgeon.core.errors import ShadowedModuleError
    from bnsurgeon.rules import use_rules

    (tmp_path / "timeit.py").write_text("RULES = []\n")
    with pytest.raises(ShadowedModuleError, match=r"'timeit' is .*timeit.py, imported before your .*so your rules"):
        use_rules(["timeit:RULES"], directory=str(tmp_path))
    (tmp_path / "json").mkdir()  # a package of rules named like one: its module is "not found" in the other
    (tmp_path / "json" / "bn_rules.py").write_text("RULES = []\n")
    with pytest.raises(ShadowedModuleError, match=r"'json' is .*imported before your .*json") as raised:
        use_rules(["json.bn_rules:RULES"], directory=str(tmp_path))
    assert "(my_bn_rules, say)" in raised.value.hint  # a package is renamed as a directory, not to a .py
    both = tmp_path / "both"  # a package and a module of one name: python imports the package, as the check reads
    (both / "twin_rules_pkg").mkdir(parents=True)
    (both / "twin_rules_pkg" / "__init__.py").write_text("RULES = []\n")
    (both / "twin_rules_pkg.py").write_text("")
    try:
        use_rules(["twin_rules_pkg:RULES"], directory=str(both))
    finally:
        sys.modules.pop("twin_rules_pkg", None)


@pytest.mark.parametrize(
    "source, fix",
    [
        ("def (:\n", "fix the error in broken_rules_here"),
        ("import no_such_module_anywhere\n", "fix the error in broken_rules_here"),
        (None, "run from the directory that holds it"),
    ],
    ids=["syntax", "its-own-import", "missing"],
)
def test_a_rules_module_that_fails_as_it_is_imported_is_told_to_fix_it_not_to_move(tmp_path, source, fix):
    """It was found and failed: the advice was "run from the directory that holds it, or install it"."""
    from bnsurgeon.core.errors import SourceNotFoundError
    from bnsurgeon.rules import use_rules

    if source is not None:
        (tmp_path / "broken_rules_here.py").write_text(source)
    with pytest.raises(SourceNotFoundError) as raised:
        use_rules(["broken_rules_here:RULES"], directory=str(tmp_path))
    assert raised.value.hint.startswith(fix), raised.value.hint
    sys.modules.pop("broken_rules_here", None)


def test_a_refusal_in_a_child_is_one_line_and_exit_7_as_in_the_run(tmp_path):
    out = tmp_path / "child.txt"
    _run(tmp_path, UNHANDLED_CHILD, str(out), quiet=True)
    code, _, stderr = out.read_text().partition("\n")
    assert code == "7", stderr
    assert "MyBN" in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) <= 2, stderr


def test_a_script_path_python_cannot_open_is_said_in_pythons_words_and_the_script_as_report_comes_first(tmp_path, cli):
    """s.py/ was "no such file or directory" (python: Not a directory); --report train.py train.py was told to
    pass --force, which could never make it usable."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = cli.invoke(app, ["run", f"{script}/"])
    assert result.exit_code == 2 and "Not a directory" in result.output, result.output
    result = cli.invoke(app, ["run", "--report", str(script), str(script)])
    assert result.exit_code == 8 and "would write over the script" in result.output, result.output
    assert "--force" not in result.output.split("fix:")[-1].replace("--force or not", "")


def test_a_bad_report_is_refused_before_a_packages_init_runs(tmp_path, monkeypatch, cli):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("open('init-ran', 'w').write('yes')\n")
    (package / "train.py").write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)
    result = cli.invoke(app, ["run", "--report", str(tmp_path / "missing" / "r.json"), "-m", "pkg.train"])
    assert result.exit_code == 8, result.output
    assert not (tmp_path / "init-ran").exists()


# F. timm:NAME


def test_timm_prefix_always_means_timm_even_where_such_a_file_exists(tmp_path, monkeypatch):
    from bnsurgeon.loading.resolve import resolve_source

    monkeypatch.chdir(tmp_path)
    Path("timm:test_resnet").write_text("a pull request's file")
    assert resolve_source("timm:test_resnet").kind == resolve_source("test_resnet").kind != "checkpoint"


# H. a replacement kept after the run


def test_a_converter_the_script_kept_is_torchs_once_run_script_returns(tmp_path):
    report = tmp_path / "r.json"
    body = """
        import builtins
        from torch import nn
        builtins.kept = {"convert": nn.SyncBatchNorm.convert_sync_batchnorm}
        """
    import builtins

    try:
        _run(tmp_path, body, quiet=True, report=report)
        converted = builtins.kept["convert"](nn.Sequential(nn.BatchNorm2d(2)))  # type: ignore[attr-defined]
    finally:
        vars(builtins).pop("kept", None)
    assert type(converted[0]) is nn.SyncBatchNorm and not isinstance(converted[0], SyncBatchNorm)
    assert not report.exists()
    assert torch.is_tensor(converted[0].weight)
