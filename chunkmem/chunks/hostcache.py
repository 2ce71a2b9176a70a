"""The host side of the disk tier: which disk-backed chunks (master weights, optimizer states) hold host
memory now, within a fixed room, and the reads and write-backs that move them (memory/disk.py).

[Note: three tiers]
Parameters and gradients stay in host memory (the device needs them every step); the chunks the
optimizer alone touches are disk-backed: each has a slot in the disk tier's file and holds a host
buffer only while it is in the room `capacity`, which is what `Config.host_memory` leaves after the
parameter and gradient chunks (runtime/limits.py `disk_room`). Groups with disk-backed chunks are
never homed on the device (chunks/placement.py), so the device tier holds parameters and gradients,
the host tier those and the room, the disk tier the rest.

[Note: the plan]
The optimizer takes its groups one at a time, inside `using(chunks)`: those chunks are held (never
evicted) while the group updates, and on the way out the ones it changed are written back at once
(write-behind: the write overlaps the next groups' updates). The warm-up step records the sequence
of `using` calls; from then on that record is the plan, cyclic (a step's end is followed by the next
step's start). With the plan, the chunk to leave host memory is the one needed furthest in the future
(Belady; least recently used before there is a plan), and after every `using` call and at every
moment of forward and backward (`tick`) the chunks needed next are read ahead into free room, or into
room a chunk needed later than them gives up, as long as that chunk's write-back has landed: a read
ahead never waits. So while group g updates, the reads of g+1, g+2, ... and the write of g-1 are in
flight, and at a step's end the reads of the next step's first groups overlap its forward and backward.
Between `using` calls only landing write-backs can let a read ahead go further, so a moment scans the
plan again only once a write the last scan stopped at has landed. A step whose `using` sequence
differs from the plan becomes the next plan.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.observe import Move, Observer
from chunkmem.chunks.plan import INFINITY
from chunkmem.chunks.state import ChunkState
from chunkmem.errors import DiskTierError, MemoryBudgetError
from chunkmem.memory.disk import DiskTier, IoToken, aligned

log = logging.getLogger("chunkmem")
STATS = ("disk_prefetch_bytes", "disk_on_demand_bytes", "disk_stall_seconds", "host_cache_bytes_peak")


class HostCache:
    """Disk-backed chunks in at most `capacity` bytes of host buffers (`alloc(nbytes)`: an aligned uint8 buffer)."""

    def __init__(self, disk: DiskTier, capacity: int, alloc: Callable[[int], torch.Tensor],
                 observers: list[Observer] | None = None) -> None:
        self.disk = disk
        self.capacity = capacity
        self.alloc = alloc
        self.observers = observers if observers is not None else []
        self.chunks: dict[str, Chunk] = {}
        self.slots: dict[str, int] = {}  # chunk -> offset in the disk tier's file
        self.buffers: dict[str, torch.Tensor] = {}  # chunk -> its aligned host buffer: the chunks in host memory
        self.lru: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.used = 0
        self.dirty: set[str] = set()  # host newer than disk
        self.writes: dict[str, IoToken] = {}  # write-backs not known to have landed
        self.held: collections.Counter[str] = collections.Counter()
        self.events: list[tuple[str, ...]] = []  # this step's `using` calls
        self.plan: list[tuple[str, ...]] | None = None
        self.positions: dict[str, list[int]] = {}  # chunk -> indices of the plan's uses of it
        self.where: dict[tuple[str, ...], list[int]] = {}
        self.cursor = -1  # the plan's use being served
        # The writes whose landing would let the last read-ahead scan go further (none: it went as far as it
        # can until the next `using`); None: scan again at the next moment.
        self.waiting_for: list[IoToken] | None = None
        self.stats_: dict[str, int | float] = dict.fromkeys(STATS, 0)
        self.stats_["host_cache_capacity_bytes"] = capacity

    # -- HostTier (chunk.py) --------------------------------------------------------------------------
    def adopt(self, chunk: Chunk) -> None:
        self.chunks[chunk.name] = chunk
        self.slots[chunk.name] = self.disk.slot(chunk.nbytes)

    def needed(self, chunk: Chunk) -> None:
        self.waiting_for = None
        name = chunk.name
        if name in self.buffers:
            self.lru.move_to_end(name)
            return
        self._make_room(aligned(chunk.nbytes))
        self._load(chunk, "on-demand")

    def changed(self, chunk: Chunk) -> None:
        self.dirty.add(chunk.name)

    def unread(self, chunk: Chunk) -> None:
        """Its buffer goes: the read that filled it failed (a caller that went on after the error, to save a checkpoint,
        read its unfilled bytes as values), and the next access reads the disk again. Not written back: a write it was
        taken for (`changed`) saw only the read's error."""
        self.used -= self.buffers.pop(chunk.name).numel()
        del self.lru[chunk.name]
        self.dirty.discard(chunk.name)

    # -- the optimizer's groups --------------------------------------------------------------------
    @contextlib.contextmanager
    def using(self, chunks: Iterable[Chunk]) -> Iterator[None]:
        """Hold these chunks in host memory meanwhile; write back what changed on the way out (the Note on the plan)."""
        mine = [c for c in dict.fromkeys(chunks) if c.tier is self]
        names = tuple(c.name for c in mine)
        if not names:
            yield
            return
        self.events.append(names)
        self.waiting_for = None
        self._advance(names)
        self.held.update(names)
        try:
            for chunk in mine:
                if chunk.name not in self.buffers:
                    self._make_room(aligned(chunk.nbytes))
                    self._load(chunk, "on-demand")
            if self.plan is not None:
                self._prefetch()
            yield
        finally:
            self.held.subtract(names)
            for chunk in mine:
                if chunk.name in self.dirty and not self.held[chunk.name]:
                    self._write(chunk)

    def tick(self) -> None:
        """A moment of forward or backward: read ahead what landed write-backs made room for."""
        if self.plan is not None and (self.waiting_for is None or any(t.done() for t in self.waiting_for)):
            self._prefetch()

    def step_done(self) -> None:
        """The optimizer step ended: its `using` calls are the next step's plan when they differ from the plan."""
        events, self.events = self.events, []
        self.waiting_for = None
        if events and events != self.plan:
            if self.plan is not None:
                log.info("the optimizer took its disk-backed groups in another order than its plan: the next "
                         "step reads ahead by this step's order")
            self.plan = events
            self.positions, self.where = {}, {}
            for index, names in enumerate(events):
                self.where.setdefault(names, []).append(index)
                for name in names:
                    self.positions.setdefault(name, []).append(index)
        self.cursor = -1

    def _advance(self, names: tuple[str, ...]) -> None:
        """Move the cursor to this use in the plan, at the cursor or later; off the plan it stays."""
        found = self.where.get(names, [])
        at = bisect.bisect_right(found, self.cursor)
        if at < len(found):
            self.cursor = found[at]

    def next_use(self, name: str) -> int:
        """When the plan needs `name` next, counted from the cursor (a use in the next step counts past this one's)."""
        positions = self.positions.get(name)
        if not positions or self.plan is None:
            return INFINITY
        at = bisect.bisect_right(positions, self.cursor)
        return positions[at] if at < len(positions) else len(self.plan) + positions[0]

    # -- moving chunks -----------------------------------------------------------------------------
    def _load(self, chunk: Chunk, reason: str) -> None:
        """Give `chunk` a host buffer (room made by the caller), reading its bytes back unless it is FREE."""
        name, size = chunk.name, aligned(chunk.nbytes)
        buffer = self.alloc(size)  # [size] uint8, aligned
        read = None
        if chunk.state is ChunkState.DISK:
            read = self.disk.read(self.slots[name], buffer, name)
            self.stats_["disk_prefetch_bytes" if reason == "prefetch" else "disk_on_demand_bytes"] += size
            self._report(name, "disk", "host", size, reason)
        elif chunk.state is not ChunkState.FREE:
            raise AssertionError(f"{chunk!r} is not in host memory, yet neither on disk nor free")
        chunk.give_host(buffer[:chunk.nbytes].view(chunk.dtype), read)
        self.buffers[name] = buffer
        self.lru[name] = None
        self.used += size
        self.stats_["host_cache_bytes_peak"] = max(self.stats_["host_cache_bytes_peak"], self.used)

    def _write(self, chunk: Chunk) -> None:
        """Start writing a changed chunk back; it stays in host memory, clean, until its room is needed."""
        name = chunk.name
        chunk.settled()  # copies or reads into it land first
        token = self.disk.write(self.slots[name], self.buffers[name], name)
        chunk.io.append(token)  # whoever touches the payload next waits for the write
        self.writes[name] = token
        self.dirty.discard(name)
        self._report(name, "host", "disk", token.nbytes, "write-back")

    def _release(self, name: str) -> None:
        chunk = self.chunks[name]
        self._failed_write(name)
        if name in self.dirty:
            self._write(chunk)
        try:
            chunk.settled()  # the write-back (if any) has landed: the buffer may go
        except DiskTierError:
            self._failed_write(name)
            raise
        self.writes.pop(name, None)
        chunk.spill()
        self.used -= self.buffers.pop(name).numel()
        del self.lru[name]

    def _failed_write(self, name: str) -> None:
        """A write-back that failed (it raised wherever it was waited for: here, a step, a checkpoint's read) left the
        disk with older bytes: the buffer keeps the changed ones, and its next release writes them again. Spilled as if
        written, a caller that went on after the error (to save a checkpoint) read the older."""
        write = self.writes.get(name)
        if write is not None and write.failure is not None:
            del self.writes[name]
            self.dirty.add(name)

    def _make_room(self, nbytes: int) -> None:
        """Release chunks (the plan's or LRU's victims, waiting for their write-backs) until `nbytes` fit."""
        while self.used + nbytes > self.capacity:
            candidates = [n for n in self.lru if not self.held[n]]
            if not candidates:
                raise MemoryBudgetError(
                    f"the disk tier's room in host memory, {self.capacity} bytes, cannot hold the chunks the optimizer "
                    f"needs at once ({self.used + nbytes} bytes): raise Config.host_memory or lower Config.chunk_size")
            victim = max(candidates, key=self.next_use) if self.plan is not None else candidates[0]
            start = time.perf_counter()
            self._release(victim)
            self.stats_["disk_stall_seconds"] += time.perf_counter() - start

    def _prefetch(self) -> None:
        """Read ahead the plan's next uses, in order, while room is free or given up by a chunk needed later
        whose write-back has landed; stop at the first that does not fit (a read ahead never waits)."""
        assert self.plan is not None
        self.waiting_for = []
        length = len(self.plan)
        for step in range(1, length + 1):
            at = self.cursor + step
            for name in self.plan[at % length]:
                if name in self.buffers:
                    continue
                size = aligned(self.chunks[name].nbytes)
                while self.used + size > self.capacity:
                    victim = self._spare(at)
                    if victim is None:
                        return
                    self._release(victim)
                self._load(self.chunks[name], "prefetch")

    def _spare(self, at: int) -> str | None:
        """A chunk in host memory, not held, clean, its write landed, needed after plan position `at`: the latest.
        None when there is none; the writes that would give one once landed go to `waiting_for`."""
        best, best_use = None, at
        pending = []
        for name in self.lru:
            self._failed_write(name)
            if self.held[name] or name in self.dirty:
                continue
            use = self.next_use(name)
            if use <= best_use:
                continue
            token = self.writes.get(name)
            if token is not None and not token.done():
                pending.append(token)
                continue
            best, best_use = name, use
        if best is None:
            self.waiting_for = pending
        return best

    def _report(self, name: str, src: str, dst: str, nbytes: int, reason: str) -> None:
        for observer in self.observers:
            observer.moved(Move(name, self.chunks[name].family, src, dst, nbytes, 0.0, reason))

    # -- books ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        out = dict(self.stats_)
        # Bytes read and written are the disk tier's own counts: one counter per figure.
        disk = self.disk.stats
        out.update(host_cache_bytes=self.used, disk_bytes=self.disk.size, disk_read_bytes=disk["read_bytes"],
                   disk_write_bytes=disk["write_bytes"], disk_wait_seconds=round(disk["wait_seconds"], 6))
        return out

    def close(self) -> None:
        """Remove the disk tier's files (the run cannot go on without them)."""
        self.disk.close()
