"""Functions that run eagerly, outside ``torch.compile``'s graphs: marked once ``torch._dynamo`` is imported.

``torch.compiler.disable`` imports ``torch._dynamo`` (about a second, 1,600 modules), and marking at import
time made every process that imports bnsurgeon's layers pay it, ``bnsurgeon run`` of a script that never
compiles included. Nothing is traced before dynamo is imported (``torch.compile`` imports it), so the mark is
put on the moment it is (``core/after_import.py``), or at once where it already is.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable

from bnsurgeon.core.after_import import after_import

DYNAMO = "torch._dynamo"

#: (namespace holding the function, its name, the reason dynamo quotes when fullgraph=True refuses the break)
_pending: list[tuple[Any, str, str]] = []
_stop_watching: list[Callable[[], None]] = []


def outside_compile(owner: Any, name: str, reason: str) -> None:
    """``owner.name`` (a class's method or a module's function) runs outside compiled graphs, a graph break that
    ``fullgraph=True`` refuses quoting ``reason``."""
    if DYNAMO in sys.modules:
        _mark(owner, name, reason)
        return
    _pending.append((owner, name, reason))
    if not _stop_watching:
        _stop_watching.append(after_import([DYNAMO], _mark_pending))


def _mark_pending(_: str, __: ModuleType) -> None:
    while _stop_watching:
        _stop_watching.pop()()
    while _pending:
        _mark(*_pending.pop(0))


def _mark(owner: Any, name: str, reason: str) -> None:
    from bnsurgeon.core.torch_versions import disable_compile

    setattr(owner, name, disable_compile(getattr(owner, name), reason))
