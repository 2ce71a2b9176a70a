"""What a CUDA device holds besides chunkmem's chunks: the non-model memory the placement plans around.

Two parts. PyTorch's allocator reports what it holds: its live blocks, and the free blocks between them in
segments it has split (`held_bytes`); minus a model's chunk memory (its arena of slots,
chunkmem/memory/arena.py), that is activations, temporaries and communication buffers, with the holes they
leave. The holes count: one is reserved but usable only by a request that fits in it, and the lent H100 ran
out of memory with 402 MiB reserved and free, in holes. Wholly free cached segments do not count: the
allocator releases them at its cap and retries. Memory outside PyTorch's allocator (the CUDA context,
cuBLAS/cuDNN workspaces, NCCL's own buffers) shows only in the driver's per-process reading, which NVML
gives: the process's used bytes minus what PyTorch has reserved.

The outside part changes rarely (it grows when a library first initialises) and an NVML query costs
tens of microseconds, so it is read at most every REFRESH_S seconds, not at every moment. NVML numbers
its devices its own way, not as CUDA_VISIBLE_DEVICES renumbers them for the process, so the device
is found by its UUID.

[Note: the budget and the caching allocator]
The placement keeps a model's chunk memory plus everything else the process reserves within
`device_memory`: chunks in the arena's slots, which activations never see (arena.py's Note on chunk
memory), and the rest counted as the allocator holds it, holes included, so that what the plan gives chunks
is room CUDA really has. On CUDA a prepared model also caps the allocator with
`torch.cuda.set_per_process_memory_fraction`: what it may reserve is the device budget (the sum of the
budgets of the live prepared models on that device) less what the process holds outside the allocator
(NVML's reading at prepare, read again after the first step: libraries load lazily). At the cap the
allocator releases cached blocks and retries before it reports out of memory, and chunkmem's fallback then
evicts chunks, gives their slots back and retries. So reserved memory, plus what NVML sees outside it,
stays within the budget by construction; `chunkmem selftest` measures `max_memory_reserved` against it.
The cap is process-wide for that device, as the budget means everything the process takes there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from typing import Any

import torch

log = logging.getLogger("chunkmem")
REFRESH_S = 1.0
MiB = 1 << 20


class DeviceMemory:
    """What the process holds on one CUDA device outside PyTorch's allocator. `nvml` is the pynvml module, or None
    (nothing is counted outside)."""

    def __init__(self, device: torch.device, nvml: Any = None) -> None:
        self.device = device
        self.nvml = nvml
        self._handle: Any = None
        self._outside = 0
        self._read_at = -REFRESH_S
        self._unlisted = False  # NVML listed processes on the device, none of them this one (logged once)

    def outside_allocator(self, fresh: bool = False) -> int:
        """Bytes this process holds on the device that PyTorch's allocator did not reserve (0 without NVML); read
        again at most every REFRESH_S seconds, or now if `fresh`."""
        if self.nvml is None or (not fresh and time.monotonic() - self._read_at < REFRESH_S):
            return self._outside
        self._read_at = time.monotonic()
        used = self._process_used()
        if used is not None:
            self._outside = max(0, used - torch.cuda.memory_reserved(self.device))
        return self._outside

    def _process_used(self) -> int | None:
        """This process's bytes on the device by NVML, or None when it cannot tell. In a container NVML lists the
        host's PIDs, not ours: there the one process it lists on the device is taken for this one (a rank per GPU),
        and with several listed nothing is counted outside the allocator (a log line says so, once)."""
        nvml = self.nvml
        try:
            if self._handle is None:
                nvml.nvmlInit()
                self._handle = nvml.nvmlDeviceGetHandleByUUID(nvml_uuid(self.device))
            listed = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(self._handle) if p.usedGpuMemory is not None]
            ours = [p for p in listed if p.pid == os.getpid()] or (listed if len(listed) == 1 else [])
            if ours:
                return int(ours[0].usedGpuMemory)
            if not self._unlisted:
                self._unlisted = True
                log.info("chunkmem: NVML lists %d processes on %s, none with this process's PID (another PID "
                         "namespace?): what this process holds outside PyTorch's allocator is not counted",
                         len(listed), self.device)
        except Exception as error:  # NVMLError has many subclasses; none of them should stop training
            log.info("chunkmem: NVML cannot read this process's device memory (%s); counting the allocator only",
                     error)
            self.nvml = None
        return None


def held_bytes(device: torch.device) -> int:
    """What the caching allocator holds on `device` and would not give back at its cap: its live blocks, those freed
    while a copy on another stream may still use them (record_stream: no longer allocated, not reusable until that
    stream passes the event, as the simulation holds a copy's source until it lands), and the free blocks between
    them in split segments (holes a request fits only if it is no larger). Wholly free cached segments are not
    counted: the allocator releases them and retries before it runs out of memory."""
    return held_in(torch.cuda.memory_stats(device))


def held_in(stats: dict[str, int]) -> int:
    """`held_bytes` by the allocator's statistics `stats` (torch.cuda.memory_stats)."""
    return stats.get("active_bytes.all.current", 0) + stats.get("inactive_split_bytes.all.current", 0)


def nvml_uuid(device: torch.device) -> str:
    """The device's UUID as NVML spells it ("GPU-..."); torch reports it without the prefix."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def allocator_cap(budgets: Collection[tuple[int, int]]) -> int:
    """What the caching allocator may reserve on a device for the prepared models there, each given as (its budget,
    what the process held outside the allocator when it last read it): their budgets less those bytes, counted once,
    as the most read (the process's, not any model's: see the Note on the budget). CUDA's cap (CudaDevice) and the
    simulation's (SimulatedMemory) both."""
    total, outside = sum(b for b, _ in budgets), max(o for _, o in budgets)
    if total - outside <= 0:
        raise ValueError(f"device_memory ({total / MiB:.0f} MiB) leaves nothing for training: this process "
                         f"already holds {outside / MiB:.0f} MiB on the device outside PyTorch's allocator (CUDA "
                         "context, libraries), and the budget counts those bytes too; give device_memory those "
                         "bytes plus what training needs (chunkmem.memory.gpu_memory.outside_bytes reads them)")
    return total - outside


def allocator_fraction(budgets: Collection[tuple[int, int]], total: int) -> float:
    """The share of a device of `total` bytes the caching allocator may reserve (`allocator_cap`)."""
    return min(1.0, allocator_cap(budgets) / total)


def outside_bytes(device: str | torch.device) -> int:
    """What this process holds on `device` outside PyTorch's allocator now: 0 in the simulation or without
    NVML. `device_memory` counts these bytes (the Note on the budget): a budget meant as N bytes for model
    data and activations is N plus these, read after the CUDA libraries the run uses have loaded."""
    device = torch.device(device)
    return DeviceMemory(device, load_nvml()).outside_allocator() if device.type == "cuda" else 0


def load_nvml() -> Any:
    """The pynvml module (package nvidia-ml-py), or None when it is not installed."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    return pynvml
