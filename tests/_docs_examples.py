"""The README's and docs/'s code blocks as tests: found, run, checked (tests/test_docs_examples.py).

A fenced block in ``bash``/``sh``, ``console`` or ``python`` is an example. HTML comments on the
lines right above its fence (invisible on GitHub and on the site) say how it runs:

    <!-- docs-test: skip (REASON) -->     not run (a GPU, several nodes, the network, minutes);
                                          still syntax-checked: compile() / bash -n
    <!-- docs-test: file NAME -->         the block is a file the later blocks use: written, compiled
    <!-- docs-test: needs NAME ... -->    files an earlier example wrote, linked into this page's folder
    <!-- docs-test: setup: CODE -->       Python run first, in the folder (for a python block, in its
                                          namespace): the reader's own model, loader, ...

Each page runs in a folder of its own under one session folder, in page order. Commands run in
this process: ``bnsurgeon ...`` through Click's runner (its exit code; in a ``console`` block also
its output, where ``...`` stands for any text in a line and a line of ``...`` for any lines),
``python -c CODE`` with exec, ``export K=V`` for the rest of the block; anything else through bash.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "console", "python": "python", "py": "python"}
DIRECTIVE = re.compile(r"^<!-- docs-test: (.*?) -->\s*$")
# reading order: the pages' examples build on the ones before them (needs ...)
PAGE_ORDER = [
    "README.md",
    "docs/getting-started.md",
    "docs/commands.md",
    "docs/verify.md",
    "docs/deploy.md",
    "docs/training.md",
    "docs/transformers.md",
    "docs/detection.md",
    "docs/recalibrate.md",
]


class ExampleError(AssertionError):
    pass


@dataclass
class Block:
    path: str  # relative to ROOT
    line: int  # of the opening fence
    language: str  # bash, console or python
    code: str
    skip: str | None = None
    file: str | None = None
    needs: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def parse(text: str, path: str = "<text>") -> list[Block]:
    """Every example block of a Markdown text, with the directives above it."""
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = re.match(r"^```\s*([\w-]*)", lines[i])
        if not match:
            i += 1
            continue
        start, language = i, match.group(1).lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if language in LANGUAGES:
            block = Block(path, start + 1, LANGUAGES[language], "\n".join(lines[start + 1 : end]) + "\n")
            above = start - 1
            while above >= 0 and DIRECTIVE.match(lines[above]):
                _apply(block, DIRECTIVE.match(lines[above]).group(1))
                above -= 1
            blocks.append(block)
        i = end + 1
    return blocks


def _apply(block: Block, directive: str) -> None:
    if directive.startswith("skip"):
        reason = re.fullmatch(r"skip \((.+)\)", directive)
        if not reason:
            raise ExampleError(f"{block.id}: a skip needs its reason: <!-- docs-test: skip (REASON) -->")
        block.skip = reason.group(1)
    elif directive.startswith("file "):
        block.file = directive[5:].strip()
    elif directive.startswith("needs "):
        block.needs += directive[6:].split()
    elif directive.startswith("setup: "):
        block.setup.insert(0, directive[7:])
    else:
        raise ExampleError(f"{block.id}: unknown directive {directive!r}")


def pages() -> list[str]:
    found = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    return sorted(found, key=lambda p: (PAGE_ORDER.index(p) if p in PAGE_ORDER else len(PAGE_ORDER), p))


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in parse((ROOT / page).read_text(), page)]


# checks ----------------------------------------------------------------------------------------


def syntax_check(block: Block) -> None:
    if block.language == "python":
        compile(block.code, block.id, "exec")  # a SyntaxError names the line
        return
    script = block.code if block.language == "bash" else "\n".join(c for c, _ in console_commands(block.code))
    result = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    if result.returncode:
        raise ExampleError(f"{block.id}: bash -n: {result.stderr.strip()}")


def console_commands(code: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines, each with the output lines shown under it."""
    commands: list[tuple[str, list[str]]] = []
    for line in code.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
        elif line.strip():
            raise ExampleError(f"output before any '$ ' command: {line!r}")
    return commands


def bash_commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    out, pending = [], ""
    for line in code.split("\n"):
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
    return out


def output_matches(expected: list[str], actual: str) -> bool:
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    pattern = ""
    for line in expected:
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += ".*".join(re.escape(part) for part in line.rstrip().split("...")) + r"\n"
    got = "\n".join(line.rstrip() for line in actual.strip("\n").split("\n")) + "\n"
    return re.fullmatch(pattern, got, re.S if False else 0) is not None


@dataclass
class Session:
    """One folder per page under ``root``; environment changes undone after each block."""

    root: Path

    def folder(self, page: str) -> Path:
        folder = self.root / re.sub(r"[^\w.-]", "_", page)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def link_needs(self, block: Block, folder: Path) -> None:
        for name in block.needs:
            if (folder / name).exists():
                continue
            made = sorted(self.root.glob(f"*/{name}"), key=lambda p: p.stat().st_mtime)
            if not made:
                raise ExampleError(f"{block.id} needs {name}, which no earlier example wrote (run the whole file)")
            os.link(made[0], folder / name)


def run_block(block: Block, session: Session) -> None:
    syntax_check(block)
    if block.skip:
        return
    folder = session.folder(block.path)
    session.link_needs(block, folder)
    saved_cwd, saved_env, saved_path = os.getcwd(), dict(os.environ), list(sys.path)
    os.chdir(folder)
    try:
        with _registry_restored():
            namespace: dict = {"__name__": "__docs__"}
            for code in block.setup:
                exec(compile(code, f"{block.id} (setup)", "exec"), namespace)
            if block.file:
                (folder / block.file).write_text(block.code)
            elif block.language == "python":
                exec(compile(block.code, block.id, "exec"), namespace)
            elif block.language == "console":
                for command, shown in console_commands(block.code):
                    code, output = run_command(command)
                    if code != 0:
                        raise ExampleError(f"{block.id}: `{command}` exited {code}:\n{output}")
                    if any(line.strip() for line in shown) and not output_matches(shown, output):
                        raise ExampleError(
                            f"{block.id}: `{command}` printed\n{output}\nthe page shows\n" + "\n".join(shown)
                        )
            else:
                for command in bash_commands(block.code):
                    code, output = run_command(command)
                    if code != 0:
                        raise ExampleError(f"{block.id}: `{command}` exited {code}:\n{output}")
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path


@contextlib.contextmanager
def _registry_restored():
    """A block that registers a rule must not change the registry the rest of the suite sees."""
    from bnsurgeon.rules import default_registry

    registry = default_registry()
    rules, by_class, joined = list(registry._rules), dict(registry._by_class), set(registry.joined)
    try:
        yield
    finally:  # the families that joined meanwhile (timm imported in the block) join again on the next call
        registry._rules[:], registry._by_class, registry.joined = rules, by_class, joined


def run_command(command: str) -> tuple[int, str]:
    tokens = shlex.split(command, comments=True)
    env: dict[str, str] = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    if tokens[:1] == ["export"]:
        for assignment in tokens[1:]:
            key, value = assignment.split("=", 1)
            os.environ[key] = value
        return 0, ""
    if tokens[-2:] == ["|", "cat"]:  # "no terminal": the runner is none either
        tokens = tokens[:-2]
    tokens = [t for t in tokens if t != "2>&1"]
    if tokens[:1] == ["bnsurgeon"]:
        from typer.testing import CliRunner

        from bnsurgeon.cli.commands import app
        from bnsurgeon.launch.script import put_back

        try:
            result = CliRunner().invoke(app, tokens[1:], env={"COLUMNS": None, **env})
        finally:
            put_back()  # `bnsurgeon run` leaves the script's state in place for its process's exit: not this one's
        return result.exit_code, result.output
    if tokens[:2] == ["python", "-c"] and len(tokens) == 3:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(tokens[2], "<python -c>", "exec"), {"__name__": "__main__"})
        return 0, buffer.getvalue()
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={**os.environ, **env})
    return result.returncode, result.stdout + result.stderr
