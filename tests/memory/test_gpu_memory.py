"""The CUDA non-model reading, with the allocator and NVML replaced by fakes (no GPU needed)."""

from __future__ import annotations

import gc
import os
import types

import pytest
import torch

from chunkmem.memory import gpu_memory
from chunkmem.memory.gpu_memory import DeviceMemory
from chunkmem.memory.simmemory import SimulatedMemory

MiB = 2**20


UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]  # NVML's order: the machine's
VISIBLE = [2, 0]  # CUDA_VISIBLE_DEVICES=2,0: torch's cuda:0 is NVML's device 2


class FakeNvml:
    """pynvml's calls that DeviceMemory makes. This process uses `used` bytes on NVML device `ours` only
    (`used=None`: NVML does not list it), so reading the wrong device reads nothing."""

    def __init__(self, used: int | None, fail: bool = False, ours: int = VISIBLE[0], others: int = 1) -> None:
        self.used, self.fail, self.ours, self.others, self.queries = used, fail, ours, others, 0

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return UUIDS.index(uuid)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # NVML's numbering, not CUDA_VISIBLE_DEVICES'
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        self.queries += 1
        others = [types.SimpleNamespace(pid=os.getpid() + 1 + i, usedGpuMemory=999 * MiB) for i in range(self.others)]
        mine = [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.used)] \
            if self.used is not None and handle == self.ours else []
        return others + mine


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    readings = {"allocated": 700 * MiB, "pending": 30 * MiB, "holes": 50 * MiB, "reserved": 900 * MiB}
    # A block freed while a copy stream may still read it (record_stream) leaves allocated at once, active only once
    # that stream passed the event (c10's DeviceCachingAllocator::free, then free_block).
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "allocated_bytes.all.current": readings["allocated"],
        "active_bytes.all.current": readings["allocated"] + readings["pending"],
        "inactive_split_bytes.all.current": readings["holes"]})
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: readings["reserved"])
    # torch reports UUIDs without NVML's "GPU-" prefix, numbered as CUDA_VISIBLE_DEVICES renumbers devices.
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(uuid=UUIDS[VISIBLE[index]].removeprefix("GPU-")))
    return readings


def test_the_allocator_holds_its_live_blocks_and_the_holes_between_them_and_nvml_sees_the_rest(allocator) -> None:
    # Allocated, freed but still used by a copy, and the holes in split segments (room chunks cannot count on), not
    # wholly free cached segments.
    assert gpu_memory.held_bytes(torch.device("cuda", 0)) == (700 + 30 + 50) * MiB
    nvml = FakeNvml(used=1400 * MiB)  # 500 MiB beyond what PyTorch reserved: context and workspaces
    assert DeviceMemory(torch.device("cuda", 0), nvml).outside_allocator() == 500 * MiB


def test_without_nvml_nothing_counts_outside_the_allocator(allocator: dict[str, int]) -> None:
    assert DeviceMemory(torch.device("cuda", 0), None).outside_allocator() == 0


def test_the_driver_reading_is_refreshed_at_most_every_refresh_interval(allocator: dict[str, int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(gpu_memory.time, "monotonic", lambda: clock[0])
    nvml = FakeNvml(used=1000 * MiB)
    memory = DeviceMemory(torch.device("cuda", 0), nvml)
    assert memory.outside_allocator() == 100 * MiB
    nvml.used = 1300 * MiB
    assert memory.outside_allocator() == 100 * MiB and nvml.queries == 1
    clock[0] += gpu_memory.REFRESH_S
    assert memory.outside_allocator() == 400 * MiB and nvml.queries == 2


def test_an_nvml_failure_falls_back_to_the_allocator_with_a_log_line(allocator: dict[str, int],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    memory = DeviceMemory(torch.device("cuda", 0), FakeNvml(used=None, fail=True))
    with caplog.at_level("INFO", logger="chunkmem"):
        assert memory.outside_allocator() == 0
    assert memory.nvml is None and "NVML cannot read" in caplog.text


def test_in_another_pid_namespace_the_one_process_nvml_lists_is_ours_and_of_several_none(
        allocator: dict[str, int], caplog: pytest.LogCaptureFixture) -> None:
    # In a container with its own PID namespace NVML lists host PIDs: ours is absent. A rank per GPU: the one listed.
    assert DeviceMemory(torch.device("cuda", 0), FakeNvml(used=None)).outside_allocator() == 99 * MiB
    memory = DeviceMemory(torch.device("cuda", 0), FakeNvml(used=None, others=2))
    with caplog.at_level("INFO", logger="chunkmem"):
        assert memory.outside_allocator() == 0 and memory.nvml is not None
        memory.outside_allocator(fresh=True)
    assert caplog.text.count("none with this process's PID") == 1
    assert DeviceMemory(torch.device("cuda", 0), FakeNvml(used=1400 * MiB, others=2)).outside_allocator() == 500 * MiB


def test_nvml_reads_the_device_torch_means_under_cuda_visible_devices(allocator: dict[str, int]) -> None:
    # torch's cuda:0 is NVML's device 2 here; reading NVML's device 0 (its own numbering) sees nothing of ours.
    assert DeviceMemory(torch.device("cuda", 0), FakeNvml(used=1400 * MiB)).outside_allocator() == 500 * MiB
    assert DeviceMemory(torch.device("cuda", 1), FakeNvml(used=1400 * MiB, ours=0)).outside_allocator() == 500 * MiB
    wrong = FakeNvml(used=1400 * MiB, others=2)  # NVML's device 0 lists two other processes, not ours
    assert DeviceMemory(torch.device("cuda", 1), wrong).outside_allocator() == 0


def test_the_allocator_cap_is_the_budgets_less_memory_outside_the_allocator() -> None:
    assert gpu_memory.allocator_fraction([(40 * MiB, 8 * MiB)], 80 * MiB) == pytest.approx(0.4)
    assert gpu_memory.allocator_fraction([(40 * MiB, 0), (30 * MiB, 0)], 80 * MiB) == pytest.approx(70 / 80)
    assert gpu_memory.allocator_fraction([(100 * MiB, 0)], 80 * MiB) == 1.0
    with pytest.raises(ValueError, match=r"device_memory \(8 MiB\) leaves nothing for training: .* holds 16 MiB"):
        gpu_memory.allocator_fraction([(8 * MiB, 16 * MiB)], 80 * MiB)


def test_the_simulations_cap_for_several_models_counts_what_the_process_holds_outside_once_as_cudas_does() -> None:
    # Two models on one device read the process's bytes outside the allocator at different times (8, then 10 MiB):
    # CUDA's cap (device._apply_cap) is their budgets less the most read, once; the simulation's took each model's
    # budget less its own reading, the outside bytes twice.
    class Owner:  # a runtime, as far as the cap goes: held weakly
        pass

    memory = SimulatedMemory()
    first, second = Owner(), Owner()
    memory.limit(first, 40 * MiB, 8 * MiB)
    memory.limit(second, 30 * MiB, 10 * MiB)
    assert memory.allocator.allowed == gpu_memory.allocator_cap([(40 * MiB, 8 * MiB), (30 * MiB, 10 * MiB)])
    assert memory.allocator.allowed == 60 * MiB
    del second
    gc.collect()
    assert memory.allocator.allowed == 32 * MiB, "a model gone takes its budget with it"
