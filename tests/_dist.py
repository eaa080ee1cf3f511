"""The tests use the library's own multi-rank harness, and torchrun as users start it."""

import sys

from bnsurgeon.checks.multiproc import free_port, run_world

__all__ = ["free_port", "run_world", "torchrun"]


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """``torchrun --nproc-per-node N`` on 127.0.0.1 with a free port, as this interpreter's torch runs it."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *args,
    ]
