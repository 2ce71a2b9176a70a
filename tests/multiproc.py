"""Run a function on N gloo ranks in fresh processes, for tests: `run_workers(fn, world_size, *args)`.

What it guarantees, because a multi-process test that hangs or passes when a child died is worse
than none: a free port per run (never a fixed one); the first rank to fail fails the caller with
that rank's traceback; a rank that dies without a word (a segfault, os._exit) is noticed at once,
not at the deadline; when anything fails every other rank is terminated (then killed), not left
waiting in a collective; and a deadline bounds the whole run.

`fn(rank, world_size, *args)` must be importable (a module-level function): ranks are spawned.
Its return value comes back (through torch.save, so tensors are fine), in rank order.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLL_S = 0.2  # how often the parent looks at its children while waiting
GRACE_S = 5.0  # after a rank exits cleanly, how long its result may still be in the queue's pipe


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(fn: Callable, rank: int, world: int, port: int, results: Any, timeout: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # the test machine's cores are shared: one thread per rank
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)  # bytes outlive the child; shared tensors would not
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                group_timeout: float | None = None) -> list[Any]:
    """`fn(rank, world_size, *args)` on each rank; the results by rank, or AssertionError on the first failure.
    `timeout` bounds the run, and each collective's wait unless `group_timeout` (the process group's) is given."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected at least 1 rank")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    waits = timeout if group_timeout is None else group_timeout
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, waits, args), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        got = _collect(procs, results, time.monotonic() + timeout, timeout)
    except BaseException:
        _stop(procs, patient=False)  # the others may wait forever on the rank that failed
        raise
    _stop(procs, patient=True)
    return [got[rank] for rank in range(world_size)]


def _collect(procs: list, results: Any, deadline: float, timeout: float) -> dict[int, Any]:
    world, got = len(procs), {}
    exited_at: dict[int, float] = {}
    while len(got) < world:
        try:
            rank, ok, payload = results.get(timeout=POLL_S)
        except queue.Empty:
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in got or proc.exitcode is None:
                    continue
                if proc.exitcode != 0:
                    raise AssertionError(f"rank {rank} of {world} died with exit code {proc.exitcode} "
                                         "and no traceback (a crash in native code, or killed)")
                if now - exited_at.setdefault(rank, now) > GRACE_S:
                    raise AssertionError(f"rank {rank} of {world} exited without returning a result")
            if now > deadline:
                waiting = [r for r in range(world) if r not in got]
                raise AssertionError(f"ranks {waiting} of {world} gave no result within {timeout}s "
                                     "(a hang: a collective some rank never joined?)") from None
            continue
        if not ok:  # a peer's silent death often surfaces first as this rank's broken connection
            for proc in procs:
                proc.join(timeout=0.1)  # long enough to notice a peer that is already gone
            silent = [f"rank {r} of {world} died with exit code {p.exitcode} and no traceback; "
                      for r, p in enumerate(procs) if r != rank and p.exitcode not in (None, 0)]
            raise AssertionError("".join(silent) + f"rank {rank} of {world} failed:\n{payload}")
        got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return got


def _stop(procs: list, patient: bool) -> None:
    """Give ranks that finished a moment to exit (when `patient`); terminate, then kill, the rest."""
    end = time.monotonic() + (5.0 if patient else 0.0)
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
