"""A model of PyTorch's CUDA caching allocator, so that the simulation runs out of memory where a GPU would.

A budget that counts bytes holds on a GPU only if the allocator can place them. CUDA's caching allocator
rounds every request, carves requests out of cached segments and keeps freed blocks for reuse; a block
freed between two live ones is a hole that only a request of its size or smaller can use. So "allocated
bytes within the budget" is not "fits": the lent H100 ran out of memory with 402 MiB reserved but free, in
holes smaller than the 250 MiB chunk it needed. This model keeps the allocator's rules (c10/cuda/
CUDACachingAllocator.cpp, defaults of PyTorch 2.10-2.13), on addresses only, no bytes:

- a request is rounded up to a multiple of 512 bytes; up to 1 MiB it is served from the small pool,
  whose segments are 2 MiB, else from the large pool, whose segments are 20 MiB for requests under
  10 MiB and the request rounded up to 2 MiB otherwise;
- the smallest cached free block of the pool that holds the request serves it (lowest address first
  among equals), split when the rest is worth keeping (small pool: 512 bytes or more; large pool: more
  than 1 MiB; a smaller rest goes with the block);
- a freed block merges with free neighbours of its segment;
- a new segment is reserved only within the cap (`allowed`, set_per_process_memory_fraction's), counting
  every segment reserved; at the cap, the copies still using freed blocks are waited for, every wholly free
  segment is released and the reservation tried once more, then the request fails with
  torch.OutOfMemoryError.

Blocks are freed from any thread (the simulated copy thread drops tensors as their copies land), and from the
garbage collector in the middle of an allocation: a free is queued, and made by whichever thread next holds the
books (`_changing`), so that no two changes of them interleave.

Not modelled: streams (a block is reused only on the stream that allocated it: the simulation computes on
one), expandable segments and max_split_size (off by default), graph pools.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

MiB = 1 << 20
T = TypeVar("T")


class Room(NamedTuple):
    """An allocator's room under its cap (Device.allocation_room). `sure`: the cap less what it holds (live blocks and
    the holes between them), which one new segment gets whatever the holes: wholly free cached segments count, as
    the allocator releases them at its cap. `most`: the cap less the live blocks alone, more than which no request
    gets. `fresh`: the cap less all it reserves, cached segments included: what new segments get with none released.
    Several allocations are certain only within `fresh`, or within `sure` once the cached segments are released: a
    block smaller than a cached segment is carved out of it, which is then neither free nor released, and a larger
    one that counted on it finds no room (Phi in fp32 at 3% of its model data: a weight gradient of 16 KiB after its
    input's of 2 KiB, in a cached segment of 17 KiB)."""

    sure: int
    most: int
    fresh: int


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The allocator's sizes in bytes: CUDA's by default; `scaled(d)` divides them all by `d`, so that a model
    `d` times smaller meets the same rounding and segments, in proportion, as the one it stands for."""

    min_block: int = 512  # requests are rounded up to a multiple of this
    small: int = 1 << 20  # requests up to this go to the small pool
    small_segment: int = 2 << 20
    large_segment: int = 20 << 20  # for large requests under min_large_alloc
    min_large_alloc: int = 10 << 20
    round_large: int = 2 << 20  # larger requests get a segment of their size rounded up to this

    @classmethod
    def scaled(cls, divisor: float) -> Sizes:
        cuda = cls()
        return cls(*(max(1, round(getattr(cuda, f.name) / divisor)) for f in dataclasses.fields(cls)))

    def round(self, nbytes: int) -> int:
        """What the allocator hands out for a request of `nbytes`."""
        return max(1, -(-nbytes // self.min_block)) * self.min_block

    def segment(self, size: int) -> int:
        """The segment reserved for a rounded request that no cached block holds."""
        if size <= self.small:
            return self.small_segment
        if size < self.min_large_alloc:
            return self.large_segment
        return -(-size // self.round_large) * self.round_large

    def segment_for(self, nbytes: int) -> int:
        """What a request of `nbytes` reserves when no cached block holds it (Device.segment_for)."""
        return self.segment(self.round(nbytes))


@dataclasses.dataclass(eq=False)
class Segment:
    address: int
    size: int
    small: bool
    blocks: int = 1  # blocks it is split into (one: it is whole)


@dataclasses.dataclass(eq=False)
class Block:
    segment: Segment
    address: int
    size: int
    used: bool = False
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int]:
        return self.size, self.address


class CachingAllocator:
    """The blocks and segments of one device, as PyTorch's caching allocator would lay them out."""

    def __init__(self, allowed: int | None = None, sizes: Sizes = Sizes(),
                 settle: Callable[[], None] = lambda: None) -> None:
        self.sizes = sizes
        self.allowed = allowed  # most bytes of segments reserved at once; None: no cap
        # At the cap CUDA's allocator first waits for the copies still using freed blocks (record_stream's events):
        # `settle` lands them, so that the blocks they held are freed before the cache is released.
        self.settle = settle
        self.reserved = 0
        self.allocated = 0
        self.releasable = 0  # bytes of cached segments wholly free: what the allocator gives back at the cap
        self._held_peak = 0  # the most `held` since the last `take_reading`
        self._largest = 0  # the largest block handed out since then
        self.peak_reserved = 0
        self.peak_allocated = 0
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}  # small? -> (size, addr, block)
        self._segments: list[Segment] = []
        self._addresses = itertools.count(1 << 40, 1 << 36)  # segment base addresses, far apart
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding it
        self._freed: collections.deque[Block] = collections.deque()  # freed, not yet taken off the books

    def _changing(self, change: Callable[[], T]) -> T:
        """`change()` of the books, for this thread alone, with the frees queued so far made first and those queued
        meanwhile after (a function rather than a `with` block: malloc runs for every device tensor)."""
        if self._owner == threading.get_ident():  # a lock this thread holds: it would wait for itself
            raise RuntimeError("chunkmem's allocator model was asked for a change of its books in the middle of "
                               "another, on the same thread: a bug in chunkmem, please report it")
        try:
            with self._lock:
                self._owner = threading.get_ident()
                try:
                    self._take_freed()
                    return change()
                finally:
                    self._owner = None
        finally:
            self._settle_freed()

    def _settle_freed(self) -> None:
        """Make the frees queued while another thread (or this one, further up) held the books: one queued just
        before that thread let go is made here."""
        while self._freed and self._lock.acquire(blocking=False):
            try:
                self._take_freed()
            finally:
                self._lock.release()

    def _take_freed(self) -> None:
        while self._freed:
            self._give_back(self._freed.popleft())

    def malloc(self, nbytes: int) -> Block:
        """A block of at least `nbytes`, or torch.OutOfMemoryError when the cap leaves no room for one."""
        return self._changing(lambda: self._malloc(nbytes))

    def _malloc(self, nbytes: int) -> Block:
        sizes = self.sizes
        size = sizes.round(nbytes)
        small = size <= sizes.small
        block = self._best_fit(small, size)
        if block is None:
            block = self._reserve(nbytes, size, small)
        else:
            self._unlist(block)
            if block.segment.blocks == 1:
                self.releasable -= block.size
        rest = block.size - size
        if rest >= sizes.min_block if small else rest > sizes.small:
            self._split(block, size)
        block.used = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._held_peak = max(self._held_peak, self.held)
        self._largest = max(self._largest, block.size)
        return block

    def free(self, block: Block) -> None:
        """Give `block` back, from any thread; made at once unless another change of the books is under way."""
        self._freed.append(block)
        self._settle_freed()

    def _give_back(self, block: Block) -> None:
        if not block.used:
            raise ValueError(f"block at {block.address:#x} freed twice")
        block.used = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.used:
                self._unlist(neighbour)
                block = self._merge(block, neighbour)
        self._list(block)
        if block.segment.blocks == 1:
            self.releasable += block.size

    @property
    def held(self) -> int:
        """Reserved bytes that are not free for the taking: live blocks and the holes between them (CUDA's active
        plus inactive_split bytes: active counts a block freed while a copy still uses it, as `held` does here)."""
        return self.reserved - self.releasable

    def room(self) -> Room | None:
        """Room for allocations now (Room's fields); None without a cap."""
        return self._changing(lambda: None if self.allowed is None else
                              Room(self.allowed - self.held, self.allowed - self.allocated, self.allowed - self.reserved))

    def take_reading(self) -> tuple[int, int]:
        """The most `held` since the last call (temporaries between two readings included) and the largest block
        handed out since; a new reading starts."""
        return self._changing(self._new_reading)

    def _new_reading(self) -> tuple[int, int]:
        reading = max(self._held_peak, self.held), self._largest
        self._held_peak, self._largest = self.held, 0
        return reading

    def empty_cache(self) -> None:
        """Release every wholly free segment (torch.cuda.empty_cache; also what the allocator does at the cap)."""
        self._changing(self._empty_cache)

    def _empty_cache(self) -> None:
        for segment in [s for s in self._segments if s.blocks == 1]:
            entries = self._free[segment.small]
            at = next((i for i, (_, address, _) in enumerate(entries) if address == segment.address), None)
            if at is None:  # its one block is in use
                continue
            del entries[at]
            self._segments.remove(segment)
            self.reserved -= segment.size
            self.releasable -= segment.size

    def _reserve(self, nbytes: int, size: int, small: bool) -> Block:
        grown = self.sizes.segment(size)
        if self.allowed is not None and self.reserved + grown > self.allowed:
            self.settle()  # the copy thread frees their blocks: queued, as this thread holds the books
            self._take_freed()
            self._empty_cache()
        if self.allowed is not None and self.reserved + grown > self.allowed:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (chunkmem simulation of the caching allocator). Tried to allocate "
                f"{nbytes / MiB:.2f} MiB. {self.allowed / MiB:.2f} MiB allowed; {self.allocated / MiB:.2f} MiB "
                f"allocated; {(self.reserved - self.allocated) / MiB:.2f} MiB reserved but unallocated, in holes "
                f"too small for it (fragmentation)")
        segment = Segment(next(self._addresses), grown, small)
        self._segments.append(segment)
        self.reserved += grown
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return Block(segment, segment.address, grown)

    def _best_fit(self, small: bool, size: int) -> Block | None:
        entries = self._free[small]
        at = bisect.bisect_left(entries, (size, -1))
        return entries[at][2] if at < len(entries) else None

    def _list(self, block: Block) -> None:
        bisect.insort(self._free[block.segment.small], (block.size, block.address, block))

    def _unlist(self, block: Block) -> None:
        entries = self._free[block.segment.small]
        at = bisect.bisect_left(entries, (block.size, block.address))
        if at == len(entries) or entries[at][2] is not block:
            raise RuntimeError(f"chunkmem's allocator model lost the free block at {block.address:#x} ({block.size} "
                               "bytes) from its free list: a bug in chunkmem/memory/allocator.py, please report it")
        del entries[at]

    def _split(self, block: Block, size: int) -> None:
        rest = Block(block.segment, block.address + size, block.size - size, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        block.segment.blocks += 1
        self._list(rest)

    def _merge(self, block: Block, neighbour: Block) -> Block:
        """One free block of `block` and its free neighbour, at the lower address."""
        first, second = (block, neighbour) if block.address < neighbour.address else (neighbour, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.segment.blocks -= 1
        return first
