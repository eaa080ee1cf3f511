"""``run_python(script)``: what ``subprocess.run([sys.executable, "-c", script], capture_output=True,
text=True)`` gives (exit code, stdout, stderr), run in a process forked from the rank harness's fork
server instead of a fresh interpreter: torch and timm are already imported there, which saves the 6-8 s
of CPU each fresh interpreter spends importing them. For scripts that test what a process does (signals,
resource limits, files it leaves), not what a fresh interpreter imports: those keep ``subprocess``.

Where it differs from a fresh interpreter: stdout and stderr are files (a file-size limit the script sets
applies to them too), stdin is empty, atexit handlers do not run, ``sys.path`` is the caller's (plus
PYTHONPATH), and names the script defines are not importable as ``__main__`` by another process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bnsurgeon.checks.multiproc import adopt_environment, forked_context


def _child(script: str, cwd: str, environment: dict[str, str], out_path: str, err_path: str) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server's ranks ignore Ctrl-C; a script does not
    os.chdir(cwd)
    adopt_environment(environment)
    for entry in reversed(environment.get("PYTHONPATH", "").split(os.pathsep)):
        if entry:
            sys.path.insert(0, entry)
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((out_path, 1), (err_path, 2)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = ["-c"]
    exec(compile(script, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def run_python(
    script: str, *, cwd: str | Path | None = None, env: dict[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess:
    """The script's exit code (negative for a signal, as subprocess gives it), stdout and stderr."""
    context = forked_context()
    with tempfile.TemporaryDirectory(prefix="bnsurgeon-forked-") as scratch:
        out_path, err_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        environment = dict(os.environ if env is None else env)
        process = context.Process(
            target=_child, args=(script, str(cwd or os.getcwd()), environment, out_path, err_path)
        )
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["<forked>", script], timeout)
        stdout, stderr = (Path(p).read_text() if os.path.exists(p) else "" for p in (out_path, err_path))
    return subprocess.CompletedProcess(["<forked>", script], process.exitcode, stdout, stderr)
