"""Code runs only when the user names it: check that a ``package.module:function`` is one, then import it.

The one place bnsurgeon imports a module by a name it was given (factories, ``--rules``).
"""

from __future__ import annotations

import re

from bnsurgeon.core.errors import UsageError
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


def import_named_module(spec: str):
    """(module, attribute name) of a ``package.module:name`` the user named; the working directory
    is importable too, as for ``python -m``. Raises ImportError for the caller to word."""
    import importlib
    import sys
    from pathlib import Path

    module_name, _, attribute = spec.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    return importlib.import_module(module_name), attribute
