"""The multi-process harness itself: results come back, and failures fail fast with their cause."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_workers


def summed(rank: int, world: int, base: int) -> int:
    value = torch.tensor(rank + base)
    dist.all_reduce(value)
    return int(value)


def raises_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("rank one's own error")
    dist.barrier()  # rank 0 would wait here for ever without the harness stopping it


def dies_on_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_by_rank_and_failures_carry_their_traceback() -> None:
    assert run_workers(summed, 2, 10, timeout=60) == [21, 21]
    begin = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*KeyError.*rank one's own error"):
        run_workers(raises_on_one, 2, timeout=60)
    with pytest.raises(AssertionError, match="rank 1 of 2 died with exit code 3"):
        run_workers(dies_on_one, 2, timeout=60)
    assert time.monotonic() - begin < 30, "a failed rank stops the run at once, not at the deadline"
