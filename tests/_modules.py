"""A Python module written into a test's tmp_path and importable from it (factories, rules)."""

from __future__ import annotations

import sys
from pathlib import Path


def install_module(tmp_path: Path, monkeypatch, name: str, source: str) -> Path:
    """Write ``name``.py, make it importable fresh (cwd and sys.path), and return tmp_path."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return tmp_path
