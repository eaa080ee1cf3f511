"""Run a function on W gloo ranks on 127.0.0.1 with a free port and a hard timeout.

Used by ``bnsurgeon verify`` (the N-rank check) and by the tests. A hang becomes an
error: the parent waits at most ``timeout`` seconds, then kills every rank and raises.
Results travel as ``torch.save`` bytes, not shared-memory handles that die with a rank.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, collective_timeout, fn, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # bytes, not shared-memory handles that die with the child
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # report every failure to the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_world(world_size: int, fn, *args, timeout: float = 180.0, collective_timeout: float = 60.0,
              allow_errors: bool = False) -> list:
    """Results of ``fn(rank, world_size, *args)`` by rank; raises on error, hang or timeout."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(rank, world_size, port, collective_timeout, fn, args, results))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish in {timeout}s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in collected}
                if dead and len(collected) + len(dead) >= world_size:
                    if not allow_errors:
                        raise RankFailure(f"rank(s) died with exit codes {dead}")
                    collected.update({r: ("died", f"exit code {code}") for r, code in dead.items()})
                continue
            if status == "ok":
                import torch

                value = torch.load(io.BytesIO(value), weights_only=False)
            collected[rank] = (status, value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    errors = {rank: value for rank, (status, value) in collected.items() if status != "ok"}
    if errors and not allow_errors:
        raise RankFailure("\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))
    return [collected[rank] if allow_errors else collected[rank][1] for rank in range(world_size)]
