"""A chunk: a fixed-size flat buffer of one kind of model data, with a host payload and a device cache.

Transitions are the named methods below; each checks the move against `state.CHUNK_MOVES`, does
the work, and sets the new state last. Accounting of bytes and budgets is the residency manager's.
"""

from __future__ import annotations

import torch

from chunkmem.device import Device
from chunkmem.errors import ChunkStateError
from chunkmem.state import ChunkState, next_chunk_state


class Chunk:
    """`numel` elements of `dtype`. host: always allocated (pinned on CUDA). device: None or a copy."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, device: Device) -> None:
        self.name = name
        self.numel = numel
        self.dtype = dtype
        self._dev = device
        self._host: torch.Tensor = device.host_alloc(numel, dtype)  # [numel] on host
        self.device: torch.Tensor | None = None  # [numel] on the compute device when resident
        self.state = ChunkState.FREE
        self.pins = 0  # member tensors in COMPUTE
        self.pending: object | None = None  # the device's token for an upload compute has not waited on
        self.landing: object | None = None  # the device's token for a download into `host` not waited on

    @property
    def host(self) -> torch.Tensor:
        """The host payload, [numel]. A download may still be landing in it (evictions do not wait for
        theirs): every reader comes through here, and waits."""
        if self.landing is not None:
            self._dev.wait_host(self.landing)
            self.landing = None
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
        self.device = dev.alloc(self.numel, self.dtype).zero_()
        self.state = new

    def upload(self, dev: Device) -> None:
        new = self._check("upload")
        self.device = dev.alloc(self.numel, self.dtype)
        self.pending = dev.upload(self.host, self.device)
        self.state = new

    def download(self, dev: Device) -> None:
        """Start copying the device payload to the host; `host` waits for it when next read."""
        new = self._check("download")
        self.landing = dev.download(self.device, self.host)  # type: ignore[arg-type]
        self.state = new

    def drop_device(self) -> None:
        new = self._check("drop_device")
        self._check_unpinned("drop_device")
        self.device = None
        self.state = new

    def write_host(self) -> None:
        self.state = self._check("write_host")

    def write_device(self) -> None:
        self.state = self._check("write_device")

    def reset(self) -> None:
        new = self._check("reset")
        self._check_unpinned("reset")
        self.device = None
        self.state = new

    def _check_unpinned(self, move: str) -> None:
        if self.pins:
            raise ChunkStateError(f"{self!r}: {move} while {self.pins} of its tensors are in COMPUTE")
