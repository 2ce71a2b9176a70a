"""A chunk: a fixed-size flat buffer of one kind of model data, with a host payload and a device cache.

Transitions are the named methods below; each checks the move against `state.CHUNK_MOVES`, does
the work, and sets the new state last. Accounting of bytes and budgets is the residency manager's.

[Note: fenced payloads]
Copies are asynchronous (device.py's Note on tokens), so a payload may still be in flight: an upload
into `device` that compute has not waited for, downloads into `host` the host has not waited for.
Every reader and writer of a payload goes through `device` and `host`, which wait first. Only
bookkeeping that touches no bytes (addresses, pointing views) uses `device_unfenced`. A disk-backed
chunk's `host` first asks its tier (chunks/hostcache.py) to bring the payload into host memory, then
waits for the disk I/O on it, reads and write-backs alike (memory/disk.py's Note on tokens).

[Note: unwritten ranges]
A FREE chunk reads as zeros, but zeroing it when it materializes is a pass over its bytes that is
mostly wasted: a gradient chunk is overwritten whole by its parameters' gradients in almost every
step, and only its padding and parameters that got no gradient need the zeros. So a chunk
materializes with its payload left as the allocator gave it, and remembers the ranges nobody has
written since. A writer that fills a part whole takes it through `overwrite`, which takes that part
off; `device`, `host` and `settled`, the accessors every other reader and every copy goes through,
zero what is still unwritten first. Nothing else may read the bytes of `device_unfenced` or
`host_unfenced`, so no one sees what the allocator left.

[Note: lent ranges]
Copying every gradient into its chunk is a pass over the gradient bytes that plain PyTorch does not
make: autograd hands the optimizer the tensor it computed. So a gradient chunk that stays on the device
may take a gradient by reference instead (`lend`): the tensor autograd made holds that range's value,
and the chunk's device payload is not even allocated while every written range is lent (the lent
tensors take its place in device memory, and the residency counts the chunk's bytes as it did).
Readers that know ranges (the optimizer, clipping, accumulation) use `lent_part` and change a lent
tensor in place. Every other reader goes through `device`, `overwrite` or a download, which first
assemble the payload (allocated, lent ranges copied in, the rest unwritten) or, for an eviction, copy
the lent tensors straight into the host payload: the bytes are the same as if they had been copied in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from chunkmem.chunks.state import CHUNK_MOVES, ChunkState, next_chunk_state
from chunkmem.errors import ChunkStateError
from chunkmem.memory.device import Device
from chunkmem.memory.sim import undefined

Landing = tuple[object, Callable[[], object] | None]  # a download's token, and what to do once it landed


class Waitable(Protocol):
    def wait(self) -> None: ...


class HostTier(Protocol):
    """Where a disk-backed chunk's host payload comes from and goes to (chunks/hostcache.py's HostCache)."""

    def adopt(self, chunk: Chunk) -> None: ...
    def needed(self, chunk: Chunk) -> None:
        """Give `chunk` its host payload now: read back from disk, or fresh for a FREE chunk."""
        ...

    def changed(self, chunk: Chunk) -> None:
        """The host payload changes: the disk copy is stale."""
        ...

    def unread(self, chunk: Chunk) -> None:
        """The read filling `chunk`'s host payload failed: the tier takes the buffer back (Chunk.settled)."""
        ...


class Chunk:
    """`numel` elements of `dtype`. host: allocated (pinned on CUDA), but for a disk-backed chunk (`tier`)
    only while it is in host memory. device: None or a copy."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, device: Device, tier: HostTier | None = None,
                 lends: bool = False, family: str = "") -> None:
        self.name = name
        self.family = family or name  # its family's name (family.py), which moves report
        self.lends = lends  # materializes on the device lending its payload (the Note on lent ranges)
        self.numel = numel
        self.dtype = dtype
        self._dev = device
        self.tier = tier
        self._host: torch.Tensor | None = None if tier else device.host_alloc(numel, dtype)  # [numel] on host
        self._device: torch.Tensor | None = None  # [numel] on the compute device when resident
        self.state = ChunkState.FREE
        self.pins = 0  # member tensors in COMPUTE
        self.pending: object | None = None  # the device's token for an upload compute has not waited on
        self._last_copy: object | None = None  # the newest copy that read or wrote the device payload
        self._host_read_by: object | None = None  # an upload from the host payload the host has not waited for
        self.landings: list[Landing] = []  # downloads into `host` not waited for, oldest first
        self.io: list[Waitable] = []  # disk reads into and writes from `host` not waited for
        self.reading: Waitable | None = None  # the read that fills `host` from disk, until waited for
        self.unwritten: list[tuple[int, int]] = []  # [start, end) of `_fresh` nobody wrote yet (Note above)
        self._fresh: torch.Tensor | None = None  # the payload, device or host, those ranges are in
        self.lent: dict[int, torch.Tensor] = {}  # start -> the tensor holding [start, start + numel) (Note above)
        self._unallocated: Device | None = None  # where the device payload goes once assembled (Note above)
        if tier is not None:
            tier.adopt(self)

    @property
    def host(self) -> torch.Tensor:
        """The host payload, [numel], once it is in host memory and every copy or disk I/O on it is done."""
        if self.tier is not None:
            self.tier.needed(self)
        return self.settled()

    def landed(self) -> torch.Tensor:
        """The host payload once every copy into it has landed, its unwritten ranges as they are: for views of
        ranges written (`p.grad`, runtime/grads.py), not for reading it whole."""
        self.settled_copies()
        return self.host_unfenced

    def settled_copies(self) -> None:
        landings, self.landings = self.landings, []
        if landings:  # downloads, on one stream: the newest has landed only once every earlier one has
            self._dev.wait_host(landings[-1][0])
        for _, then in landings:
            if then is not None:
                then()

    def settled(self) -> torch.Tensor:
        """The host payload in host memory, once every copy and disk I/O on it is done (the tier's own access)."""
        self.settled_copies()
        io, self.io = self.io, []
        for index, done in enumerate(io):
            try:
                done.wait()
            except BaseException:
                failed = getattr(done, "failure", None) is not None  # else timed out or interrupted: waited for again
                self.io = io[index + 1 if failed else index:] + self.io
                if failed and done is self.reading:  # its buffer holds no values: on disk alone, read anew when needed
                    self.state, self._host, self.reading = self._check("spill"), None, None
                    self.tier.unread(self)  # type: ignore[union-attr]  # (a read is a tier's)
                raise
        self.reading = None
        if self._host is None:
            raise ChunkStateError(f"{self!r} has no host payload: it is on disk (a bug: its tier must bring it back)")
        self._zero_unwritten(self._host)
        return self._host

    def viewed_elsewhere(self) -> bool:
        """Whether a FREE chunk's host payload is viewed by a tensor not the chunk's own (one the user kept)."""
        if self.state is not ChunkState.FREE or self._host is None or self.landings or self.io:
            return False
        storage = self._host.untyped_storage()
        return torch._C._storage_Use_Count(storage._cdata) > 2  # `_host`'s and `storage`'s own references

    def renew_host(self) -> None:
        """A FREE chunk takes a fresh host payload, leaving the old one to what still views it."""
        if self.state is not ChunkState.FREE:
            raise ChunkStateError(f"{self!r}: renew_host needs a FREE chunk, whose values nobody reads")
        self._host = self._dev.host_alloc(self.numel, self.dtype)

    def give_host(self, buffer: torch.Tensor, read: Waitable | None) -> None:
        """The tier hands this chunk its host payload: `buffer`, being filled by the disk `read` (DISK -> HOST),
        or fresh, for a FREE chunk."""
        if read is not None:
            self.state = self._check("load")
            self.io.append(read)
        self.reading = read
        self._host = buffer

    def read_ahead(self) -> object | None:
        """The host payload made ready for a reader on another thread (runtime/ahead.py): the ranges nobody wrote
        zeroed now (no copy writes them), and the token of the newest download into it, which that reader waits
        for (`Device.wait_landed`; None: nothing in flight). The host still waits itself before it reads. Only
        for a chunk whose host payload is its only copy, none of whose downloads adds into it on landing."""
        if self.state is not ChunkState.HOST or self.io or any(then is not None for _, then in self.landings):
            raise ChunkStateError(f"{self!r}: read ahead needs the host payload to be the only copy, written by "
                                  "plain downloads")
        self._zero_unwritten(self._host)
        return self.landings[-1][0] if self.landings else None

    def swap_host(self, buffer: torch.Tensor) -> torch.Tensor:
        """Make `buffer` ([numel] of dtype, on the host) the host payload and return the old one: an update made
        into other buffers takes effect (runtime/ahead.py). The host payload must be the only copy, settled, with
        nothing unwritten and no upload reading it."""
        if (self.state is not ChunkState.HOST or self.landings or self.io or self.unwritten
                or self._host_read_by is not None or self._host is None):
            raise ChunkStateError(f"{self!r}: swap_host needs a settled host payload that is the only copy")
        if buffer.shape != (self.numel,) or buffer.dtype != self.dtype or buffer.device.type != "cpu":
            raise ValueError(f"{self!r}: swap_host got {tuple(buffer.shape)} x {buffer.dtype} on {buffer.device}")
        old, self._host = self._host, buffer
        return old

    def spill(self) -> None:
        """Give the host payload up (HOST -> DISK; a FREE chunk stays FREE). The tier has written it back and
        waited, so nothing is in flight on it."""
        new = self.state if self.state is ChunkState.FREE else self._check("spill")
        if self.io or self.landings:
            raise ChunkStateError(f"{self!r}: spill while a copy or disk I/O on its host payload is in flight")
        self._host = None
        self.state = new

    @property
    def device(self) -> torch.Tensor | None:
        """The device payload, [numel], with compute waiting for its upload; None when not resident."""
        self._assemble()
        flat = self.fence()
        self._zero_unwritten(flat)
        return flat

    @property
    def lending(self) -> bool:
        """On the device with no payload allocated: its written ranges are lent tensors (the Note on lent ranges)."""
        return self._unallocated is not None

    def lend(self, start: int, tensor: torch.Tensor) -> None:
        """Let device tensor `tensor` (contiguous) hold the range from `start`, whose writer fills it whole,
        instead of copying it in; only while no payload is allocated (`lending`)."""
        if self._unallocated is None or not tensor.is_contiguous():
            raise ChunkStateError(f"{self!r}: lend needs a contiguous tensor and a chunk lending its payload")
        self.lent[start] = tensor

    def lent_part(self, start: int) -> torch.Tensor | None:
        """The tensor lent for the range from `start`, which its holder may change in place; None if not lent."""
        return self.lent.get(start)

    def _assemble(self) -> None:
        """Allocate the device payload of a lending chunk and copy the lent ranges in."""
        if self._unallocated is None:
            return
        flat = self._device = self._take_written_by_compute(self._unallocated)
        self._unallocated = None
        for tensor, target in self._lent_targets(flat):
            target.copy_(tensor.view(-1))
        self.lent = {}

    def _lent_targets(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each lent tensor with its range of payload `flat`, now unwritten but for those ranges."""
        self._leave_unwritten(flat)
        pairs = [(tensor, flat[start:start + tensor.numel()]) for start, tensor in self.lent.items()]
        for _, target in pairs:
            self._take(flat, target, zero=False)
        return pairs

    def fence(self) -> torch.Tensor | None:
        """Make compute wait for the upload into the device payload, and return it (its unwritten ranges as
        they are: for views and for `overwrite`, not for reading)."""
        if self.pending is not None:
            self._dev.wait(self.pending)
            self.pending = None
        return self._device

    def overwrite(self, part: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`part` of the device payload (a contiguous slice), fenced, for a writer that fills all of it: the rest
        of the chunk keeps reading as zeros without being zeroed now (the Note on unwritten ranges)."""
        self._assemble()
        flat = self.fence()
        if flat is None:
            raise ChunkStateError(f"{self!r}: overwrite needs the chunk on the device")
        target = part(flat)
        self._take(flat, target, zero=False)
        return target

    def _take(self, flat: torch.Tensor, part: torch.Tensor, zero: bool) -> None:
        """`part` of payload `flat` is written from now on: no longer unwritten (zeroed now if `zero`: the writer
        adds to what is there)."""
        if not self.unwritten or flat is not self._fresh:
            return
        start = (part.data_ptr() - flat.data_ptr()) // flat.element_size()
        end = start + part.numel()
        kept = []
        for a, b in self.unwritten:
            if b <= start or a >= end:
                kept.append((a, b))
                continue
            if zero:
                flat[max(a, start):min(b, end)].zero_()
            kept += [r for r in ((a, start), (end, b)) if r[0] < r[1]]
        self.unwritten = kept
        if not kept:  # nothing left to zero: let go of the payload (dropped from the device, it must be freed)
            self._fresh = None

    def _zero_unwritten(self, payload: torch.Tensor | None) -> None:
        if payload is not None:
            self._take(payload, payload, zero=True)

    def _leave_unwritten(self, payload: torch.Tensor) -> None:
        self.unwritten, self._fresh = [(0, self.numel)], payload

    @property
    def device_unfenced(self) -> torch.Tensor | None:
        """The device buffer, whether or not its upload has landed: for addresses and views, not bytes."""
        return self._device

    @property
    def host_unfenced(self) -> torch.Tensor:
        """The host buffer, whether or not its downloads have landed: for addresses and views, not bytes."""
        if self._host is None:
            raise ChunkStateError(f"{self!r} has no host payload: it is on disk")
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
        return CHUNK_MOVES.get((self.state, move)) or next_chunk_state(self.state, move, repr(self))

    def materialize_host(self) -> None:
        """FREE -> HOST: the host payload reads as zeros from now on (zeroed when first read: the Note on
        unwritten ranges). Its old bytes are poisoned in the simulation, as fresh device memory is."""
        new = self._check("materialize_host")
        self.host_writable()
        self._leave_unwritten(undefined(self.host))
        self._changed()
        self.state = new

    def _changed(self) -> None:
        if self.tier is not None:
            self.tier.changed(self)

    def materialize_device(self, dev: Device) -> None:
        """FREE -> DEVICE_DIRTY, reading as zeros; a chunk that `lends` allocates its payload only when a reader
        needs it (the Note on lent ranges)."""
        new = self._check("materialize_device")
        if self.lends:
            self._unallocated = dev
        else:
            self._device = self._take_written_by_compute(dev)
            self._leave_unwritten(self._device)
        self.state = new

    def _take_written_by_compute(self, dev: Device) -> torch.Tensor:
        """A device payload from the arena (arena.py's Note on chunk memory) that compute writes first: compute
        waits for the slot's last copy, if one is still reading or writing it."""
        payload, after = dev.arena.take(self.numel, self.dtype)
        if after is not None:
            dev.wait(after)
        return undefined(payload)

    def upload(self, dev: Device) -> None:
        new = self._check("upload")
        payload, after = dev.arena.take(self.numel, self.dtype)
        self._device = payload
        self.pending = self._last_copy = self._host_read_by = dev.upload(self.host, payload, self.name, after)
        self.state = new

    def host_writable(self) -> None:
        """The host is about to change the host payload: an upload still reading it must have landed first (compute
        waiting for it tells the host nothing: device.py's Note on tokens)."""
        if self._host_read_by is not None:
            self._dev.wait_host(self._host_read_by)
            self._host_read_by = None

    def download(self, dev: Device) -> None:
        """Start copying the device payload to the host; `host` waits for it when next read."""
        new = self._check("download")
        if self.lending:  # the lent tensors go straight to the host payload, the rest is zeroed there now
            self.host_writable()
            host = self.settled()
            pairs = self._lent_targets(host)
            self._zero_unwritten(host)
            for tensor, target in pairs:  # one dtype, as the copy engine moves bytes (a gradient lent in fp32 of a
                # parameter cast in forward is rounded as copying it in rounds it)
                self.landings.append((dev.download(tensor.view(-1).to(self.dtype), target, self.name), None))
        else:
            self._last_copy = dev.download(self.device, self.host_unfenced, self.name)  # type: ignore[arg-type]
            self.landings.append((self._last_copy, None))
        self._changed()
        self.state = new

    def receive(self, dev: Device, source: torch.Tensor, part: Callable[[torch.Tensor], torch.Tensor],
                staged: torch.Tensor | None = None) -> None:
        """Start copying device tensor `source` into `part(host payload)` (a slice of it), or, through the host
        buffer `staged` (source's shape), adding it there; `host` waits for it when next read. The chunk must
        be HOST: the host payload is the only copy."""
        if self.state is not ChunkState.HOST:
            raise ChunkStateError(f"{self!r}: receive needs the host payload to be the only copy")
        self.host_writable()
        target = part(self.host_unfenced)
        self._take(self.host_unfenced, target, zero=staged is not None)
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
        if self._device is not None:  # its slot is free for the next chunk, after the last copy on it
            if self._fresh is self._device:
                self.unwritten, self._fresh = [], None
            self._dev.arena.give(self._device, self._last_copy)
        self._device, self.pending, self._unallocated, self._last_copy = None, None, None, None
        self.lent.clear()

    def write_host(self) -> None:
        new = self._check("write_host")
        self.host_writable()
        self._changed()
        self.state = new

    def write_device(self) -> None:
        self.state = self._check("write_device")

    def reset(self) -> None:
        new = self._check("reset")
        self._check_unpinned("reset")
        self._forget_device()
        # Downloads into the host payload still land (the host waits for them: they write its bytes), but
        # what was queued after them, gradients added from staging buffers, is forgotten with the contents.
        landings, self.landings = self.landings, []
        if landings:
            self._dev.wait_host(landings[-1][0])
        self.unwritten, self._fresh = [], None
        self.state = new

    def _check_unpinned(self, move: str) -> None:
        if self.pins:
            raise ChunkStateError(f"{self!r}: {move} while {self.pins} of its tensors are in COMPUTE")
