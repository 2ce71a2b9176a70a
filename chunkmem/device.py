"""The compute device behind one small interface: CUDA, or the CPU simulation of one.

In the simulation the "device" is ordinary CPU memory kept apart from the host payloads, so every
placement decision and every copy happens for real and is counted, on a machine without a GPU.
Host payloads come from a `HostPool` (chunkmem/hostpool.py) on both: pinned on CUDA, its twin in
simulation, with the same reuse, cap and fallback.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import psutil
import torch

from chunkmem import native
from chunkmem.config import parse_size
from chunkmem.hostpool import EngineAllocator, HostAllocator, HostPool, PlainAllocator, RegisteredAllocator


class Device(Protocol):
    torch_device: torch.device
    host_pool: HostPool  # where host_alloc's buffers come from; its stats() go into memory_stats()

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def upload(self, host: torch.Tensor, device: torch.Tensor) -> object | None:
        """Start a host-to-device copy; returns a token for `wait` (None when already complete)."""
        ...

    def wait(self, token: object) -> None:
        """Make compute wait for the copy behind `token`, without blocking the host."""
        ...

    def download(self, device: torch.Tensor, host: torch.Tensor) -> object | None:
        """Start a device-to-host copy; returns a token for `wait_host` (None when already complete)."""
        ...

    def wait_host(self, token: object) -> None:
        """Block the host until the copy behind `token` has landed in host memory."""
        ...

    def free_bytes(self) -> int: ...


class SimulatedDevice:
    """A device simulated in CPU memory: separate buffers, real copies.

    `fail_allocations` makes the next that many allocations raise torch.OutOfMemoryError, as a
    full GPU would, so the fallback path is tested without one.
    """

    torch_device = torch.device("cpu")

    def __init__(self, host_memory: int | None = None) -> None:
        self.fail_allocations = 0
        self.host_pool = HostPool(PlainAllocator(pinned=True), host_memory)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.fail_allocations > 0:
            self.fail_allocations -= 1
            raise torch.OutOfMemoryError(f"simulated: no device memory for {numel} x {dtype}")
        return torch.empty(numel, dtype=dtype)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_pool.tensor(numel, dtype)

    def upload(self, host: torch.Tensor, device: torch.Tensor) -> object | None:
        device.copy_(host)
        return None

    def wait(self, token: object) -> None:
        pass

    def download(self, device: torch.Tensor, host: torch.Tensor) -> object | None:
        # The copy happens when someone waits for it, as an asynchronous one may land as late: a host
        # read that does not wait sees stale bytes here too, so the parity tests would catch it.
        return _Landing(device, host)

    def wait_host(self, token: object) -> None:
        assert isinstance(token, _Landing)
        token.host.copy_(token.device)

    def free_bytes(self) -> int:
        return psutil.virtual_memory().available


@dataclasses.dataclass(frozen=True)
class _Landing:
    """A simulated device-to-host copy not yet made; it keeps the device buffer alive, as CUDA's
    record_stream does."""

    device: torch.Tensor
    host: torch.Tensor


class CudaDevice:
    """A CUDA device: pinned host payloads and copy streams fenced against the compute stream.

    Uploads and downloads run on their own streams, so an eviction's copy overlaps with compute and
    with the next upload; events are the tokens. With the copy engine built (chunkmem/native.py)
    copies go through it, into cudaHostAlloc'd host memory. Without it, the same with PyTorch.
    """

    def __init__(self, name: str, host_memory: int | None = None) -> None:
        self.torch_device = torch.device(name)
        if self.torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
        module = native.load_copy_engine()
        self.engine: Any = None  # the device's CopyEngine when the extension is built
        self.h2d_stream: torch.cuda.Stream  # uploads
        self.d2h_stream: torch.cuda.Stream  # downloads
        allocator: HostAllocator
        if module is not None:
            self.engine = native.copy_engine(self.torch_device.index)
            allocator = EngineAllocator(module)
            # The engine's streams as torch sees them, for record_stream on the buffers they read or fill.
            self.h2d_stream = torch.cuda.ExternalStream(self.engine.h2d_stream, device=self.torch_device)
            self.d2h_stream = torch.cuda.ExternalStream(self.engine.d2h_stream, device=self.torch_device)
        else:
            allocator = RegisteredAllocator()
            self.h2d_stream = torch.cuda.Stream(self.torch_device)
            self.d2h_stream = torch.cuda.Stream(self.torch_device)
        self.host_pool = HostPool(allocator, host_memory)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_pool.tensor(numel, dtype)

    def upload(self, host: torch.Tensor, device: torch.Tensor) -> object | None:
        # Compute waits for it only where the chunk is used, so a prefetch overlaps the module running now.
        return self._copy(device, host, self.h2d_stream, device)

    def wait(self, token: object) -> None:
        compute = torch.cuda.current_stream(self.torch_device)
        if self.engine is not None:
            token.wait(compute.cuda_stream)  # type: ignore[attr-defined]
        else:
            compute.wait_event(token)  # type: ignore[arg-type]

    def download(self, device: torch.Tensor, host: torch.Tensor) -> object | None:
        # The chunk lets go of `device` at once; the host waits for the copy only when it reads `host`.
        return self._copy(host, device, self.d2h_stream, device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream,
              device_buffer: torch.Tensor) -> object:
        """`dst.copy_(src)` on `stream` (the engine picks its own by direction) after what compute has
        queued: a new device buffer was allocated there, an evicted one last written there. Returns an
        event that marks the copy's end. record_stream keeps the caching allocator from handing
        `device_buffer` out again before the copy is done with it."""
        compute = torch.cuda.current_stream(self.torch_device)
        if self.engine is not None:
            done = self.engine.copy([dst], [src], compute.cuda_stream)
        else:
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
        device_buffer.record_stream(stream)
        return done

    def wait_host(self, token: object) -> None:
        token.synchronize()  # type: ignore[attr-defined]

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.torch_device)[0]


def make_device(name: str, host_memory: int | str | None = None) -> Device:
    """The device `name` ("cpu" is the simulation) pinning at most `host_memory` bytes of host buffers."""
    limit = parse_size("host_memory", host_memory)
    device: Device = SimulatedDevice(limit) if name == "cpu" else CudaDevice(name, limit)
    native.report_missing(cuda=name != "cpu")
    return device
