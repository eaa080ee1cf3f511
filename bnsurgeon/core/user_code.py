"""Code runs only when the user names it: check that a ``package.module:function`` is one, then import it.

The one place bnsurgeon imports a module by a name it was given (factories, ``--rules``).
"""

from __future__ import annotations

import re

from bnsurgeon.core.errors import ShadowedModuleError, UsageError
from bnsurgeon.core.layout import shown

#: ``package.module:function``, every part a Python identifier, no relative imports
FACTORY_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def check_factory_spec(spec: str) -> None:
    """Refuse what is not ``package.module:function`` before anything is imported."""
    if not FACTORY_PATTERN.match(spec):
        raise UsageError(
            f"{shown(spec, 200)} is not a factory of the form package.module:function",
            "name an importable function, e.g. mypkg.models:build (no leading dots, no empty parts)",
        )


def import_named_module(spec: str, directory: str | None = None):
    """(module, attribute name) of a ``package.module:name`` the user named; the working directory
    is importable too, as for ``python -m``. Raises ImportError for the caller to word: a module that
    calls ``sys.exit`` or raises anything while it is imported too (the user's code failed, not bnsurgeon).
    ``directory``: import from there instead, only while importing (``sys.path`` is left as it was)."""
    import sys
    from pathlib import Path

    module_name, _, attribute = spec.partition(":")
    if directory is not None:
        added = directory not in sys.path
        if added:
            sys.path.insert(0, directory)
        try:
            return _imported(module_name, attribute)
        finally:
            if added and directory in sys.path:
                sys.path.remove(directory)
    USER_DIRECTORIES.add(str(Path.cwd()))
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    return _imported(module_name, attribute)


def _imported(module_name: str, attribute: str):
    import importlib

    try:
        return importlib.import_module(module_name), attribute
    except SystemExit as stop:  # exit 0 would read as success: a check passed, a file written, when none was
        raise ImportError(f"importing {module_name} called sys.exit({stop.code!r})") from None
    except ImportError:
        raise
    except Exception as error:  # the module's own code raised: worded as the user's error, never "a bug" (exit 70)
        from bnsurgeon.core.errors import first_line

        raise ImportError(f"importing {module_name} raised {type(error).__name__}: {first_line(error)}") from None


#: the directories put first on the import path for the user's code (the working directory), for shadowing_error
USER_DIRECTORIES: set[str] = set()


def shadowing_modules() -> list[tuple[str, str, str]]:
    """``(name, file, hidden)`` for each top-level module imported from a directory put on the import path for the
    user's code while a module of the same name is installed elsewhere (``hidden``: where): a ``safetensors.py``
    beside the user's factory is what bnsurgeon's own ``import safetensors`` gets."""
    import importlib.machinery
    import os
    import sys

    directories = {os.path.realpath(directory) for directory in USER_DIRECTORIES}
    if not directories:
        return []
    elsewhere = [entry for entry in sys.path if entry not in ("", ".") and os.path.realpath(entry) not in directories]
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if "." in name or not isinstance(file, str):
            continue
        home = os.path.dirname(os.path.dirname(file) if os.path.basename(file).startswith("__init__.") else file)
        if os.path.realpath(home) not in directories:
            continue
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        except (ImportError, ValueError, OSError):
            spec = None
        if spec is not None:
            hidden = spec.origin or ", ".join(spec.submodule_search_locations or []) or "elsewhere on the path"
        elif name in sys.stdlib_module_names or name in sys.builtin_module_names:
            hidden = "Python's standard library"
        else:
            continue
        found.append((name, file, hidden))
    return found


def shadowing_error() -> ShadowedModuleError | None:
    """The error that names the modules of the working directory that hide installed ones (None: none does).
    Asked where something failed that bnsurgeon did not expect to fail: the user's environment is the cause,
    not bnsurgeon."""
    shadows = shadowing_modules()
    if not shadows:
        return None
    name, file, hidden = shadows[0]
    more = (
        f" (and {len(shadows) - 1} more: {', '.join(shown(other[0], 40) for other in shadows[1:4])})"
        if len(shadows) > 1
        else ""
    )
    return ShadowedModuleError(
        f"{shown(file, 300)} in the working directory hides the installed module {shown(name, 80)} "
        f"({shown(hidden, 300)}){more}: the working directory comes first on the import path for your factory",
        f"rename {shown(file, 300)}, or run from another directory with your factory's package installed or on "
        "PYTHONPATH",
    )
