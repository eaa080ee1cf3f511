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
import re
import runpy
import sys
import types
from pathlib import Path
from typing import Any, Callable, Sequence

from bnsurgeon.core.errors import OutputError, UsageError
from bnsurgeon.launch.converters import install
from bnsurgeon.launch.log import ConversionLog, rank, say

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


def report_names(report: Path) -> list[Path]:
    """The report files a run may write: PATH, then NAME.2.SUFFIX, NAME.3.SUFFIX, ... (those that exist)."""
    pattern = re.compile(re.escape(report.stem) + r"\.([2-9]|[1-9]\d+)" + re.escape(report.suffix))
    try:
        numbered_names = [entry for entry in report.parent.iterdir() if pattern.fullmatch(entry.name)]
    except OSError:
        numbered_names = []
    return [report, *sorted(numbered_names)]


def report_location(report: str | os.PathLike) -> Path:
    """``--report`` as an absolute path. A name ending in a separator names a directory, and a report is a file:
    refused, not read as the file without the slash (as ``os.path.abspath`` and a click Path would drop it)."""
    text = os.fspath(report)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    name = os.path.basename(text)
    if text.endswith(("/", os.sep)) or name in (".", ".."):
        raise OutputError(
            f"--report {text}: a name ending in {os.sep}, {os.sep}. or {os.sep}.. names a directory, and a report is "
            "a file",
            f"give a file path such as {text.rstrip('/' + os.sep + '.') or '.'}{os.sep}run.json",
        )
    parent = os.path.dirname(text) or "."
    if ".." in Path(parent).parts:  # resolved as the system resolves it (a missing or linked directory before ..)
        if not os.path.isdir(parent):
            raise OutputError(
                f"--report {text}: the directory {parent!r} does not exist, as the system reads the path",
                "create it first, or give the path without ..",
            )
        return Path(os.path.realpath(parent)) / name
    return Path(os.path.abspath(text))


def check_report(
    report: str | os.PathLike, *, force: bool, first: bool, script: str | None = None
) -> tuple[Path, list[Path]]:
    """``--report``, absolute (a script that changes directory writes it where it was asked for), checked
    before anything of the script runs (a package's ``__init__`` for ``-m`` included): a name the filesystem
    takes, in a directory whose files can be created; a regular file or nothing (a FIFO, a device, a link,
    a directory is refused and never removed, ``--force`` or not); existing reports (PATH, NAME.2.SUFFIX, ...)
    only with ``force``. ``first``: this process writes the reports (rank 0 of a torchrun launch): only it looks
    at existing ones. Returns the path and the earlier run's reports, which ``claim_report`` removes once the
    script's own file is known (only those: a report a package's ``__init__`` wrote meanwhile is this run's)."""
    import tempfile

    path = Path(os.path.abspath(report))
    limit = _name_max(path.parent)
    longest = len(os.fsencode(path.name)) + len(".999")  # room for NAME.999.SUFFIX
    if longest > limit:
        raise OutputError(
            f"--report {path}: the file name is too long ({len(os.fsencode(path.name))} bytes; this filesystem takes "
            f"{limit}, and numbered reports add up to 4)",
            "choose a shorter report name",
        )
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise OutputError(f"--report {path}: the directory {str(parent)!r} {what}", "create it first")
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"--report {path} is a directory", "give a file path such as run.json")
    _refuse_special(path, path)
    try:
        probe, probe_path = tempfile.mkstemp(dir=parent, prefix=".bnsurgeon-probe-")
        os.close(probe)
        os.unlink(probe_path)
    except OSError as error:
        raise OutputError(
            f"--report {path}: cannot create a file in {parent} ({error.strerror or error})",
            "choose a directory you can write to",
        ) from None
    if not first:
        return path, []
    existing = [name for name in report_names(path) if os.path.lexists(name)]
    for name in existing:
        _refuse_special(path, name)
    runs = [] if script is None else [script, os.path.join(script, "__main__.py")]
    for name in existing:  # first: no --force makes this path usable
        said = next((given for given in runs if _same_file(name, given)), None)
        if said is not None:
            raise OutputError(
                f"--report {path} would write over the script {said}",
                "choose another report path; bnsurgeon never overwrites what it runs, --force or not",
            )
    for name in existing:  # --force replaces reports, never a file of the user's (a package's __init__.py)
        if not holds_a_report(name):
            raise OutputError(
                f"--report {path}: {name} exists and is not a bnsurgeon report; --force replaces only the reports "
                "of an earlier run, and bnsurgeon never removes another file",
                "choose another report path",
            )
    if existing and not force:
        raise OutputError(
            f"--report {path}: {existing[0]} already exists",
            "pass --force to replace the reports of an earlier run, or choose another path",
        )
    return path, existing


#: the most of an existing file read to tell whether it is a report (a run's reports are kilobytes to megabytes)
REPORT_READ_LIMIT = 64 * 1024 * 1024
#: what every report's JSON starts with (``Report.to_json``: its first field), and the fields it always has
REPORT_START = b'{\n  "target": '
REPORT_FIELDS = frozenset({"target", "changed", "kept", "unhandled", "schema_version", "tool_version"})


def holds_a_report(name: Path) -> bool:
    """Whether ``name`` is a regular file holding a bnsurgeon report (a JSON document as ``Report.to_json`` writes
    it): read without following a link or waiting on a FIFO put there meanwhile, and at most ``REPORT_READ_LIMIT``."""
    import json
    import stat

    try:
        handle = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return False
        with os.fdopen(handle, "rb", closefd=False) as file:
            data = file.read(REPORT_READ_LIMIT + 1)
    except OSError:
        return False
    finally:
        os.close(handle)
    if len(data) > REPORT_READ_LIMIT or not data.startswith(REPORT_START):
        return False
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(document, dict) and REPORT_FIELDS <= document.keys()


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _refuse_special(report: Path, name: Path) -> None:
    """A name that exists and is not a regular file (a FIFO, a device, a socket, a symbolic link, /dev/stdout) is
    no report of an earlier run: refused, and never removed."""
    import stat

    try:
        mode = os.lstat(name).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kind = (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    raise OutputError(
        f"--report {report}: {name} is {kind}; reports are written only as regular files, and bnsurgeon never "
        "removes anything else",
        "give the path of a regular file (or of none yet)",
    )


def claim_report(path: Path, run: Sequence[str], earlier: Sequence[Path], *, force: bool, first: bool) -> None:
    """Once the file that runs is known (a script, a directory's or zip's ``__main__``, a module's file), before
    its first line: no report name is that file (by identity: a hard link too), then, with ``force``, the
    earlier run's reports (``earlier``, found by ``check_report``) are removed, so that a report there afterwards
    is this run's."""
    pattern = re.compile(re.escape(path.stem) + r"(\.\d+)?" + re.escape(path.suffix))
    names = report_names(path)
    for given in run:
        entry = Path(os.path.realpath(given))
        same_place = entry.parent == Path(os.path.realpath(path.parent)) and pattern.fullmatch(entry.name)
        if same_place or any(_same_file(name, given) for name in names):
            raise OutputError(
                f"--report {path} would write over the script {given}",
                "choose another report path; bnsurgeon never overwrites what it runs, --force or not",
            )
    if not first or not force:
        return
    for name in earlier:
        if os.path.lexists(name):
            _refuse_special(path, name)
            if not holds_a_report(name):  # replaced since it was checked (by a package's __init__ for -m)
                raise OutputError(
                    f"--report {path}: {name} is no longer a bnsurgeon report; bnsurgeon never removes another file",
                    "choose another report path",
                )
            name.unlink()


def _same_file(name: Path, other: str) -> bool:
    try:
        return os.path.samefile(name, other)
    except OSError:
        return False


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
    ``put_back()`` undoes it.
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
    log = ConversionLog(allow_unhandled=allow_unhandled, report_path=path, quiet=quiet)
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

            undo.append(child_environment(log, rules))
        earlier: list[Path] = []
        if path is not None:  # before anything of the script runs, a package's __init__ for -m included
            path, earlier = check_report(path, force=force, first=rank() == 0, script=None if module else target)
        undo.append(install(log))  # before a package's __init__ runs for -m, as it is part of what runs
        sys.argv = [target, *args]
        try:
            code, names, sys.argv[0] = _prepare(target, module)
        except (ScriptNotRunnable, UsageError, SystemExit):
            raise
        except BaseException as error:  # noqa: B036 - the script's (a SyntaxError, a package's __init__ that raised)
            raise ScriptRaised(without_our_frames(error)) from None
        if path is not None:
            claim_report(path, _files_run(target, module, names), earlier, force=force, first=rank() == 0)
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
