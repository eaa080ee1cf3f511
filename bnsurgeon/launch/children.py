"""Python processes the script starts inherit the replaced converters, as coverage.py measures subprocesses.

Lightning's ``Trainer(devices=N)`` without torchrun starts ranks 1.. as ``python SCRIPT`` (its subprocess
launcher), ``strategy="ddp_spawn"`` and a script's own ``torch.multiprocessing.spawn`` start fresh
interpreters: none of them runs ``bnsurgeon run``, so each would get torch's converter while rank 0 has
bnsurgeon's (on CPU a ValueError; on GPU mixed layers, a hang or wrong statistics). While a script runs,
``bnsurgeon run`` sets ``BNSURGEON_RUN`` (the run's settings, as JSON) and puts ``_child/`` first on
``PYTHONPATH``; its ``sitecustomize.py`` runs in every Python process started with that environment, calls
``start_child`` when the variable is set, and then runs any ``sitecustomize`` of the user's that it hides.
A child that cannot install the replacements stops at start-up with one line, never trains with a mix.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from bnsurgeon.launch.converters import ConversionLog, install

#: the run's settings, for the Python processes the script starts
ENV = "BNSURGEON_RUN"
#: the directory whose sitecustomize.py starts them
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child")


def child_environment(log: ConversionLog, rules: Sequence[str]) -> Callable[[], None]:
    """Set the environment the script's child processes start with; returns the undo."""
    saved = {name: os.environ.get(name) for name in (ENV, "PYTHONPATH")}
    settings = {
        "allow_unhandled": log.allow_unhandled,
        "report": None if log.report_path is None else str(log.report_path),
        "quiet": log.quiet,
        "rules": list(rules),
    }
    os.environ[ENV] = json.dumps(settings, allow_nan=False)
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
    """In a process the script started: the run's rules and replaced converters, for the rest of the process."""
    from bnsurgeon.rules import use_rules

    values = json.loads(text)
    report = values.get("report")
    log = ConversionLog(
        allow_unhandled=bool(values.get("allow_unhandled")),
        report_path=None if report is None else Path(report),
        quiet=bool(values.get("quiet")),
    )
    rules = values.get("rules") or []
    if rules:
        use_rules(rules)
    install(log)


def refuse(error: BaseException) -> None:
    """A child that cannot do the run's conversion stops before the script's code runs."""
    sys.stderr.write(
        f"bnsurgeon run: this child process cannot use bnsurgeon's converters ({type(error).__name__}: {error}); "
        "stopping it rather than training with torch's (run under torchrun instead)\n"
    )
    sys.stderr.flush()
    os._exit(1)
