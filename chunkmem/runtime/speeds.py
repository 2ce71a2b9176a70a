"""What updating a chunk group on the host costs against copying, for the planner's choice of homes (planning's
Note on homes by time).

On a GPU machine the host update of a streamed group takes longer than its copies (the lent H200 updated 96 GB of
chunk bytes a second on 16 cores and copied 53 GB a second), so homes chosen by bytes moved alone leave too much to
the host. The planner weighs each byte a host update reads and writes as `host_weight` bytes of copying: the
pinned upload speed over the native kernel's, both measured here on CUDA (a few milliseconds at prepare). The
simulation has neither speed and plans with the lent H200's (SIM_WEIGHT), so that CI plans as that machine did.
torch.optim's update on the host (the native kernel off: the simulation's default, bit-identical to torch.optim)
plans by bytes alone (weight 0), as before this was built.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from chunkmem.config import Config
from chunkmem.memory import native
from chunkmem.memory.device import Device

# GB/s on the lent H200 (gpu_session_h200.json): run 2's pinned uploads, and the 10% row's native updates
SIM_WEIGHT = 52.9 / 95.9
ELEMENTS = 1 << 21  # a measured update's: 32 MiB of update bytes (16 per element)
COPY_BYTES = 16 << 20  # a measured copy's: 0.3 ms at 50 GB/s, long beside the ~10 us of issuing and waiting
UPDATE_BYTES = 16  # per element: bf16 parameter and gradient, fp32 master and two states (planning.update_bytes)
TRIES = 3


def host_weight(config: Config, device: Device) -> float:
    """The planner's host_weight for a run of `config` on `device`."""
    if not config.uses_native_optimizer:
        return 0.0
    if device.torch_device.type != "cuda" or native.load() is None:
        return SIM_WEIGHT
    return copy_speed(device) / update_speed()


def update_speed(threads: int = 0, elements: int = ELEMENTS) -> float:
    """Bytes of chunk data (UPDATE_BYTES an element) the native Adam kernel updates a second on `threads` (0:
    torch's), best of TRIES."""
    master, exp_avg, exp_avg_sq = (torch.zeros(elements, dtype=torch.float32, device="cpu") for _ in range(3))
    grad = torch.ones(elements, dtype=torch.bfloat16, device="cpu")
    param = torch.empty(elements, dtype=torch.bfloat16, device="cpu")
    return elements * UPDATE_BYTES / _best(lambda step: native.adam_step(
        master, grad, exp_avg, exp_avg_sq, param, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        decoupled=True, step=step, threads=threads))


def copy_speed(device: Device) -> float:
    """Bytes a second of a pinned host-to-device copy of COPY_BYTES, best of TRIES."""
    host = device.host_alloc(COPY_BYTES, torch.uint8)
    target = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device.torch_device)
    seconds = _best(functools.partial(_upload, device, host, target))
    del target
    device.empty_cache()  # not left cached in the allocator, where the budget would count it
    return COPY_BYTES / seconds


def _upload(device: Device, host: torch.Tensor, target: torch.Tensor, _: int) -> None:
    device.wait_host(device.upload(host, target))


def _best(run: Callable[[int], object]) -> float:
    """The shortest of TRIES timed calls `run(i)` (i from 2), after one untimed call `run(1)`."""
    run(1)
    times = []
    for i in range(2, TRIES + 2):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    return max(min(times), 1e-9)
