"""Python processes the script starts inherit the replaced converters, as coverage.py measures subprocesses.

Lightning's ``Trainer(devices=N)`` without torchrun starts ranks 1.. as ``python SCRIPT`` (its subprocess
launcher), ``strategy="ddp_spawn"`` and a script's own ``torch.multiprocessing.spawn`` start fresh
interpreters: none of them runs ``bnsurgeon run``, so each would get torch's converter while rank 0 has
bnsurgeon's (on CPU a ValueError; on GPU mixed layers, a hang or wrong statistics). While a script runs,
``bnsurgeon run`` sets ``BNSURGEON_RUN`` (the run's settings, as JSON, with the run's own token, pid and start
time), and writes a start hook for this run into the interpreter's own site-packages
(``zz-bnsurgeon-run-PID-START-TOKEN.pth``), which calls ``start_child`` in every process of that interpreter
whose ``BNSURGEON_RUN`` carries the run's token, and is removed when the run ends. coverage.py's
``patch = subprocess`` is the model (a ``.pth`` written for the run, not one left in site-packages): no file
pip does not own outlives the run, and a process no live run started (a leaked or hand-set ``BNSURGEON_RUN``,
a run that ended) behaves exactly as without bnsurgeon. A run that was killed leaves its file, inert (its run
is not alive), removed by the next run of that interpreter. Other interpreters (the system ``python3``, a tool's
own venv) never see it. Where bnsurgeon is not importable from site-packages (a source checkout on
``PYTHONPATH``), the hook names the directory it imports bnsurgeon from, so ``-E`` and ``-I`` children get it
too. Where site-packages cannot be written, the older bootstrap is used: ``_child/`` first on ``PYTHONPATH``,
whose ``sitecustomize.py`` does the same and then runs any ``sitecustomize`` of the user's that it hides
(``-E`` and ``-I`` children ignore it: docs/training-scripts.md says so).

``start_child`` imports no torch: the converters are replaced the moment torch (timm, Lightning, mmengine)
is imported, and ``--rules`` load then, from the directory the run loaded them from. A child that cannot
do the run's conversion stops with one line, never trains with a mix.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from bnsurgeon.core.after_import import after_import
from bnsurgeon.core.processes import live_run, start_time, still_running
from bnsurgeon.launch.converters import ConversionLog, install
from bnsurgeon.launch.log import say

#: the run's settings, for the Python processes the script starts
ENV = "BNSURGEON_RUN"
#: the directory whose sitecustomize.py starts them
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child")
#: a run's start hook in site-packages: site reads .pth files in name order, and this sorts after those that put
#: bnsurgeon itself on the path (an editable install's __editable__.*.pth, easy-install.pth, conda.pth)
HOOK_PREFIX = "zz-bnsurgeon-run-"
#: the one hook earlier bnsurgeon versions left in site-packages for good (removed where it holds exactly their line)
LEGACY_HOOKS = {
    "zz-bnsurgeon-run.pth": "import os; os.environ.get('BNSURGEON_RUN') and __import__('bnsurgeon.launch._child.start')\n",
    "bnsurgeon-run.pth": "import os; os.environ.get('BNSURGEON_RUN') and __import__('bnsurgeon.launch._child.start')\n",
}

#: what a hook runs where the variable carries its run's token: the run's bnsurgeon (from ``root`` where
#: site-packages does not have it), or one line and exit 1 where it cannot be imported while the run lives
_HOOK_CODE = """
def start(root, pid):
    added = bool(root) and root not in sys.path
    if added:
        sys.path.append(root)
    try:
        __import__('bnsurgeon.launch._child.start')
    except BaseException as error:
        if os.name == 'posix':
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except OSError:
                pass
        sys.stderr.write('bnsurgeon run: cannot import bnsurgeon in this child process (%s)\\n' % (error,))
        sys.stderr.flush()
        os._exit(1)
    finally:
        if added and sys.path and sys.path[-1] == root:
            del sys.path[-1]
"""


def hook_text(token: str, root: str | None, pid: int) -> str:
    """A run's start hook: one line (site runs a .pth line that starts with "import"), in a namespace of its own
    (nothing is left in site's), that does nothing unless ``BNSURGEON_RUN`` carries this run's token."""
    code = f"{_HOOK_CODE}start({root!r}, {pid})\n"
    return f"import os, sys; {token!r} in os.environ.get({ENV!r}, '') and exec({code!r}, {{'os': os, 'sys': sys}})\n"


def _importable_from(directory: Path) -> bool:
    """Whether the bnsurgeon this process runs is importable through ``directory`` (site-packages) alone, without
    ``PYTHONPATH``: installed there, or installed editable (a .pth there, or setuptools' finder it installs)."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if root == os.path.realpath(directory):
        return True
    editable = "__editable___bnsurgeon"  # setuptools' finder module for an editable install (a class on meta_path)
    if any(str(getattr(finder, "__module__", "")).startswith(editable) for finder in sys.meta_path):
        return True
    with contextlib.suppress(OSError):
        for pth in directory.glob("*.pth"):
            lines = pth.read_text(encoding="utf-8", errors="replace").splitlines()
            if any(os.path.realpath(os.path.join(directory, line.strip())) == root for line in lines if line.strip()):
                return True
    return False


def write_start_hook(token: str, pid: int, started: str | None) -> Path | None:
    """This run's start hook in this interpreter's own site-packages; None where that cannot be written (the
    PYTHONPATH bootstrap is used then). Hooks of runs that no longer live, and the one earlier versions left, are
    removed first."""
    import site
    import sysconfig
    import tempfile

    directory = Path(sysconfig.get_paths()["purelib"])
    processed = {os.path.realpath(entry) for entry in site.getsitepackages()}
    if os.path.realpath(directory) not in processed:
        return None
    root = None if _importable_from(directory) else os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    hook = directory / f"{HOOK_PREFIX}{pid}-{started or 0}-{token}.pth"
    try:
        _remove_dead_hooks(directory)
        handle, temp = tempfile.mkstemp(dir=directory, prefix=".bnsurgeon-run-", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(hook_text(token, None if root is None else os.path.abspath(root), pid))
            os.chmod(temp, 0o644)
            os.replace(temp, hook)
        finally:
            if os.path.lexists(temp):
                os.unlink(temp)
    except OSError:
        return None
    return hook


def _remove_dead_hooks(directory: Path) -> None:
    """The hooks of runs that were killed (their pid gone, or another process's now), and the one hook earlier
    versions left for good where it holds exactly their line; never a file of a run that lives, nor another's."""
    for name, text in LEGACY_HOOKS.items():
        with contextlib.suppress(OSError):
            if (directory / name).read_text(encoding="utf-8") == text:
                (directory / name).unlink()
    for hook in directory.glob(f"{HOOK_PREFIX}*.pth"):
        pid, _, rest = hook.name[len(HOOK_PREFIX) :].partition("-")
        started = rest.partition("-")[0]
        if pid.isdigit() and started.isdigit() and not still_running(int(pid), None if started == "0" else started):
            with contextlib.suppress(OSError):
                hook.unlink()


def child_environment(
    log: ConversionLog, rules: Sequence[str], gaps: dict[str, Any] | None = None
) -> Callable[[], None]:
    """Set the environment the script's child processes start with, and this run's start hook; returns the undo,
    which removes the hook. ``gaps``: ``--stats``, for the ranks among them (they record, and rank 0 writes)."""
    saved = {name: os.environ.get(name) for name in (ENV, "PYTHONPATH")}
    token, pid = secrets.token_hex(16), os.getpid()
    started = start_time(pid)
    settings = {
        "run": token,
        "pid": pid,
        "started": started,
        "allow_unhandled": log.allow_unhandled,
        "report": None if log.report_path is None else str(log.report_path),
        "quiet": log.quiet,
        "rules": list(rules),
        "rules_directory": os.getcwd(),  # where the run loaded them from, whatever a child's directory
        "rank": os.environ.get("RANK"),  # the run's own: a child that sees the same only inherited it
        "stats": gaps,
    }
    os.environ[ENV] = json.dumps(settings, allow_nan=False)
    hook = write_start_hook(token, pid, started)
    if hook is None:
        path = saved["PYTHONPATH"]
        entries = [] if not path else path.split(os.pathsep)
        if BOOTSTRAP not in entries:
            os.environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP, *entries])

    def remove_hook() -> None:
        if hook is not None and os.getpid() == pid:  # not a fork of the run that exits while the run goes on
            with contextlib.suppress(OSError):
                hook.unlink()

    import atexit

    # the command line leaves the run's environment for the script's threads and exit handlers: registered before
    # theirs, this runs after them, so a child they start still gets the hook
    atexit.register(remove_hook)

    def undo() -> None:
        remove_hook()
        atexit.unregister(remove_hook)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return undo


def start_child(text: str) -> None:
    """In a process the script started: the run's replaced converters for the rest of the process, and its rules
    once torch is imported (importing them imports torch: a child that never does runs as under python). Nothing
    where ``text`` is not the settings of a run that lives."""
    values = live_run(text)
    if values is None:
        return
    if values.get("rank") != os.environ.get("RANK"):  # this child's own RANK is what its children inherit
        os.environ[ENV] = json.dumps({**values, "rank": os.environ.get("RANK")}, allow_nan=False)
    report = values.get("report")
    log = ConversionLog(
        allow_unhandled=bool(values.get("allow_unhandled")),
        report_path=None if report is None else Path(report),
        quiet=bool(values.get("quiet")),
        child=True,
        run_rank=None if values.get("rank") is None else str(values.get("rank")),
    )
    rules = [str(spec) for spec in values.get("rules") or []]
    if rules:
        directory = values.get("rules_directory")

        def load_rules(_: str, __: ModuleType) -> None:
            from bnsurgeon.rules import use_rules

            try:
                use_rules(rules, directory=str(directory) if directory else None)
            except BaseException as error:  # noqa: B036 - the child must not train without the run's rules
                refuse(error)

        after_import(["torch"], load_rules)
    install(log)
    _refusals_in_one_line(log)
    _record_gaps(values.get("stats"))


def _record_gaps(stats: Any) -> None:
    """``--stats`` in a child (a rank Lightning's launcher or the script's spawn started): it records as the run's
    own process does, and writes if it is rank 0. Settings that are not the run's are ignored."""
    if not isinstance(stats, dict) or not isinstance(stats.get("path"), str):
        return
    steps, layers = stats.get("steps"), stats.get("layers") or []
    if not isinstance(steps, int) or steps < 1 or not all(isinstance(layer, str) for layer in layers):
        return
    from bnsurgeon.launch.gaps import start_recording_gaps

    start_recording_gaps(
        Path(stats["path"]),
        steps,
        layers,
        quiet=bool(stats.get("quiet")),
        source=str(stats.get("source") or ""),
        child=True,
    )


def _refusals_in_one_line(log: ConversionLog) -> None:
    """A replaced converter's refusal (a BN class no rule claims) that ends the child uncaught ends it as it ends
    the run's own process: one line and the error's exit code (7), not the script's traceback and exit 1. The code
    is given after every other exit handler has run (this one is registered first, so it runs last). A worker whose
    own wrapper catches the error (torch.multiprocessing.spawn's, multiprocessing's) reports it as that wrapper
    does: its traceback, and the parent's own error."""
    import atexit

    from bnsurgeon.core.errors import BnSurgeonError

    ending: list[int] = []
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: object) -> None:
        if error is log.refusal and isinstance(error, BnSurgeonError):
            say(f"error: {error.message}")
            if error.hint:
                say(f"  fix: {error.hint}")
            ending.append(error.exit_code)
            return
        previous(kind, error, traceback)  # type: ignore[arg-type]

    def exit_with_the_code() -> None:
        if ending:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(ending[0])

    atexit.register(exit_with_the_code)
    sys.excepthook = hook


def refuse(error: BaseException) -> None:
    """A child that cannot do the run's conversion stops before the script's code runs."""
    sys.stderr.write(
        f"bnsurgeon run: this child process cannot use bnsurgeon's converters ({type(error).__name__}: {error}); "
        "stopping it rather than training with torch's (run under torchrun instead)\n"
    )
    sys.stderr.flush()
    os._exit(1)
