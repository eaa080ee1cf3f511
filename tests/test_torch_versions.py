"""The torch releases bnsurgeon supports: one module knows what differs (core/torch_versions.py).

A feature above the installed torch is one line with exit 18 naming both versions; no other module reads torch's
version or asks torch with hasattr, so raising the floor is deleting lines in one place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from bnsurgeon.core import torch_versions
from bnsurgeon.core.errors import TorchTooOldError

PACKAGE = Path(__file__).resolve().parent.parent / "bnsurgeon"
TORCH_NAMES = {"torch", "dist", "nn", "F", "functional"}


def _asks_torch(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__version__":
            base = node.value
            if isinstance(base, ast.Name) and base.id in TORCH_NAMES:
                found.append(f"line {node.lineno}: {base.id}.__version__")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" and node.args:
            first = node.args[0]
            root = first
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in TORCH_NAMES:
                found.append(f"line {node.lineno}: hasattr({ast.unparse(first)}, ...)")
    return found


def test_no_module_but_torch_versions_reads_torchs_version_or_hasattrs_torch():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "torch_versions.py":
            continue
        found = _asks_torch(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_the_scan_catches_what_it_looks_for():
    planted = "import torch\nimport torch.distributed as dist\nv = torch.__version__\nok = hasattr(dist, 'x')\n"
    assert len(_asks_torch(ast.parse(planted))) == 2


def test_a_feature_above_the_installed_torch_is_one_line_naming_both_versions(monkeypatch):
    monkeypatch.setitem(torch_versions.FEATURES, "from_the_future", (99, 0))
    with pytest.raises(TorchTooOldError) as refused:
        torch_versions.require("from_the_future", "reading x.safetensors (tensor 'w' is F99)")
    message = refused.value.message
    assert message == f"reading x.safetensors (tensor 'w' is F99) needs torch >= 99.0 (you have {torch.__version__})"
    assert refused.value.exit_code == 18 and "\n" not in message
    monkeypatch.setitem(torch_versions.FEATURES, "from_the_past", torch_versions.FLOOR)
    torch_versions.require("from_the_past", "anything at the floor")  # no error


def test_the_floor_is_what_pyproject_declares():
    import re

    text = (PACKAGE.parent / "pyproject.toml").read_text()
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert declared is not None and (int(declared.group(1)), int(declared.group(2))) == torch_versions.FLOOR
    assert torch_versions.installed() >= torch_versions.FLOOR


def test_the_weights_only_refusal_is_what_torchs_own_unpickler_raises():
    """torch 2.4's weights_only unpickler refuses a global with RuntimeError, later ones with UnpicklingError: the
    shim names the one the installed torch raises (bnsurgeon's per-load reads report it as torch.load does)."""
    import datetime
    import io
    import pickle

    import torch._weights_only_unpickler as torch_unpickler

    with pytest.raises(torch_versions.weights_only_refusal(), match="datetime.date"):
        torch_unpickler.load(io.BytesIO(pickle.dumps(datetime.date, protocol=2)))
