"""Python processes the script starts inherit the replaced converters, as coverage.py measures subprocesses.

Lightning's ``Trainer(devices=N)`` without torchrun starts ranks 1.. as ``python SCRIPT`` (its subprocess
launcher), ``strategy="ddp_spawn"`` and a script's own ``torch.multiprocessing.spawn`` start fresh
interpreters: none of them runs ``bnsurgeon run``, so each would get torch's converter while rank 0 has
bnsurgeon's (on CPU a ValueError; on GPU mixed layers, a hang or wrong statistics). While a script runs,
``bnsurgeon run`` sets ``BNSURGEON_RUN`` (the run's settings, as JSON), and a start hook in the
interpreter's own site-packages (``zz-bnsurgeon-run.pth``, written there once, inert without the variable)
calls ``start_child`` in every process of that interpreter: other interpreters (the system ``python3``, a
tool's own venv) never see it, and run exactly as under python. Where site-packages cannot be written, the
older bootstrap is used: ``_child/`` first on ``PYTHONPATH``, whose ``sitecustomize.py`` does the same and
then runs any ``sitecustomize`` of the user's that it hides.

``start_child`` imports no torch: the converters are replaced the moment torch (timm, Lightning, mmengine)
is imported, and ``--rules`` load then, from the directory the run loaded them from. A child that cannot do
the run's conversion stops with one line, never trains with a mix.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

from bnsurgeon.core.after_import import after_import
from bnsurgeon.launch.converters import ConversionLog, install
from bnsurgeon.launch.log import say

#: the run's settings, for the Python processes the script starts
ENV = "BNSURGEON_RUN"
#: the directory whose sitecustomize.py starts them
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child")


#: the start hook's file and its one line (site runs a .pth line that starts with "import"). site reads the .pth
#: files in name order: this one sorts after those that put bnsurgeon itself on the path (an editable install's
#: __editable__.*.pth or bnsurgeon.pth, easy-install.pth, conda.pth), so its import finds bnsurgeon
START_HOOK = "zz-bnsurgeon-run.pth"
#: the name an earlier bnsurgeon gave the hook (it sorted before some of those): replaced by START_HOOK
OLD_START_HOOK = "bnsurgeon-run.pth"
HOOK_LINE = f"import os; os.environ.get({ENV!r}) and __import__('bnsurgeon.launch._child.start')\n"


def start_hook_directory() -> Path | None:
    """Where this interpreter's processes find the start hook: its own site-packages (written there if it is not
    yet); None where that cannot be written (the PYTHONPATH bootstrap is used then)."""
    import site
    import sysconfig
    import tempfile

    directory = Path(sysconfig.get_paths()["purelib"])
    processed = {os.path.realpath(entry) for entry in site.getsitepackages()}
    if os.path.realpath(directory) not in processed:
        return None
    hook = directory / START_HOOK
    try:
        (directory / OLD_START_HOOK).unlink(missing_ok=True)
        if hook.is_file() and hook.read_text(encoding="utf-8") == HOOK_LINE:
            return directory
        handle, temp = tempfile.mkstemp(dir=directory, prefix=".bnsurgeon-run-", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(HOOK_LINE)
            os.chmod(temp, 0o644)
            os.replace(temp, hook)
        finally:
            if os.path.lexists(temp):
                os.unlink(temp)
    except OSError:
        return None
    return directory


def child_environment(log: ConversionLog, rules: Sequence[str]) -> Callable[[], None]:
    """Set the environment the script's child processes start with; returns the undo."""
    saved = {name: os.environ.get(name) for name in (ENV, "PYTHONPATH")}
    settings = {
        "allow_unhandled": log.allow_unhandled,
        "report": None if log.report_path is None else str(log.report_path),
        "quiet": log.quiet,
        "rules": list(rules),
        "rules_directory": os.getcwd(),  # where the run loaded them from, whatever a child's directory
        "rank": os.environ.get("RANK"),  # the run's own: a child that sees the same only inherited it
    }
    os.environ[ENV] = json.dumps(settings, allow_nan=False)
    if start_hook_directory() is None:
        path = saved["PYTHONPATH"]
        entries = [] if not path else path.split(os.pathsep)
        if BOOTSTRAP not in entries:
            os.environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP, *entries])

    def undo() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return undo


def start_child(text: str) -> None:
    """In a process the script started: the run's replaced converters for the rest of the process, and its rules
    once torch is imported (importing them imports torch: a child that never does runs as under python)."""
    values = json.loads(text)
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
