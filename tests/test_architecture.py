"""The package's shape holds: stages import downward only (import-linter's contracts in .importlinter),
no import loops, and no module takes a ``_private`` name from another module."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bnsurgeon"
#: the one upward import the layers contract allows (torch's classmethod API forces it); see .importlinter
ALLOWED_UPWARD = {("bnsurgeon.runtime.layers", "bnsurgeon.surgery.walk")}


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the package found first on the path in ``cwd`` (a copy is found before the install)."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.fail("import-linter is not installed: it is in the test extra (pip install -e '.[test]')")
    env = {
        "PATH": str(Path(sys.executable).parent),
        "PYTHONPATH": str(cwd),
        "NO_COLOR": "1",
        "HOME": str(cwd),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return subprocess.run(
        [lint, "--config", str(cwd / ".importlinter"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path):
    """(imported module, names, line) of every ``from X import ...`` in a file, relative imports resolved."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [alias.name for alias in node.names], node.lineno


def test_the_layering_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout and "KEPT" in result.stdout


@pytest.mark.parametrize(
    "planted, contract",
    [
        # the bottom layer reaching up to the CLI
        ("core/layout.py", "The stages of the pipeline"),
        # a lower stage (files) importing a higher one (checks), lazily inside a function
        ("files/history.py", "The stages of the pipeline"),
        # one rule family importing another
        ("rules/frozen.py", "Rule families know the registry"),
    ],
)
def test_a_planted_wrong_import_breaks_its_contract(tmp_path, planted, contract):
    copy = tmp_path / "tree"
    shutil.copytree(PACKAGE, copy / "bnsurgeon", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", copy / ".importlinter")
    wrong = {
        "core/layout.py": "\n\ndef planted():\n    from bnsurgeon.cli import commands\n    return commands\n",
        "files/history.py": "\n\ndef planted():\n    from bnsurgeon.checks.verify import perturb_bn\n    return perturb_bn\n",
        "rules/frozen.py": "\nfrom bnsurgeon.rules import norm_act  # noqa: E402\n",
    }[planted]
    target = copy / "bnsurgeon" / planted
    target.write_text(target.read_text() + wrong)
    result = lint_imports(copy)
    assert result.returncode != 0, result.stdout[-3000:]
    assert contract in result.stdout and "BROKEN" in result.stdout
    # the unplanted copy passes: the failure is the planted line's, not the copy's
    target.write_text(target.read_text().replace(wrong, ""))
    assert lint_imports(copy).returncode == 0


def test_no_import_loops():
    """Strongly connected modules of the runtime import graph (annotations-only imports excluded), with
    the one allowed lazy import removed: none may remain."""
    import grimp

    graph = grimp.build_graph("bnsurgeon", exclude_type_checking_imports=True)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    for source, target in ALLOWED_UPWARD:
        assert target in edges[source], f"{source} no longer imports {target}: drop it from ALLOWED_UPWARD"
        edges[source].discard(target)
    loops = strongly_connected(edges)
    assert loops == [], f"import loops: {loops}"


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_loop_finder_finds_a_loop():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def private_imports(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "bnsurgeon").rglob("*.py")):
        here = module_name(path, root)
        for target, names, line in imports_of(path, root):
            if target != here and target.startswith("bnsurgeon"):
                found += [
                    f"{path.relative_to(root)}:{line} takes {name} from {target}"
                    for name in names
                    if name.startswith("_") and not name.startswith("__")
                ]
    return found


def test_no_module_takes_a_private_name_from_another():
    assert private_imports(ROOT) == []


def test_the_private_name_check_catches_one(tmp_path):
    (tmp_path / "bnsurgeon" / "sub").mkdir(parents=True)
    (tmp_path / "bnsurgeon" / "__init__.py").write_text("")
    (tmp_path / "bnsurgeon" / "sub" / "__init__.py").write_text("")
    (tmp_path / "bnsurgeon" / "sub" / "a.py").write_text("from ..b import _hidden, shown\nfrom . import _helper\n")
    assert private_imports(tmp_path) == [
        "bnsurgeon/sub/a.py:1 takes _hidden from bnsurgeon.b",
        "bnsurgeon/sub/a.py:2 takes _helper from bnsurgeon.sub",
    ]


def test_every_stage_folder_is_in_the_contract():
    """A new folder under bnsurgeon/ must be placed in the layers, or nothing checks it."""
    contract = (ROOT / ".importlinter").read_text()
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(name for name in folders if f"bnsurgeon.{name}" not in contract)
    assert missing == [], f"folders not in .importlinter's layers: {missing}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.stem not in {"__init__", "__main__", "api", "pipeline"})
    assert loose == [], f"modules outside the stage folders: {loose} (put each in its stage)"
