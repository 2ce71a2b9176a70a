"""Run a function on N gloo ranks in fresh processes; any rank's failure fails the caller, with its traceback.

No fixed ports (a free one is found per run). When one rank fails, the others are terminated
rather than left waiting in a collective, and a deadline bounds the whole run.
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, results: Any, timeout: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), TQDM_DISABLE="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)  # bytes outlive the child; shared tensors would not
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """`fn(rank, world, *args)` on each rank; returns the results by rank or raises the first failure."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, port, results, timeout, args), daemon=True)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline, got = time.monotonic() + timeout, {}
    try:
        while len(got) < world:
            try:
                rank, ok, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                raise AssertionError(f"ranks {dead or 'all'} gave no result within {timeout}s") from None
            if not ok:
                raise AssertionError(f"rank {rank} of {world} failed:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return [got[r] for r in range(world)]
