"""The CUDA non-model reading, with the allocator and NVML replaced by fakes (no GPU needed)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from chunkmem import gpu_memory
from chunkmem.gpu_memory import DeviceMemory

MiB = 2**20


class FakeNvml:
    """pynvml's calls that DeviceMemory makes, reporting `used` bytes for this process."""

    def __init__(self, used: int | None, fail: bool = False) -> None:
        self.used, self.fail, self.queries = used, fail, 0

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list:
        self.queries += 1
        others = [types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=999 * MiB)]
        mine = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.used)] if self.used is not None else []
        return others + mine


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    readings = {"allocated": 700 * MiB, "reserved": 900 * MiB}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: readings["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: readings["reserved"])
    return readings


def test_nonmodel_is_allocated_minus_chunks_plus_memory_outside_the_allocator(allocator: dict[str, int]) -> None:
    nvml = FakeNvml(used=1400 * MiB)  # 500 MiB beyond what PyTorch reserved: context and workspaces
    memory = DeviceMemory(torch.device("cuda", 0), nvml)
    assert memory.nonmodel(chunk_bytes=200 * MiB) == (700 - 200) * MiB + 500 * MiB


def test_without_nvml_only_the_allocator_counts(allocator: dict[str, int]) -> None:
    assert DeviceMemory(torch.device("cuda", 0), None).nonmodel(chunk_bytes=200 * MiB) == 500 * MiB


def test_the_driver_reading_is_refreshed_at_most_every_refresh_interval(allocator: dict[str, int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(gpu_memory.time, "monotonic", lambda: clock[0])
    nvml = FakeNvml(used=1000 * MiB)
    memory = DeviceMemory(torch.device("cuda", 0), nvml)
    assert memory.outside_allocator() == 100 * MiB
    nvml.used = 1300 * MiB
    allocator["allocated"] = 800 * MiB  # the allocator is read every time
    assert memory.nonmodel(0) == 800 * MiB + 100 * MiB and nvml.queries == 1
    clock[0] += gpu_memory.REFRESH_S
    assert memory.outside_allocator() == 400 * MiB and nvml.queries == 2


def test_an_nvml_failure_falls_back_to_the_allocator_with_a_log_line(allocator: dict[str, int],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    memory = DeviceMemory(torch.device("cuda", 0), FakeNvml(used=None, fail=True))
    with caplog.at_level("INFO", logger="chunkmem"):
        assert memory.nonmodel(chunk_bytes=0) == 700 * MiB
    assert memory.nvml is None and "NVML cannot read" in caplog.text


def test_a_process_nvml_does_not_list_counts_nothing_outside(allocator: dict[str, int]) -> None:
    # In a container with its own PID namespace NVML lists host PIDs: ours is absent.
    memory = DeviceMemory(torch.device("cuda", 0), FakeNvml(used=None))
    assert memory.outside_allocator() == 0 and memory.nvml is not None
