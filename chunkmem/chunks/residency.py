"""Which chunks are on the device: the budget, evictions and the bytes that move.

The manager is the only place that moves chunks between host and device, so its counters are the
truth for `memory_stats()`. Which chunk to evict is a policy's choice (`EvictionPolicy`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.observe import Move, Observer
from chunkmem.chunks.state import ChunkState
from chunkmem.errors import ACTIVATION_FIXES, MemoryBudgetError
from chunkmem.memory.device import Device

log = logging.getLogger("chunkmem")
T = TypeVar("T")


class EvictionPolicy(Protocol):
    def accessed(self, chunk: Chunk) -> None: ...
    def victim(self, candidates: list[Chunk]) -> Chunk: ...


class LeastRecentlyUsed:
    """Evict the resident chunk whose last access is oldest."""

    def __init__(self) -> None:
        self._clock = itertools.count()
        self._last: dict[str, int] = {}

    def accessed(self, chunk: Chunk) -> None:
        self._last[chunk.name] = next(self._clock)

    def victim(self, candidates: list[Chunk]) -> Chunk:
        return min(candidates, key=lambda c: self._last.get(c.name, -1))


@dataclasses.dataclass
class TrafficStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    device_chunk_bytes: int = 0
    device_chunk_bytes_peak: int = 0
    uploads: int = 0
    evictions: int = 0
    prefetches: int = 0
    prefetch_bytes: int = 0  # of h2d_bytes, sent up ahead of the access that needs them (the copy overlaps compute)
    grad_stream_bytes: int = 0  # gradients copied straight to the host as backward writes them
    oom_fallbacks: int = 0
    prefetches_dropped: int = 0  # prefetches the allocator had no room for: left to come when needed
    updates_moved_to_host: int = 0  # homed groups' updates the device had no room for (optim's _room_on_device)
    updates_sliced: int = 0  # homed groups' updates made a slice of their range at a time (optim's _room_on_device)
    update_runs_split: int = 0  # fp32 runs updated a parameter (or a slice) at a time: no room for their temporaries


class Residency:
    """Keeps the device's chunk bytes within `limit`, evicting by `policy` when a chunk must come in.

    `on_move(chunk)` is called whenever a chunk's device payload appears or goes, so parameter
    views can follow it. `before_leave(chunk)`, when set, is called before a chunk's device payload is read
    back to the host, dropped or reset: the last moment to finish writing it (rules.py's Note on updates made
    together).
    """

    def __init__(self, device: Device, limit: int, policy: EvictionPolicy,
                 on_move: Callable[[Chunk], None], observers: list[Observer] | None = None) -> None:
        self.device = device
        self._limit = limit
        self.policy = policy
        self.on_move = on_move
        self.observers = observers if observers is not None else []
        self.stats = TrafficStats()
        self.resident: dict[str, Chunk] = {}
        self.by_storage: dict[int, Chunk] = {}  # device payload data_ptr -> chunk
        self.before_leave: Callable[[Chunk], None] | None = None
        # Makes dirty a clean device payload written through views the runtime does not see (ParamStore's
        # note_writes), before it leaves: it is read back, as a dirty one is.
        self.note_writes: Callable[[Chunk], None] = lambda chunk: None
        device.arena.fit(limit)

    @property
    def limit(self) -> int:
        """Most chunk bytes on the device; the arena holds no more slots than that (arena.py's Note)."""
        return self._limit

    @limit.setter
    def limit(self, limit: int) -> None:
        # Set at every access: the arena has nothing to do when the limit stays and its slots fit it.
        arena = self.device.arena
        if limit != self._limit or arena.footprint > limit:
            self._limit = limit
            arena.fit(limit)

    def to_device(self, chunk: Chunk, reason: str = "on-demand") -> torch.Tensor:
        """Make `chunk` resident (evicting others if needed) and return its device payload, to read."""
        self.bring(chunk, reason)
        return chunk.device  # type: ignore[return-value]

    def bring(self, chunk: Chunk, reason: str = "on-demand") -> None:
        """Make `chunk` resident (evicting others if needed), with compute waiting for its upload; a prefetch
        overlaps what runs now, and compute waits for it where the chunk is used (Chunk.fence)."""
        self.policy.accessed(chunk)
        if not chunk.state.on_device:
            self._make_room(chunk)
            try:
                self._bring(chunk, reason)
            except torch.OutOfMemoryError as error:
                if reason == "prefetch":  # a chunk ahead of need is not worth one the access now needs: it comes
                    self.stats.prefetches_dropped += 1  # when needed (the fallback below evicts what is not pinned)
                    return
                # The budget was right for chunks but the device is full (non-model data grew beyond the
                # warm-up's record).
                # The message, not the error: a handler keeping records (pytest's) would keep its traceback's frames,
                # and with them a failing backward's graph.
                log.warning("device out of memory bringing %s (%s): evicting chunks not in use until it fits; "
                            "if this repeats, lower Config.device_memory", chunk.name, str(error))
                try:
                    self.retry_out_of_memory(error, lambda: self._bring(chunk, reason))
                except torch.OutOfMemoryError as failed:
                    raise MemoryBudgetError(
                        f"chunk {chunk.name} needs {chunk.nbytes} bytes on the device and no chunk is left to "
                        f"make room for it: the device budget ({self.limit} bytes for chunks) cannot hold it beside "
                        "what the process holds there (activations, temporaries, the caching allocator's segments of "
                        f"2 or 20 MiB; the allocator's figures below): {ACTIVATION_FIXES}, or lower "
                        f"Config.chunk_size. The allocator said: {failed}") from failed
            self._added(chunk)
        if reason != "prefetch":
            chunk.fence()

    def _bring(self, chunk: Chunk, reason: str) -> None:
        if chunk.state is ChunkState.FREE:
            chunk.materialize_device(self.device)
            return
        start = time.perf_counter()
        chunk.upload(self.device)
        self.stats.h2d_bytes += chunk.nbytes
        self.stats.uploads += 1
        self.stats.prefetches += reason == "prefetch"
        self.stats.prefetch_bytes += chunk.nbytes if reason == "prefetch" else 0
        self.report(chunk, "host", "device", chunk.nbytes, time.perf_counter() - start, reason)

    def to_host(self, chunk: Chunk, reason: str = "optimizer") -> torch.Tensor:
        """Bring the host payload up to date (the device copy, if any, stays) and return it."""
        self._write_back(chunk, reason)
        return chunk.host

    def _write_back(self, chunk: Chunk, reason: str) -> None:
        """Start bringing the host payload up to date; whoever reads `chunk.host` next waits for it."""
        if self.before_leave is not None:
            self.before_leave(chunk)
        self.note_writes(chunk)
        if chunk.state is ChunkState.DEVICE_DIRTY:
            start = time.perf_counter()
            chunk.download(self.device)
            self.stats.d2h_bytes += chunk.nbytes
            self.report(chunk, "device", "host", chunk.nbytes, time.perf_counter() - start, reason)
        elif chunk.state is ChunkState.FREE:
            chunk.materialize_host()
        elif chunk.state is ChunkState.DISK:
            chunk.host  # its tier reads it back (chunks/hostcache.py): HOST again

    def report(self, chunk: Chunk, src: str, dst: str, nbytes: int, seconds: float, reason: str) -> None:
        for observer in self.observers:
            observer.moved(Move(chunk.name, chunk.family, src, dst, nbytes, seconds, reason))

    def stream_down(self, chunk: Chunk, source: torch.Tensor, part: Callable[[torch.Tensor], torch.Tensor],
                    staged: torch.Tensor | None = None) -> None:
        """Copy device tensor `source` into `part` of `chunk`'s host payload, made the only copy (or add it there,
        through `staged`: Chunk.receive): a gradient written straight to the host, where the optimizer steps."""
        self.claim_host(chunk)
        chunk.receive(self.device, source, part, staged)
        self.stats.d2h_bytes += source.nbytes
        self.stats.grad_stream_bytes += source.nbytes
        self.report(chunk, "device", "host", source.nbytes, 0.0, "evict")

    def copy_on_host(self, chunk: Chunk, source: Chunk) -> None:
        """Make `chunk`'s host payload, its only copy, a copy of `source`'s freshest payload (2BW keeping the
        parameters' newest version as the older one): a download when that payload is the device's."""
        down = source.state is ChunkState.DEVICE_DIRTY
        self.host_for_write(chunk).copy_(source.payload())
        if down:
            self.stats.d2h_bytes += chunk.nbytes
            self.report(chunk, "device", "host", chunk.nbytes, 0.0, "optimizer")

    def host_for_write(self, chunk: Chunk) -> torch.Tensor:
        """The host payload, made the only copy, for code that is about to change it on the host."""
        self.claim_host(chunk)
        return chunk.host

    def claim_host(self, chunk: Chunk) -> None:
        """Make the host payload the only copy (a write-back, if any, still landing), for code that will
        change it on the host."""
        self._write_back(chunk, "optimizer")
        if chunk.state.on_device:
            self._drop(chunk)
        chunk.write_host()

    def reserve(self, blocks: list[int], keep: Iterable[Chunk], fall_back: bool = True) -> None:
        """Allocate blocks of these byte sizes on the device and free them, before an operation that allocates as
        much and cannot be redone once begun (a homed group's update: planning's Note on update scratch). Refused,
        they fall back as a chunk's upload does, `keep` staying (or, without `fall_back`, the allocator's error is
        raised, nothing moved); freed, they wait in the caching allocator for the operation's own allocations,
        which nothing else comes between."""
        def allocate() -> list[torch.Tensor]:
            return [self.device.alloc(-(-nbytes // 4), torch.float32) for nbytes in blocks]

        kept = list(keep)
        for chunk in kept:
            chunk.pins += 1
        try:
            allocate()
        except torch.OutOfMemoryError as error:
            if not fall_back:
                raise
            self.retry_out_of_memory(error, allocate)
        finally:
            for chunk in kept:
                chunk.pins -= 1

    def retry_out_of_memory(self, error: torch.OutOfMemoryError, retry: Callable[[], T]) -> T:
        """After an out-of-memory error: give the allocator what the failed allocation needs, a chunk nothing uses
        at a time (the policy's victim) with every free slot, and `retry()` until it succeeds; the error again
        when nothing is left to give."""
        self.stats.oom_fallbacks += 1
        try:
            while True:
                candidates = [c for c in self.resident.values() if not c.pins]
                if candidates:
                    self.evict(self.policy.victim(candidates))
                    self.stats.evictions += 1
                released = self.device.arena.free_bytes
                self.device.arena.release()
                if not candidates and not released:
                    raise error
                try:
                    return retry()
                except torch.OutOfMemoryError as again:
                    error = again
        finally:  # the error's traceback holds this frame and those calling it: held by name here, the cycle would
            del error  # keep them, and what they hold (a backward's graph), until the collector ran

    def evict(self, chunk: Chunk) -> None:
        if chunk.state.on_device:
            self._write_back(chunk, "evict")  # not waited for: the copy overlaps what runs next
            self._drop(chunk)

    def reset(self, chunk: Chunk) -> None:
        """Forget the chunk's contents: it reads as zeros again (gradients at zero_grad)."""
        if self.before_leave is not None:
            self.before_leave(chunk)
        if chunk.state.on_device:
            self._removed(chunk)
        chunk.reset()
        self.on_move(chunk)

    def fits(self, chunks: Iterable[Chunk]) -> bool:
        """Whether these chunks could all be resident at once, together with the pinned ones."""
        pinned = sum(c.nbytes for c in self.resident.values() if c.pins)
        extra = sum(c.nbytes for c in set(chunks) if not c.pins)
        return pinned + extra <= self.limit

    def shrink(self) -> None:
        """After the limit was lowered: evict chunks nothing uses until the resident ones fit, if they can."""
        self._evict_down_to(self.limit)

    def _make_room(self, chunk: Chunk) -> None:
        if not self._evict_down_to(self.limit - chunk.nbytes):
            pinned = ", ".join(c.name for c in self.resident.values())
            raise MemoryBudgetError(
                f"chunk {chunk.name} needs {chunk.nbytes} bytes on the device but "
                f"{self.stats.device_chunk_bytes} of the {self.limit} allowed are held by chunks "
                f"in use ({pinned}): raise Config.device_memory or lower Config.chunk_size")

    def _evict_down_to(self, target: int) -> bool:
        """Evict chunks nothing uses, the policy's victims first, until at most `target` bytes are
        resident; False when the chunks in use alone hold more."""
        while self.stats.device_chunk_bytes > target:
            candidates = [c for c in self.resident.values() if not c.pins]
            if not candidates:
                return False
            self.evict(self.policy.victim(candidates))
            self.stats.evictions += 1
        return True

    def _drop(self, chunk: Chunk) -> None:
        self._removed(chunk)
        chunk.drop_device()
        self.on_move(chunk)
        self.device.arena.fit(self._limit)  # a slot freed beyond a lowered limit goes back to the allocator

    def _added(self, chunk: Chunk) -> None:
        self.resident[chunk.name] = chunk
        if chunk.device_unfenced is not None:  # a lending chunk has no payload yet (chunk's Note on lent ranges)
            self.by_storage[chunk.device_unfenced.untyped_storage().data_ptr()] = chunk
        self.stats.device_chunk_bytes += chunk.nbytes
        self.stats.device_chunk_bytes_peak = max(self.stats.device_chunk_bytes_peak,
                                                 self.stats.device_chunk_bytes)
        self.on_move(chunk)

    def _removed(self, chunk: Chunk) -> None:
        del self.resident[chunk.name]
        if chunk.device_unfenced is not None:
            self.by_storage.pop(chunk.device_unfenced.untyped_storage().data_ptr(), None)
        self.stats.device_chunk_bytes -= chunk.nbytes
