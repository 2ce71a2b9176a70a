"""The compute device behind one small interface: CUDA, or the CPU simulation of one.

In the simulation the "device" is ordinary CPU memory kept apart from the host payloads, so every
placement decision and every copy happens for real and is counted, on a machine without a GPU.
"""

from __future__ import annotations

from typing import Protocol

import psutil
import torch


class Device(Protocol):
    torch_device: torch.device

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def upload(self, host: torch.Tensor, device: torch.Tensor) -> object | None:
        """Start a host-to-device copy; returns a token for `wait` (None when already complete)."""
        ...

    def wait(self, token: object) -> None:
        """Make compute wait for the copy behind `token`, without blocking the host."""
        ...

    def download(self, device: torch.Tensor, host: torch.Tensor) -> None: ...
    def free_bytes(self) -> int: ...


class SimulatedDevice:
    """A device simulated in CPU memory: separate buffers, real copies.

    `fail_allocations` makes the next that many allocations raise torch.OutOfMemoryError, as a
    full GPU would, so the fallback path is tested without one.
    """

    torch_device = torch.device("cpu")

    def __init__(self) -> None:
        self.fail_allocations = 0

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.fail_allocations > 0:
            self.fail_allocations -= 1
            raise torch.OutOfMemoryError(f"simulated: no device memory for {numel} x {dtype}")
        return torch.empty(numel, dtype=dtype)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def upload(self, host: torch.Tensor, device: torch.Tensor) -> object | None:
        device.copy_(host)
        return None

    def wait(self, token: object) -> None:
        pass

    def download(self, device: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(device)

    def free_bytes(self) -> int:
        return psutil.virtual_memory().available


class CudaDevice:
    """A CUDA device: pinned host payloads and a copy stream fenced against the compute stream."""

    def __init__(self, name: str) -> None:
        self.torch_device = torch.device(name)
        if self.torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.copy_stream = torch.cuda.Stream(self.torch_device)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def upload(self, host: torch.Tensor, device: torch.Tensor) -> object | None:
        # The copy runs on its own stream; compute waits for it only where the chunk is used, so a
        # prefetch overlaps with the module running now.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self.copy_stream):
            device.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        device.record_stream(self.copy_stream)
        return done

    def wait(self, token: object) -> None:
        torch.cuda.current_stream(self.torch_device).wait_event(token)  # type: ignore[arg-type]

    def download(self, device: torch.Tensor, host: torch.Tensor) -> None:
        # The host copy is read by host code right after, so this waits for it.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(device, non_blocking=True)
        device.record_stream(self.copy_stream)
        self.copy_stream.synchronize()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.torch_device)[0]


def make_device(name: str) -> Device:
    return SimulatedDevice() if name == "cpu" else CudaDevice(name)
