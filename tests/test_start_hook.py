"""``bnsurgeon run``'s start hook leaves nothing behind, and a process no live run started never sees it.

The hook is written for one run into the interpreter's site-packages and removed when the run ends; it acts
only where ``BNSURGEON_RUN`` carries that run's token and the run still lives. Before: one hook stayed in
site-packages for good (it outlived ``pip uninstall``), any process of the venv with ``BNSURGEON_RUN`` set to
something else (``1``, a truncated value) exited 1 before its first line, a value leaked from a finished run
gave unrelated programs that run's converters, and where bnsurgeon was importable only through ``PYTHONPATH``
the hook was written into a venv without it: ``-E``/``-I`` children printed site's traceback and trained with
torch's layers. These run short subprocesses that import no torch, in this venv and in a bare venv that sees
this one's packages but not bnsurgeon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(sysconfig.get_paths()["purelib"])
PROBE = "import sys; print('bnsurgeon.launch.children' in sys.modules)"

SCRIPT = """
    import json, os, subprocess, sys, sysconfig
    from pathlib import Path
    site = Path(sysconfig.get_paths()["purelib"])
    children = {flag or "plain": subprocess.run([sys.executable, *([flag] if flag else []), "-c", sys.argv[2]],
                capture_output=True, text=True) for flag in ("", "-E", "-I")}
    Path(sys.argv[1]).write_text(json.dumps({
        "pid": os.getpid(),
        "hooks": sorted(p.name for p in site.glob("zz-bnsurgeon-run*.pth") if f"-{os.getpid()}-" in p.name),
        "children": {k: [v.returncode, v.stdout, v.stderr] for k, v in children.items()},
        "variable": os.environ.get("BNSURGEON_RUN"),
        "paths": json.loads(subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                            capture_output=True, text=True).stdout),
    }))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BNSURGEON_", "PYTHONPATH"))}
    env.update(extra)
    return env


def _run_script(python: str, tmp_path: Path, **env: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "seen.json"
    done = subprocess.run(
        [python, "-m", "bnsurgeon", "run", "-q", str(script), str(out), PROBE],
        cwd=tmp_path,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _plain(python: str, value: str, **env: str) -> subprocess.CompletedProcess:
    code = "import sys; print(1, 'bnsurgeon' in sys.modules)"
    return subprocess.run(
        [python, "-c", code], env=_env(BNSURGEON_RUN=value, **env), capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv whose site-packages sees this venv's packages (torch, typer, ...) but not bnsurgeon: bnsurgeon is
    importable only through PYTHONPATH, as in a source checkout."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "borrowed.pth").write_text(f"{SITE}\n")  # a path line: the packages, not the .pth files beside them
    probe = subprocess.run(
        [str(python), "-c", "import bnsurgeon"], cwd=where, env=_env(), capture_output=True, timeout=60
    )
    assert probe.returncode != 0, "the bare venv must not see bnsurgeon without PYTHONPATH"
    return python


def test_a_run_leaves_no_hook_and_a_leaked_or_hand_set_variable_does_nothing(tmp_path):
    """Children of the run get bnsurgeon's start (-E and -I ones too); once it ends its hook is gone, and a process
    with BNSURGEON_RUN set to anything (a value leaked from the run, truncated, `1`, `[]`) runs as under python,
    imports no bnsurgeon and says nothing, also with the PYTHONPATH bootstrap on its path."""
    seen = _run_script(sys.executable, tmp_path)
    for flag, (code, out, err) in seen["children"].items():
        assert (code, out.strip()) == (0, "True"), (flag, err)
    assert len(seen["hooks"]) == 1, seen["hooks"]
    assert not (SITE / seen["hooks"][0]).exists()
    assert not (SITE / "zz-bnsurgeon-run.pth").exists()
    leaked = seen["variable"]
    from bnsurgeon.launch.children import BOOTSTRAP

    alive_without_start = json.dumps({"run": "x", "pid": 1, "started": None})  # hand-made: pid 1 lives
    for value in (leaked, leaked[: len(leaked) // 2], "1", "[]", "{}", "null", alive_without_start):
        for env in ({}, {"PYTHONPATH": BOOTSTRAP}):
            done = _plain(sys.executable, value, **env)
            assert (done.returncode, done.stdout, done.stderr) == (0, "1 False\n", ""), (value, env, done.stderr)


def test_where_bnsurgeon_is_importable_only_through_pythonpath_every_child_gets_it(bare_venv, tmp_path):
    """The hook in a venv without bnsurgeon names where the run imported it from: -E and -I children (which ignore
    PYTHONPATH) start as the run's other children do, with no site traceback; nothing stays in that venv."""
    seen = _run_script(str(bare_venv), tmp_path, PYTHONPATH=str(ROOT))
    for flag, (code, out, err) in seen["children"].items():
        assert (code, out.strip(), err) == (0, "True", ""), (flag, err)
    path_of = "import json, sys; print(json.dumps(sys.path))"
    plain = subprocess.run(
        [str(bare_venv), "-c", path_of],
        cwd=tmp_path,
        env=_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seen["paths"] == json.loads(plain.stdout)  # the hook left the child's sys.path as python gives it
    site = Path(
        subprocess.run(
            [str(bare_venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    assert sorted(p.name for p in site.glob("*.pth")) == ["borrowed.pth"]


def test_a_killed_runs_hook_is_inert_and_the_next_run_removes_it(bare_venv, tmp_path):
    """A run killed before its clean-up leaves its hook: a process carrying that run's variable (its token) runs as
    under python, since the run is gone; the next run of that interpreter removes the file."""
    from bnsurgeon.launch.children import HOOK_PREFIX, hook_text

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    site = Path(
        subprocess.run(
            [str(bare_venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    token = "f" * 32
    hook = site / f"{HOOK_PREFIX}{gone.pid}-0-{token}.pth"
    hook.write_text(hook_text(token, str(ROOT), gone.pid))
    leaked = json.dumps({"run": token, "pid": gone.pid, "started": None, "rank": None})
    done = _plain(str(bare_venv), leaked)
    assert (done.returncode, done.stdout.split()[0], done.stderr) == (0, "1", ""), done.stderr
    _run_script(str(bare_venv), tmp_path, PYTHONPATH=str(ROOT))
    assert not hook.exists()
