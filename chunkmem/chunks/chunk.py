"""A chunk: a fixed-size flat buffer of one kind of model data, with a host payload and a device cache.

Transitions are the named methods below; each checks the move against `state.CHUNK_MOVES`, does
the work, and sets the new state last. Accounting of bytes and budgets is the residency manager's.

[Note: fenced payloads]
Copies are asynchronous (device.py's Note on tokens), so a payload may still be in flight: an upload
into `device` that compute has not waited for, downloads into `host` the host has not waited for.
Every reader and writer of a payload goes through `device` and `host`, which wait first. Only
bookkeeping that touches no bytes (addresses, pointing views) uses `device_unfenced`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chunkmem.chunks.state import ChunkState, next_chunk_state
from chunkmem.errors import ChunkStateError
from chunkmem.memory.device import Device

Landing = tuple[object, Callable[[], object] | None]  # a download's token, and what to do once it landed


class Chunk:
    """`numel` elements of `dtype`. host: always allocated (pinned on CUDA). device: None or a copy."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, device: Device) -> None:
        self.name = name
        self.numel = numel
        self.dtype = dtype
        self._dev = device
        self._host: torch.Tensor = device.host_alloc(numel, dtype)  # [numel] on host
        self._device: torch.Tensor | None = None  # [numel] on the compute device when resident
        self.state = ChunkState.FREE
        self.pins = 0  # member tensors in COMPUTE
        self.pending: object | None = None  # the device's token for an upload compute has not waited on
        self.landings: list[Landing] = []  # downloads into `host` not waited for, oldest first

    @property
    def host(self) -> torch.Tensor:
        """The host payload, [numel], once every download into it has landed."""
        landings, self.landings = self.landings, []
        for token, then in landings:
            self._dev.wait_host(token)
            if then is not None:
                then()
        return self._host

    @property
    def device(self) -> torch.Tensor | None:
        """The device payload, [numel], with compute waiting for its upload; None when not resident."""
        if self.pending is not None:
            self._dev.wait(self.pending)
            self.pending = None
        return self._device

    @property
    def device_unfenced(self) -> torch.Tensor | None:
        """The device buffer, whether or not its upload has landed: for addresses and views, not bytes."""
        return self._device

    @property
    def host_unfenced(self) -> torch.Tensor:
        """The host buffer, whether or not its downloads have landed: for addresses and views, not bytes."""
        return self._host

    def __repr__(self) -> str:
        return f"Chunk({self.name}, {self.numel} x {self.dtype}, {self.state.name}, pins={self.pins})"

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def payload(self) -> torch.Tensor:
        """The freshest copy, wherever it is (zeros are materialized on the host when FREE)."""
        if self.state is ChunkState.FREE:
            self.materialize_host()
        return self.device if self.state.on_device else self.host  # type: ignore[return-value]

    def _check(self, move: str) -> ChunkState:
        return next_chunk_state(self.state, move, repr(self))

    def materialize_host(self) -> None:
        new = self._check("materialize_host")
        self.host.zero_()
        self.state = new

    def materialize_device(self, dev: Device) -> None:
        new = self._check("materialize_device")
        self._device = dev.alloc(self.numel, self.dtype).zero_()
        self.state = new

    def upload(self, dev: Device) -> None:
        new = self._check("upload")
        self._device = dev.alloc(self.numel, self.dtype)
        self.pending = dev.upload(self.host, self._device, self.name)
        self.state = new

    def download(self, dev: Device) -> None:
        """Start copying the device payload to the host; `host` waits for it when next read."""
        new = self._check("download")
        self.landings.append((dev.download(self.device, self._host, self.name), None))  # type: ignore[arg-type]
        self.state = new

    def receive(self, dev: Device, source: torch.Tensor, part: Callable[[torch.Tensor], torch.Tensor],
                staged: torch.Tensor | None = None) -> None:
        """Start copying device tensor `source` into `part(host payload)` (a slice of it), or, through the host
        buffer `staged` (source's shape), adding it there; `host` waits for it when next read. The chunk must
        be HOST: the host payload is the only copy."""
        if self.state is not ChunkState.HOST:
            raise ChunkStateError(f"{self!r}: receive needs the host payload to be the only copy")
        target = part(self._host)
        if staged is None:
            self.landings.append((dev.download(source, target, self.name), None))
        else:
            self.landings.append((dev.download(source, staged, self.name), lambda: target.add_(staged)))

    def drop_device(self) -> None:
        new = self._check("drop_device")
        self._check_unpinned("drop_device")
        self._forget_device()
        self.state = new

    def _forget_device(self) -> None:
        if self.pending is not None:  # a prefetch never used: its bytes will not be read
            self._dev.discard(self.pending)
        self._device, self.pending = None, None

    def write_host(self) -> None:
        self.state = self._check("write_host")

    def write_device(self) -> None:
        self.state = self._check("write_device")

    def reset(self) -> None:
        new = self._check("reset")
        self._check_unpinned("reset")
        self._forget_device()
        self.state = new

    def _check_unpinned(self, move: str) -> None:
        if self.pins:
            raise ChunkStateError(f"{self!r}: {move} while {self.pins} of its tensors are in COMPUTE")
