"""Host memory for chunk payloads: page-locked where possible, reused at exact sizes, capped.

Why not `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds requests up to a
power of two by default, so a 384 MiB chunk pins 512 MiB, and it has no cap, so pinning past what the
machine can spare ends with the OOM killer (DeepSpeed users know this as "pinned-memory host OOM"). Here:

- `HostAllocator` is the tiny mechanism: exact-size raw blocks, pinned or not, and freeing them.
  On CUDA that is cudaHostAlloc (the copy engine in csrc/) or cudaHostRegister on plain memory; in
  the CPU simulation, ordinary memory counted as pinned, so CI exercises every line of the policy.
- `HostPool` is the policy: a freed block is kept and handed to the next request of exactly its byte
  size; a new block is pinned only within `limit` (Config.host_memory) and while the machine keeps a
  reserve of RAM; past that, pageable memory, with one warning. It counts everything (`stats()`).

[Note: how the pool learns a buffer is free]
A buffer is handed out as a tensor made by `torch.frombuffer` over a ctypes view of the block. The
tensor's storage holds that view and drops it when the last tensor or view sharing the storage
dies; a finalizer on the view then returns the block. So callers never release anything by hand,
and a block is never reused while any view of it is alive. Unlike torch's host allocator the pool
records no CUDA events: a buffer must outlive the asynchronous copies that read or write it, unless
its next user's copies are queued after them on the same stream (as activation offload's are).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import logging
import mmap
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import psutil
import torch

__all__ = ["Block", "EngineAllocator", "HostAllocator", "HostPool", "PlainAllocator", "PoolStats",
           "RegisteredAllocator", "reserve_bytes"]

_log = logging.getLogger("chunkmem")

# Pinned pages can be neither swapped nor reclaimed, so memory pinned up to the edge leaves the kernel
# nothing to give when activations, data-loader workers or the page cache grow next: its OOM killer
# then ends the process. So the pool never pins the last tenth of RAM (at least 1 GiB), room for what
# this process and its neighbours still allocate as pageable memory; Config.host_memory pins less.
RESERVE_FRACTION = 0.1
RESERVE_MIN = 1 << 30


def reserve_bytes(total_ram: int) -> int:
    """RAM the pool leaves unpinned on a machine with `total_ram` bytes."""
    return max(RESERVE_MIN, int(total_ram * RESERVE_FRACTION))


class Block:
    """`nbytes` of host memory at address `ptr`; `owner` keeps it alive when the memory is Python's."""

    __slots__ = ("ptr", "nbytes", "pinned", "owner", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, pinned: bool, owner: object = None) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.pinned = pinned
        self.owner = owner


class HostAllocator(Protocol):
    """Exact-size host memory. `alloc` raises RuntimeError or MemoryError when it cannot."""

    pinned: bool  # whether its blocks are page-locked (or stand for page-locked ones, in simulation)

    def alloc(self, nbytes: int) -> Block: ...
    def free(self, block: Block) -> None: ...


PAGE = 4096  # every allocator's blocks start on a page, as the disk tier's direct I/O needs (memory/disk.py)


class PlainAllocator:
    """Ordinary memory from torch's CPU allocator, page-aligned, `nbytes` counted.

    pinned=True is the CPU simulation's twin of a pinned allocator: same accounting, no page locking.
    pinned=False is the pageable fallback on every device.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned

    def alloc(self, nbytes: int) -> Block:
        base = torch.empty(nbytes + PAGE - 1, dtype=torch.uint8, device="cpu")  # [nbytes + PAGE - 1] bytes
        ptr = -(-base.data_ptr() // PAGE) * PAGE
        return Block(ptr, nbytes, self.pinned, base)

    def free(self, block: Block) -> None:
        block.owner = None


class RegisteredAllocator:
    """Pinned memory without the extension: anonymous memory page-locked by cudaHostRegister.

    Each block is its own mapping, so its own pages. Registering a page another block registered
    already fails (cudaErrorHostMemoryAlreadyRegistered), which 64-byte-aligned blocks from a general
    allocator hit as soon as two small ones share a page. `cudart` and `clear_error` are
    torch.cuda.cudart() and a cudaGetLastError call unless given (tests give fakes); `device`, the
    CUDA device whose context frees the blocks (`on_device`).
    """

    pinned = True

    def __init__(self, cudart: Any = None, clear_error: Callable[[], None] | None = None,
                 device: int | None = None) -> None:
        self.cudart = cudart if cudart is not None else torch.cuda.cudart()
        self.clear_error = clear_error or clear_cuda_error
        self.device = device

    def alloc(self, nbytes: int) -> Block:
        region: mmap.mmap = mmap.mmap(-1, nbytes)
        anchor = ctypes.c_char.from_buffer(region)  # the mapping's address; released before it is closed
        ptr = ctypes.addressof(anchor)
        # Flag 1 is cudaHostRegisterPortable: pinned for every device's context, not just the current one.
        status = int(self.cudart.cudaHostRegister(ptr, nbytes, 1))
        if status != 0:
            self.clear_error()
            del anchor
            region.close()
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {status}")
        return Block(ptr, nbytes, True, [region, anchor])

    def free(self, block: Block) -> None:
        with on_device(self.device):
            status = int(self.cudart.cudaHostUnregister(block.ptr))
        if status != 0:  # the mapping goes all the same; the error would be reported as the next kernel's
            self.clear_error()
            _log.warning("cudaHostUnregister of %d bytes failed with CUDA error %d", block.nbytes, status)
        region = block.owner[0]  # type: ignore[index]
        block.owner = None  # drops the anchor, so the mapping can close
        region.close()


def on_device(index: int | None) -> contextlib.AbstractContextManager:
    """A scope in which `index` is the current CUDA device (None: the thread's own). Pinned blocks go back from the
    pool's finalizer, which the garbage collector runs on whatever thread allocated (a disk reader, a user's
    logging thread): one that never chose a device would make GPU 0's context for the call, half a GiB on a GPU a
    rank under torchrun does not use. torch's guard creates none where it restores the thread's device."""
    return contextlib.nullcontext() if index is None else torch.cuda.device(index)


def clear_cuda_error() -> None:
    """Reset the calling thread's last CUDA error. A failed cudaHostRegister leaves its error there, and
    torch's next kernel-launch check would report it as the kernel's own; torch binds no cudaGetLastError,
    so call the runtime library torch loaded."""
    library = _cudart_library()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def _cudart_library() -> Any:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart" in line:
                return ctypes.CDLL(line.split()[-1])
    return None


class EngineAllocator:
    """Pinned memory from the copy engine's cudaHostAlloc (csrc/copy_engine.cu): page-aligned, portable."""

    pinned = True

    def __init__(self, engine: ModuleType, device: int | None = None) -> None:
        self.engine = engine
        self.device = device  # as RegisteredAllocator's

    def alloc(self, nbytes: int) -> Block:
        ptr, error = self.engine.pinned_alloc(nbytes)
        if error:  # the extension returns its errors (native.CopyEngine says why): the pool falls back to pageable
            raise MemoryError(error)
        return Block(int(ptr), nbytes, True)

    def free(self, block: Block) -> None:
        with on_device(self.device):
            error = self.engine.pinned_free(block.ptr)
        if error:
            raise RuntimeError(error)


@dataclasses.dataclass
class PoolStats:
    """Bytes and counts of one pool, as `HostPool.stats()` reports them."""

    pinned_bytes: int = 0  # page-locked bytes held: handed out plus cached
    pinned_bytes_peak: int = 0
    pageable_bytes: int = 0  # bytes handed out from pageable memory because pinning was refused
    cached_bytes: int = 0  # pinned bytes free for reuse by a request of the same size
    hits: int = 0  # requests served from the cache
    misses: int = 0  # requests that needed a new block, pinned or pageable
    fallbacks: int = 0  # misses served from pageable memory


def _free_all(cache: dict[tuple[str, int], list[Block]], allocator: HostAllocator,
              before_free: Callable[[], Callable[[], None] | None]) -> None:
    """The pool went: its cached blocks go back to the allocator, once the device is done with them (`trim`'s rule: a
    copy may still use a block whose last view died)."""
    if any(cache.values()):
        synchronize = before_free()
        if synchronize is not None:
            synchronize()
    for blocks in cache.values():
        for block in blocks:
            allocator.free(block)
    cache.clear()


class HostPool:
    """Host buffers for one runtime: exact-size reuse of pinned blocks, a cap, a pageable fallback.

    limit: most pinned bytes (Config.host_memory); None: only the RAM reserve limits pinning.
    before_free: called before cached blocks go back to the allocator (the device's synchronize): a
    block's last view may have died while an asynchronous copy still used it, and unpinned memory may
    be handed to anyone at once.
    """

    def __init__(self, pinned: HostAllocator, limit: int | None = None,
                 pageable: HostAllocator | None = None, before_free: Callable[[], None] | None = None) -> None:
        self.allocator = pinned
        self.pageable = pageable or PlainAllocator(pinned=False)
        self.limit = limit
        self.before_free = before_free
        self.stats_ = PoolStats()
        # (tag, nbytes) -> freed pinned blocks of exactly that size, handed out again only under the same tag
        self._cache: dict[tuple[str, int], list[Block]] = {}
        # Re-entrant: a garbage collection inside `tensor()` may run a finalizer that gives a block back.
        self._lock = threading.RLock()
        self._warned = False
        # Cached blocks go back to the allocator when the pool goes; outstanding ones keep it alive. The finalizer must
        # not hold what holds the pool (a device's bound synchronize): such a `before_free` is held weakly there.
        held: Callable[[], Callable[[], None] | None] = (
            weakref.WeakMethod(before_free) if inspect.ismethod(before_free) else lambda: before_free)
        weakref.finalize(self, _free_all, self._cache, pinned, held).atexit = False

    def tensor(self, numel: int, dtype: torch.dtype, tag: str = "") -> torch.Tensor:
        """An uninitialised 1-D CPU tensor of `numel` x `dtype` whose bytes come from the pool.

        tag: a freed block goes only to a request of the same tag. A block's last view can die while a copy
        queued on the compute stream still uses it; that is safe only when its next user's copies are
        queued after it on that stream too, so buffers copied that way (offloaded activations, staged
        gradients) take a tag of their own, apart from chunk payloads, which the host writes.
        """
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(numel, dtype=dtype, device="cpu")
        block = self._take(nbytes, tag)
        view = (ctypes.c_ubyte * nbytes).from_address(block.ptr)
        weakref.finalize(view, self._give_back, block, tag).atexit = False
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype)

    def _take(self, nbytes: int, tag: str) -> Block:
        with self._lock:
            stats = self.stats_
            cached = self._cache.get((tag, nbytes))
            if cached:
                stats.hits += 1
                stats.cached_bytes -= nbytes
                return cached.pop()
            stats.misses += 1
            why = self._refusal(nbytes)
            if why is not None and stats.cached_bytes:  # blocks of other sizes make room before pageable memory
                self.trim()
                why = self._refusal(nbytes)
            if why is None:
                try:
                    block = self.allocator.alloc(nbytes)
                except (RuntimeError, MemoryError) as exc:
                    why = f"{type(exc).__name__}: {exc}"
                else:
                    stats.pinned_bytes += nbytes
                    stats.pinned_bytes_peak = max(stats.pinned_bytes_peak, stats.pinned_bytes)
                    return block
            self._warn_once(nbytes, why)
            block = self.pageable.alloc(nbytes)
            stats.pageable_bytes += nbytes
            stats.fallbacks += 1
            return block

    def _refusal(self, nbytes: int) -> str | None:
        """Why `nbytes` more may not be pinned now, or None when they may."""
        pinned = self.stats_.pinned_bytes
        if self.limit is not None and pinned + nbytes > self.limit:
            return f"{pinned} bytes are pinned already and Config.host_memory allows {self.limit}"
        memory = psutil.virtual_memory()
        reserve = reserve_bytes(memory.total)
        if memory.available - nbytes < reserve:
            return (f"{memory.available} bytes of RAM are available and chunkmem leaves {reserve} of them "
                    f"unpinned so the process is not killed for memory")
        return None

    def _warn_once(self, nbytes: int, why: str) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("chunkmem: could not pin %d more bytes of host memory (%s); using pageable memory "
                         "for them and for later buffers that do not fit, so their copies will not overlap "
                         "compute. Raise Config.host_memory or free RAM to pin them.", nbytes, why)

    def _give_back(self, block: Block, tag: str) -> None:
        with self._lock:
            if not block.pinned:
                self.stats_.pageable_bytes -= block.nbytes
                self.pageable.free(block)
                return
            self._cache.setdefault((tag, block.nbytes), []).append(block)
            self.stats_.cached_bytes += block.nbytes

    def trim(self) -> int:
        """Free every cached block; returns the bytes freed. Blocks handed out are unaffected."""
        with self._lock:
            freed = self.stats_.cached_bytes
            _free_all(self._cache, self.allocator, lambda: self.before_free)
            self.stats_.pinned_bytes -= freed
            self.stats_.cached_bytes = 0
            return freed

    def stats(self) -> dict[str, int]:
        """Counters for memory_stats(): host_pinned_bytes, host_pageable_bytes, host_cached_bytes, ..."""
        with self._lock:
            return {("host_" if "bytes" in k else "host_pool_") + k: v
                    for k, v in dataclasses.asdict(self.stats_).items()}
