"""Run a script, or a module, as ``__main__`` the way ``python SCRIPT`` / ``python -m MODULE`` does,
with every known sync-BN converter replaced by bnsurgeon's (``converters.py``), in this process and in
the Python processes the script starts (``children.py``).

What the script sees is what ``python`` gives it: a fresh ``__main__`` module in ``sys.modules`` with
``__file__`` (absolute, as Python 3.9+ sets it), ``__loader__`` and ``__package__`` as python sets them
(``__spec__`` for ``-m``), ``sys.argv`` (the script as given, or the module's file, and its arguments),
``sys.path[0]`` (the script's real directory, or the working directory for ``-m``; untouched under
``python -P``). Its exit is its own: a ``SystemExit`` passes through unchanged, and any other exception
comes back as ``ScriptRaised``, whose traceback starts at the script's first frame (bnsurgeon's and
runpy's are cut off). A target python would refuse (a directory without ``__main__.py``, a package
without ``__main__``) is ``ScriptNotRunnable`` with python's message. One difference: ``python -m``'s
two ``<frozen runpy>`` frames are not in a module's traceback.

``restore=False`` (the command line) leaves the script's ``__main__``, ``sys.argv`` and the replaced
converters in place when it returns: the process ends after the script's non-daemon threads and atexit
handlers, which see what they would under ``python``. ``run_script`` called from Python restores all.
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types
from pathlib import Path
from typing import Any, Callable, Sequence

from bnsurgeon.core.errors import UsageError
from bnsurgeon.launch.converters import install
from bnsurgeon.launch.gaps import GAPS, GapRequest, refuse_shared_names, start_recording_gaps
from bnsurgeon.launch.log import ConversionLog, rank, say
from bnsurgeon.launch.outputs import check_report, claim_report, report_location

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_RUNPY = os.path.abspath(runpy.__file__)


class ScriptRaised(Exception):
    """The script raised ``error`` (not bnsurgeon): the caller shows it as Python shows an uncaught
    exception, and exits as Python would."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(type(error).__name__)
        self.error = error

    def __str__(self) -> str:
        try:
            text = str(self.error)
        except Exception:  # an exception whose __str__ raises: python prints it as this
            text = "<exception str() failed>"
        return f"{type(self.error).__name__}: {text}" if text else type(self.error).__name__

    @property
    def interrupted(self) -> bool:
        """Ctrl-C in the script: Python's exit for it is death by SIGINT, not status 1."""
        return isinstance(self.error, KeyboardInterrupt)

    def show(self) -> None:
        """The traceback through ``sys.excepthook``, as Python prints it (a hook the script set is used)."""
        error = self.error
        sys.excepthook(type(error), error, error.__traceback__)


class ScriptNotRunnable(Exception):
    """python would not run the target either (a directory or zip without ``__main__.py``, a package without
    ``__main__``, a module whose spec cannot be found): the message is python's, which exits 1 with it."""


def _ours(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or filename in (_RUNPY, "<frozen runpy>")


def without_our_frames(error: BaseException) -> BaseException:
    """``error`` with the leading traceback entries of bnsurgeon and runpy removed (a SyntaxError in
    the script keeps none: Python prints it without a traceback too)."""
    tb = error.__traceback__
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return error.with_traceback(tb)


def _missing(error: ScriptNotRunnable, name: str) -> bool:
    """Whether runpy refused ``name`` because no such module or package exists (not a package without
    ``__main__``, not a package whose ``__init__`` failed)."""
    cause = error.__cause__
    if isinstance(cause, ModuleNotFoundError) and cause.name is not None:
        return name == cause.name or name.startswith(cause.name + ".")
    return str(error) == f"No module named {name}"


def _code_of_file(path: str) -> Any:
    """The code of a script file, source or compiled, as python reads it."""
    import io
    from pkgutil import read_code

    with io.open_code(path) as file:
        code = read_code(file)
    if code is None:
        with io.open_code(path) as file:
            code = compile(file.read(), path, "exec", dont_inherit=True)
    return code


def _prepare(target: str, module: bool) -> tuple[Any, dict[str, Any], str]:
    """(code, the ``__main__`` globals python sets, ``sys.argv[0]``) of a script, directory, zip or module;
    ``sys.path[0]`` set as python sets it. Runs the parent packages' ``__init__`` for ``-m``, as python does."""
    import importlib.machinery
    import pkgutil

    safe_path = getattr(sys.flags, "safe_path", False)
    if module:
        if not safe_path and sys.path:
            sys.path[0] = os.getcwd()
        try:
            _, spec, code = runpy._get_module_details(target, ScriptNotRunnable)  # type: ignore[attr-defined]
        except ScriptNotRunnable as error:
            if _missing(error, target):
                raise UsageError(
                    f"no module named {target!r}", "check the name, and run from the directory that holds it"
                ) from None
            raise
        return code, {"__spec__": spec}, spec.origin or target
    if pkgutil.get_importer(target) is None:  # a file: run its code directly
        path = os.path.abspath(target)
        if not safe_path and sys.path:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
        code = _code_of_file(path)
        loader_class = (
            importlib.machinery.SourcelessFileLoader if path.endswith(".pyc") else importlib.machinery.SourceFileLoader
        )
        names = {
            "__file__": path,
            "__cached__": None,
            "__loader__": loader_class("__main__", path),
            "__package__": None,
        }
        return code, names, target
    location = os.path.abspath(target)  # a directory or zip: its __main__ module, found on it, as python does
    if sys.path and not safe_path:
        sys.path[0] = location
    else:
        sys.path.insert(0, location)
    _, spec, code = runpy._get_main_module_details(ScriptNotRunnable)  # type: ignore[attr-defined]
    return code, {"__spec__": spec}, target


def _execute(code: Any, names: dict[str, Any]) -> None:
    """``code`` in a fresh ``__main__`` module, left in ``sys.modules`` (the caller restores the old one)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    spec = names.get("__spec__")
    if spec is not None:  # runpy's _run_code sets __file__, __cached__, __loader__, __package__ from the spec
        runpy._run_code(code, main.__dict__, None, "__main__", spec)  # type: ignore[attr-defined]
        return
    main.__dict__.update(names, __spec__=None)
    exec(code, main.__dict__)


def _files_run(target: str, module: bool, names: dict[str, Any]) -> list[str]:
    """The files python runs for the target: the script, or the ``__main__`` module's origin (a directory's
    ``__main__.py``, a module's file) and, for ``-m a.b.c``, the ``__init__.py`` of ``a`` and ``a.b``; a zip
    itself, as its members are no files."""
    spec = names.get("__spec__")
    origin = getattr(spec, "origin", None) if spec is not None else None
    files = [target] if not module else []
    if origin and os.path.exists(origin):
        files.append(origin)
    if module:
        parts = target.split(".")
        for end in range(1, len(parts)):
            package = sys.modules.get(".".join(parts[:end]))
            init = getattr(package, "__file__", None)
            if isinstance(init, str) and os.path.exists(init):
                files.append(init)
    return files


#: how to undo each ``run_script(restore=False)``, for a caller that goes on after it (tests): ``put_back()``
LEFT_IN_PLACE: list[Callable[[], None]] = []


def put_back() -> None:
    """Undo every ``run_script(restore=False)`` of this process, the latest first."""
    while LEFT_IN_PLACE:
        LEFT_IN_PLACE.pop()()


def run_script(
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    allow_unhandled: bool = False,
    report: str | os.PathLike | None = None,
    force: bool = False,
    quiet: bool = False,
    rules: Sequence[str] = (),
    children: bool = True,
    restore: bool = True,
    stats: "GapRequest | None" = None,
) -> ConversionLog:
    """Run ``target`` (a script path, or a module name with ``module=True``) with ``args`` as ``__main__``,
    every known sync-BN converter doing bnsurgeon's exact conversion while it runs.

    Returns the log of the conversions when the script ends normally. Raises what the script
    raises as ``ScriptRaised`` (``SystemExit`` unchanged); a converter's refusal (a BN-like class no
    rule claims, unless ``allow_unhandled``; an uninitialized lazy BN) as the ``BnSurgeonError`` it
    is; ``UsageError`` for a script or module that does not exist, ``ScriptNotRunnable`` for one python
    would not run (its message is python's), ``OutputError`` for a ``report`` path that cannot or must
    not be written (checked before the script starts; existing reports are replaced only with ``force``).
    On rank 0, each conversion prints one summary line on stderr (unless ``quiet``) and writes its JSON
    report to ``report`` (the second to ``NAME.2.json``, ...). ``rules``: ``--rules`` specs, registered
    here and in the children. ``children``: Python processes the script starts (Lightning's launcher,
    ``torch.multiprocessing.spawn``) get the same converters. The script starts with Python's own
    ``sys.excepthook``. ``restore=False`` leaves the script's ``__main__``, ``sys.argv``, hook, environment and
    converters in place (for a process that ends with the script: its threads and atexit handlers see them);
    ``put_back()`` undoes it. ``stats``: record how far each rank's batch statistics are from the global batch's in
    the sync layers' first steps (``--stats``; its document follows ``report``'s rules).
    """
    if not module and target != "":  # "" is the working directory, as python reads it
        try:
            os.stat(target)
        except OSError as error:  # python's own words: "No such file or directory", "Not a directory", ...
            raise UsageError(
                f"cannot open the script {target!r}: {error.strerror or error}", "check the path"
            ) from None
    if rules:
        from bnsurgeon.rules import use_rules

        use_rules(list(rules))
    path = None if report is None else report_location(report)  # before the script changes directory
    gap_path = None if stats is None else report_location(stats.path, GAPS)
    log = ConversionLog(allow_unhandled=allow_unhandled, report_path=path, quiet=quiet)
    source = f"bnsurgeon run {'-m ' if module else ''}{target}"
    saved_argv, saved_path, saved_main, saved_hook = (
        sys.argv,
        list(sys.path),
        sys.modules.get("__main__"),
        sys.excepthook,
    )
    undo: list[Callable[[], None]] = []

    def put_back() -> None:
        for step in reversed(undo):
            step()
        sys.argv = saved_argv
        sys.path[:] = saved_path
        sys.excepthook = saved_hook
        if saved_main is not None:
            sys.modules["__main__"] = saved_main

    if not restore:
        LEFT_IN_PLACE.append(put_back)
    sys.excepthook = sys.__excepthook__  # python's, not the caller's (Typer's): the script may set its own
    try:
        if children:
            from bnsurgeon.launch.children import child_environment

            gaps = (
                None if stats is None or gap_path is None else {**stats.settings(quiet, source), "path": str(gap_path)}
            )
            undo.append(child_environment(log, rules, gaps))
        earlier: list[Path] = []
        gaps_earlier: list[Path] = []
        if path is not None:  # before anything of the script runs, a package's __init__ for -m included
            path, earlier = check_report(path, force=force, first=rank() == 0, script=None if module else target)
        if gap_path is not None:
            gap_path, gaps_earlier = check_report(
                gap_path, force=force, first=rank() == 0, script=None if module else target, kind=GAPS
            )
            refuse_shared_names(path, gap_path)
        undo.append(install(log))  # before a package's __init__ runs for -m, as it is part of what runs
        sys.argv = [target, *args]
        try:
            code, names, sys.argv[0] = _prepare(target, module)
        except (ScriptNotRunnable, UsageError, SystemExit):
            raise
        except BaseException as error:  # noqa: B036 - the script's (a SyntaxError, a package's __init__ that raised)
            raise ScriptRaised(without_our_frames(error)) from None
        run = _files_run(target, module, names) if path is not None or gap_path is not None else []
        if path is not None:
            claim_report(path, run, earlier, force=force, first=rank() == 0)
        if stats is not None and gap_path is not None:
            claim_report(gap_path, run, gaps_earlier, force=force, first=rank() == 0, kind=GAPS)
            undo.append(start_recording_gaps(gap_path, stats.steps, stats.layers, quiet=quiet, source=source).finish)
        try:
            _execute(code, names)
        except SystemExit:
            raise
        except BaseException as error:  # noqa: B036 - the script's own, KeyboardInterrupt included: shown as python does
            if error is log.refusal:
                raise
            raise ScriptRaised(without_our_frames(error)) from None
    finally:
        if restore:
            put_back()
    if path is not None and not quiet and rank() == 0 and not os.path.lexists(path):
        from bnsurgeon.core.layout import printable

        say(printable(f"bnsurgeon run: no converter was called: no report written to {path}"))
    return log
