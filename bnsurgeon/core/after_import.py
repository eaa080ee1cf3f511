"""Run a callback the moment a named module has executed, without importing it.

Why: what bnsurgeon changes in another package (``bnsurgeon run``'s converters; the runtime's
``torch.compiler.disable`` marks, which import ``torch._dynamo``, a second of start-up) should cost
nothing in a process that never imports that package. A finder on ``sys.meta_path`` finds the
module with the other finders and wraps its loader; the module keeps its own loader afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Iterable

_local = threading.local()


class _ThenLoader(importlib.abc.Loader):
    """The module's own loader, then the callback."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:  # get_data, is_package, ...: the real loader's
        return getattr(self._loader, name)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders, and wraps their loaders."""

    def __init__(self, names: Iterable[str], then: Callable[[str, ModuleType], None]) -> None:
        self._names = frozenset(names)
        self._then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        searching = _local.__dict__.setdefault("searching", set())
        if fullname not in self._names or (id(self), fullname) in searching:
            return None
        searching.add((id(self), fullname))  # another watcher (a run inside a run) asks this one too
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            searching.discard((id(self), fullname))
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            then = self._then
            spec.loader = _ThenLoader(spec.loader, lambda module: then(fullname, module))
        return spec


def after_import(
    names: Iterable[str],
    then: Callable[[str, ModuleType], None],
    *,
    already: Callable[[str, ModuleType], None] | None = None,
) -> Callable[[], None]:
    """``then(name, module)`` once each module of ``names`` has executed; a module already imported gets
    ``already`` (default: ``then``) at once. Returns the function that stops watching."""
    names = list(names)
    watcher = _Watcher(names, then)
    sys.meta_path.insert(0, watcher)
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            (already or then)(name, module)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(watcher)

    return stop
