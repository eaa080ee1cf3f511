"""Run a script, or a module, as ``__main__`` the way ``python SCRIPT`` / ``python -m MODULE`` does,
with every known sync-BN converter replaced by bnsurgeon's (``converters.py``).

What the script sees is what ``python`` gives it: ``__name__ == "__main__"``, ``__file__`` (absolute,
as Python 3.9+ sets it), ``sys.argv`` (the script and its arguments), ``sys.path[0]`` (the script's
real directory, or the working directory for ``-m``; untouched under ``python -P``) and
``sys.modules["__main__"]``, through the standard library's ``runpy``. Its exit is its own: a
``SystemExit`` passes through unchanged, and any other exception comes back as ``ScriptRaised``,
whose traceback starts at the script's first frame (bnsurgeon's and runpy's are cut off).
Differences from ``python``: ``sys.argv[0]`` is the script's absolute path (runpy sets it to the path
it runs), and ``python -m``'s two ``<frozen runpy>`` frames are not in a module's traceback.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Sequence

from bnsurgeon.core.errors import OutputError, UsageError
from bnsurgeon.launch.converters import ConversionLog, patched_converters

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_RUNPY = os.path.abspath(runpy.__file__)


class ScriptRaised(Exception):
    """The script raised ``error`` (not bnsurgeon): the caller shows it as Python shows an uncaught
    exception, and exits as Python would."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error

    @property
    def interrupted(self) -> bool:
        """Ctrl-C in the script: Python's exit for it is death by SIGINT, not status 1."""
        return isinstance(self.error, KeyboardInterrupt)

    def show(self) -> None:
        """The traceback through ``sys.excepthook``, as Python prints it (a hook the script set is used)."""
        error = self.error
        sys.excepthook(type(error), error, error.__traceback__)


def _ours(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or filename in (_RUNPY, "<frozen runpy>")


def without_our_frames(error: BaseException) -> BaseException:
    """``error`` with the leading traceback entries of bnsurgeon and runpy removed (a SyntaxError in
    the script keeps none: Python prints it without a traceback too)."""
    tb = error.__traceback__
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return error.with_traceback(tb)


def _module_found(name: str) -> bool:
    """Whether ``python -m name`` would find it (imports its parent packages, as ``python -m`` does)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def run_script(
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    allow_unhandled: bool = False,
    report: Path | None = None,
    quiet: bool = False,
) -> ConversionLog:
    """Run ``target`` (a script path, or a module name with ``module=True``) with ``args`` as ``__main__``,
    every known sync-BN converter doing bnsurgeon's exact conversion while it runs.

    Returns the log of the conversions when the script ends normally. Raises what the script
    raises as ``ScriptRaised`` (``SystemExit`` unchanged); a converter's refusal (a BN-like class no
    rule claims, unless ``allow_unhandled``; an uninitialized lazy BN) as the ``BnSurgeonError`` it
    is; ``UsageError`` for a script or module that does not exist, ``OutputError`` for a ``report``
    path whose directory does not exist. On rank 0, each conversion prints one summary line on
    stderr (unless ``quiet``) and writes its JSON report to ``report`` (the second to
    ``NAME.2.json``, ...).
    """
    if not module and not os.path.exists(target):
        raise UsageError(f"cannot open the script {target!r}: no such file or directory", "check the path")
    if report is not None and not Path(report).parent.is_dir():
        raise OutputError(
            f"--report {report}: the directory {str(Path(report).parent)!r} does not exist", "create it first"
        )
    log = ConversionLog(allow_unhandled=allow_unhandled, report_path=report, quiet=quiet)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [target, *args]
    runs_a_file = not module and os.path.isfile(target)
    if not getattr(sys.flags, "safe_path", False) and sys.path:  # python -P (3.11+) adds no directory
        if module:
            sys.path[0] = os.getcwd()
        elif runs_a_file:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
        else:  # a directory or zip with __main__.py: runpy puts the path itself first, as python does
            del sys.path[0]
    found = True
    try:
        with patched_converters(log):
            try:
                if module:
                    found = _module_found(target)
                    if found:
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(os.path.abspath(target) if runs_a_file else target, run_name="__main__")
            except SystemExit:
                raise
            except BaseException as error:  # noqa: B036 - the script's own, KeyboardInterrupt included: shown as python does
                if error is log.refusal:
                    raise
                raise ScriptRaised(without_our_frames(error)) from None
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    if not found:
        raise UsageError(f"no module named {target!r}", "check the name, and run from the directory that holds it")
    return log
