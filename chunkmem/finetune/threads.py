"""How many CPU threads a run computes with: fewer than the cores, so that nothing waits on a busy one.

torch's intra-op pool (OpenMP) is the only pool that grows with the cores: chunkmem's native kernel
sizes its OpenMP team from torch's thread count and runs in torch's OpenMP runtime (one libgomp per
process), and the CUDA copy engine uses streams, not threads. A pool as wide as the machine stalls at
every barrier while any one of its cores runs something else (another process, gloo's or autograd's
threads): on this project's busy 2-core machine, 40 steps of the default fine-tune took 4-14x longer
with 2 threads than with 1 (benchmarks/threads.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def cpu_threads(requested: int | None) -> int:
    """CPU threads for torch's intra-op pool, which the native kernel shares (one OpenMP runtime).

    --threads, else OMP_NUM_THREADS as torch read it, else one less than the CPUs this process may
    use: with every core in one pool, a core taken by anything else (another process, gloo's or
    autograd's threads) stalls the pool at each barrier, and a busy 2-core machine ran 4-14x slower
    (benchmarks/threads.py).
    """
    if requested is not None:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, len(os.sched_getaffinity(0)) - 1)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block, and put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
