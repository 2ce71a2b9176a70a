"""The CPU simulation of a compute device, held to CUDA's rules, so that CI (which has no GPU) can judge
everything above the `Device` interface.

On a GPU a copy issued on a copy stream lands at some unknown time later, and code knows it has
landed only through an event: compute learns it by waiting on the event (`Device.wait`), the host by
synchronising with it (`Device.wait_host`), or either through a later copy that was fenced after such
a wait. The simulation keeps exactly that knowledge and no more:

- Copies land late. With `CHUNKMEM_SIM_LANDING=wait` (the test suite's) a copy lands when someone
  learns that it has (in stream order: an upload that is known to have landed implies every earlier
  upload has). With `random:SEED` copies may also land at random earlier moments, still in stream
  order. A device buffer is NaN until its upload lands (`alloc` poisons it while the checker is on)
  and a host buffer keeps its old bytes until its download lands, so code that reads without waiting
  computes on garbage and tests fail. The default, `background`, lands copies in issue order on a
  thread of idle priority, beside compute as a GPU's copy engines do (landing.py); learning of a copy
  it has not landed yet lands it then. Where a thread cannot take idle priority, it is `wait`.
- A happens-before checker (`checking()`, on for the whole test suite and, through
  CHUNKMEM_SIM_CHECK=1, in the processes tests start) watches every ATen op. An op that touches a
  buffer a copy may still be writing, or changes one a copy may still be reading, before the side
  that runs the op (compute for device buffers, the host for host buffers) has learned that the copy
  landed, raises `HazardError` naming the buffer, the copy and the op. So do the native CPU kernel's
  calls, which the dispatcher never sees (`check_unseen`), and a copy issued onto bytes an earlier copy
  on another stream still uses, unless it is fenced after that copy (`check_copy`).

[Note: what "knows" means]
Copies on one stream complete in order, so knowledge is a vector: per stream, the newest copy known
to have landed. A copy is fenced after the compute queued before it (the copy engine's fence), so
it carries the compute knowledge of its issue time; learning of the copy teaches that too. Compute
and the host learn separately: compute waiting on an upload tells the host nothing, which is why a
host write into a host buffer an upload reads needs the host to have synchronised (directly, or with
a later download fenced after compute's wait). The simulation's compute is the host's thread, so it
cannot model a kernel running late; that is the fence's job, and every copy here carries one.

[Note: host buffers]
CUDA keeps a device buffer a copy uses from reuse until the copy is done (record_stream), but nothing keeps a
pinned host block: once its last view dies the pool hands it to the next request of its size, and a download
still in flight writes into the new user's bytes, or an upload reads them. So the simulation's copies keep no
view of a pinned pool block (the block and a tensor over its bytes: `_unheld`), its last view may die while they
are in flight, and its next user finds their hazards on it (`handed_out`): it may touch those bytes once the host
learned that the copies landed, and copy onto them only after them. So while the checker is on, as in tests:
without it nothing would report the race. Pageable buffers are held: on CUDA a copy from or into pageable memory
is staged, and the host may free it once the copy was issued.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import itertools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chunkmem.memory.allocator import Room
from chunkmem.memory.arena import SlotArena
from chunkmem.memory.hostpool import Block, HostPool, PlainAllocator
from chunkmem.memory.landing import CopyThread, idle_priority_available
from chunkmem.memory.simmemory import SimulatedMemory, moving_versions, simulated_memory

log = logging.getLogger("chunkmem")
STREAMS = ("h2d", "d2h", "comm")
MAX_ON_BLOCKS = 4096  # copies on pool blocks kept for `handed_out` before those the host knows landed are dropped
LANDING_POLL_S = 0.0002  # how often a worker waiting for a copy to land looks again (wait_landed)
Knowledge = dict[str, int]  # stream -> id of the newest copy known to have landed


class HazardError(RuntimeError):
    """An access the simulation proves would race with an asynchronous copy on a GPU (a missing fence)."""


@dataclasses.dataclass(eq=False)
class Copy:
    """An asynchronous copy (or collective) in flight, and the token `Device.wait`/`wait_host` take."""

    id: int
    stream: str
    what: str  # "upload of param.3"
    deps: Knowledge  # compute's knowledge when it was issued (the fence)
    land: Callable[[], Any] | None  # moves the bytes; None once landed (or for a collective)
    work: Any = None  # a torch.distributed Work to wait for (collectives)
    held: torch.Tensor | None = None  # the device buffer `land` holds until it lands (Device.holds)
    # The pinned pool block of its host side and the bytes [start, end) of it the copy uses (the Note on host buffers)
    host: tuple[Block, int, int] | None = None


class _HostPool(HostPool):
    """The simulated device's pinned pool: what it hands out is host memory to the allocator model's op hook, and a
    block that copies in flight still use is handed out again as CUDA's would be (the Note on host buffers)."""

    def __init__(self, memory: SimulatedMemory | None, device: SimulatedDevice, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory = memory
        self.device = weakref.ref(device)  # (the device holds the pool)
        self.lent: dict[int, Block] = {}  # address -> pinned block handed out, until its last view dies
        # A tensor over each block's bytes per dtype, which keeps none of its views alive (SimulatedDevice._unheld)
        self.raw: weakref.WeakKeyDictionary[Block, dict[torch.dtype, torch.Tensor]] = weakref.WeakKeyDictionary()

    def tensor(self, numel: int, dtype: torch.dtype, tag: str = "") -> torch.Tensor:
        out = super().tensor(numel, dtype, tag)
        if not out.numel():
            return out
        device = self.device()
        if device is not None:
            device.handed_out(out)
        return self.memory.mark_host(out) if self.memory is not None else out

    def _take(self, nbytes: int, tag: str) -> Block:
        block = super()._take(nbytes, tag)
        if block.pinned:
            self.lent[block.ptr] = block
        return block

    def _give_back(self, block: Block, tag: str) -> None:
        if self.lent.get(block.ptr) is block:
            del self.lent[block.ptr]
        super()._give_back(block, tag)


class SimulatedDevice:
    """A device simulated in CPU memory: separate buffers, real copies, CUDA's ordering rules.

    `fail_allocations` makes the next that many allocations raise torch.OutOfMemoryError, as a
    full GPU would, so the fallback path is tested without one.
    """

    torch_device = torch.device("cpu")

    def __init__(self, host_memory: int | None = None, landing: str | None = None) -> None:
        self.fail_allocations = 0
        # Time the thread that computes spent landing copies or waiting for them to land: a GPU's copy engines
        # move the bytes beside compute (with background landing, the copy thread does, when a core is idle).
        self.copy_seconds = 0.0
        self.memory = simulated_memory()  # this process's device memory (None: not modelled)
        if self.memory is not None:
            self.memory.devices.add(self)
        self.arena = SlotArena(self)
        # The allocator, where it is modelled as a budget (else at most placing tensors: CHUNKMEM_SIM_MEMORY=places)
        self.allocator = self.memory.allocator if self.memory is not None and self.memory.models_budget else None
        self.segment_bytes = self.allocator.sizes.large_segment if self.allocator is not None else 0
        self.reads_memory = self.allocator is not None
        self.memory_limit: int | None = None  # what limit_memory was told
        self.pool = _HostPool(self.memory, self, PlainAllocator(pinned=True), host_memory, before_free=self.synchronize)
        self.host_pool: HostPool = self.pool
        self.compute_knows: Knowledge = dict.fromkeys(STREAMS, 0)
        self.host_knows: Knowledge = dict.fromkeys(STREAMS, 0)
        # Per thread, the newest copy of each stream that thread waited for (`wait_landed`): it, and nobody else,
        # may touch what that copy and the earlier ones on its stream wrote, as a CUDA thread that synchronized on an
        # event may.
        self._waited = threading.local()
        self._ids = itertools.count(1)
        self._in_flight: list[Copy] = []  # not landed yet, oldest first
        # Copies on pinned pool blocks the host may not know landed, landed or not (`handed_out`), oldest first
        self._on_blocks: list[Copy] = []
        landing = landing if landing is not None else os.environ.get("CHUNKMEM_SIM_LANDING", "background")
        self._random = _landing_rng(landing)
        self._background = landing == "background" and idle_priority_available()
        self._copy_thread: CopyThread | None = None  # started at the first copy (background landing)
        if os.environ.get("CHUNKMEM_SIM_CHECK") == "1":
            ensure_checking()

    # -- memory ---------------------------------------------------------------------------------------
    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory, placed by the model of CUDA's caching allocator (simmemory.py): torch.OutOfMemoryError
        where a GPU of the budget would raise it."""
        self._tick()
        if self.fail_allocations > 0:
            self.fail_allocations -= 1
            raise torch.OutOfMemoryError(f"simulated: no device memory for {numel} x {dtype}")
        tensor = torch.empty(numel, dtype=dtype, device="cpu")
        if self.memory is not None:
            self.memory.charge(tensor)
        return undefined(tensor)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_pool.tensor(numel, dtype)

    def free_bytes(self) -> int:
        return psutil.virtual_memory().available

    def limit_memory(self, owner: object, limit: int, outside: int) -> None:
        """Cap the simulated allocator as CudaDevice caps CUDA's, at the live owners' budgets."""
        self.memory_limit = limit - outside
        if self.memory is not None:
            self.memory.limit(owner, limit, outside)

    def capped(self) -> bool:
        return self.memory is not None and self.memory.capped()

    def memory_reading(self) -> tuple[int, int] | None:
        """The most the allocator held since the last call (live blocks and the holes between them) and the largest
        block it handed out since (None: not modelled as a budget, CHUNKMEM_SIM_MEMORY=0 or places)."""
        return self.allocator.take_reading() if self.allocator is not None else None

    def allocation_room(self) -> Room | None:
        return self.allocator.room() if self.allocator is not None else None

    def segment_for(self, nbytes: int) -> int:
        return self.allocator.sizes.segment_for(nbytes) if self.allocator is not None else 0

    def empty_cache(self) -> None:
        if self.allocator is not None:
            self.allocator.empty_cache()

    def total_bytes(self) -> int:
        return psutil.virtual_memory().total

    # -- copies ---------------------------------------------------------------------------------------
    def upload(self, host: torch.Tensor, device: torch.Tensor, label: str = "", after: object | None = None) -> Copy:
        _engine_pair(device, host)
        source, on_block = self._unheld(host)
        # `.data`: a copy engine's copy moves no version counter (code that counted on one would pass here only)
        copy = self._issue("h2d", f"upload of {label or 'a buffer'}", lambda: (on_block, device.data.copy_(source)),
                           device, after, on_block)
        _check_and_guard(self, copy, device, host, upload=True)
        return copy

    def download(self, device: torch.Tensor, host: torch.Tensor, label: str = "") -> Copy:
        _engine_pair(host, device)
        target, on_block = self._unheld(host)
        copy = self._issue("d2h", f"download of {label or 'a buffer'}", lambda: (on_block, target.data.copy_(device)),
                           device, host=on_block)
        _check_and_guard(self, copy, device, host, upload=False)
        return copy

    def collective(self, issue: Callable[[], Any], writes: Sequence[torch.Tensor] = (),
                   reads: Sequence[torch.Tensor] = (), label: str = "") -> Copy:
        """Start an asynchronous collective (`issue()` returns its Work); `wait` makes compute wait for it."""
        copy = Copy(next(self._ids), "comm", label or "a collective", self._fence(), None, issue())
        for tensor in writes:
            guard(self, copy, tensor, "device", write_only=False)
        for tensor in reads:
            guard(self, copy, tensor, "device", write_only=True)
        return copy

    def wait(self, token: object) -> None:
        """Compute waits for the copy behind `token` (the host does not learn of it)."""
        self._finish(token)
        self._learn(self.compute_knows, _copy(token))

    def wait_host(self, token: object) -> None:
        """The host waits until the copy behind `token` has landed."""
        self._finish(token)
        self._learn(self.host_knows, _copy(token))

    def _finish(self, token: object) -> None:
        work = _copy(token).work
        if work is not None:
            with paused():  # gloo may copy results into the outputs as part of the wait
                work.wait()

    def wait_landed(self, token: object) -> None:
        """Another thread waits until the copy has landed, teaching nobody (Device.wait_landed). With `wait`
        landing it lands only once the host or compute learns of it: the host must, before it joins that thread."""
        copy = _copy(token)
        while copy.land is not None:
            time.sleep(LANDING_POLL_S)
        waited = getattr(self._waited, "ids", None)
        if waited is None:
            waited = self._waited.ids = dict.fromkeys(STREAMS, 0)
        waited[copy.stream] = max(waited[copy.stream], copy.id)

    def discard(self, token: object) -> None:
        """The copy's result will not be read: it lands whenever it lands, and a host write into its source races with
        nothing that matters. Its write into the device buffer still does, as on CUDA: that buffer's next user must be
        ordered after it (arena.py)."""
        copy = _copy(token)
        if _active is not None:
            _active.forget(lambda hazard: hazard.copy is copy and hazard.side == "host")

    def synchronize(self) -> None:
        """Everything issued so far has landed, and both sides know it."""
        issued = next(self._ids)
        everything = Copy(issued, "comm", "synchronize", dict.fromkeys(STREAMS, issued), None)
        self._learn(self.host_knows, everything)
        self._learn(self.compute_knows, everything)

    def holds(self, tensor: torch.Tensor) -> int:
        """How many tensors on `tensor`'s storage the simulation keeps for copies in flight (a GPU keeps none:
        arena.py)."""
        address = tensor.untyped_storage().data_ptr()
        return len({id(c.held) for c in self._in_flight
                    if c.held is not None and c.held.untyped_storage().data_ptr() == address})

    def _fence(self, after: object | None = None) -> Knowledge:
        """What a copy issued now is ordered after: compute's work so far, what the host knows (work issued
        after the host learned of a copy runs after it), and the copy `after`, if given, on whatever stream."""
        fence = {s: max(self.compute_knows[s], self.host_knows[s]) for s in STREAMS}
        if after is not None:
            before = _copy(after)
            for stream in STREAMS:
                fence[stream] = max(fence[stream], before.deps[stream])
            fence[before.stream] = max(fence[before.stream], before.id)
        return fence

    def _unheld(self, host: torch.Tensor) -> tuple[torch.Tensor, tuple[Block, int, int] | None]:
        """What a copy's landing keeps of host buffer `host`: of a pinned pool block, a tensor over its bytes that keeps
        no view of it alive, and the block with the bytes [start, end) of it that `host` spans (Copy.host), so that the
        buffer's last view may die while the copy is in flight, and the block go to its next user, as on CUDA (the Note
        on host buffers); else `host` itself, and always without the checker, which alone reports the race (the extra
        view costs benchmarks that stand in for CUDA)."""
        span = _span(host) if _active is not None else None
        block = self.pool.lent.get(span[0]) if span is not None else None
        if span is None or block is None or block.nbytes % host.element_size():
            return host, None
        typed = self.pool.raw.setdefault(block, {})
        raw = typed.get(host.dtype)
        if raw is None:  # made once per block and dtype: a copy costs the simulation a view more, no more
            raw = typed[host.dtype] = torch.frombuffer((ctypes.c_ubyte * block.nbytes).from_address(block.ptr),
                                                       dtype=torch.uint8).view(host.dtype)
        return raw.as_strided(host.shape, host.stride(), host.storage_offset()), (block, span[1], span[2])

    def handed_out(self, buffer: torch.Tensor) -> None:
        """The pool handed out `buffer`: copies on its block's bytes that its last user gave up before the host knew
        they landed may still use them, as on CUDA: the host (its new user) must learn that they landed before it
        touches those bytes, and a copy issued onto them must run after them (`check_copy`)."""
        if _active is None:
            return
        self._forget_on_blocks()
        address = buffer.untyped_storage().data_ptr()
        for copy in self._on_blocks:
            if copy.host is not None and copy.host[0].ptr == address:
                _active.add(Hazard(self, copy, address, *copy.host[1:], "host", copy.stream == "h2d"))
                _watch(buffer, address)

    def _forget_on_blocks(self) -> None:
        self._on_blocks = [c for c in self._on_blocks if not self.knows(c, "host")]

    def _issue(self, stream: str, what: str, land: Callable[[], Any], held: torch.Tensor | None = None,
               after: object | None = None, host: tuple[Block, int, int] | None = None) -> Copy:
        self._tick()
        copy = Copy(next(self._ids), stream, what, self._fence(after), land, held=held, host=host)
        self._in_flight.append(copy)
        if host is not None:
            if len(self._on_blocks) > MAX_ON_BLOCKS:
                self._forget_on_blocks()
            self._on_blocks.append(copy)
        if self._background:
            if self._copy_thread is None or self._copy_thread.pid != os.getpid():
                self._copy_thread = CopyThread()
            self._copy_thread.add(copy)
        return copy

    def _learn(self, knows: Knowledge, copy: Copy) -> None:
        for stream in STREAMS:
            knows[stream] = max(knows[stream], copy.deps[stream])
        knows[copy.stream] = max(knows[copy.stream], copy.id)
        known = self._fence()
        self._land([c for c in self._in_flight if c.id <= known[c.stream]])
        if _active is not None:
            _active.forget_known(self)

    def settle(self) -> None:
        """Land every copy in flight, nobody learning of it (the allocator's wait at its cap: allocator.py)."""
        self._land(list(self._in_flight))

    def _tick(self) -> None:
        """With random landing, some of the oldest copies of each stream land now."""
        if self._random is None or not self._in_flight:
            return
        landing: list[Copy] = []
        for stream in STREAMS:
            for copy in (c for c in self._in_flight if c.stream == stream):
                if self._random.random() < 0.5 or not self._ready(copy, landing):
                    break
                landing.append(copy)
        self._land(landing)

    def _ready(self, copy: Copy, landing: list[Copy]) -> bool:
        """Whether every copy on another stream that `copy` is ordered after has landed or lands with it."""
        return all(c in landing for c in self._in_flight if c.stream != copy.stream and c.id <= copy.deps[c.stream])

    def _land(self, copies: list[Copy]) -> None:
        if not copies:
            return
        start = time.perf_counter()
        thread = self._copy_thread
        with paused():
            for copy in sorted(copies, key=lambda c: c.id):
                if thread is not None:
                    thread.land(copy)
                elif copy.land is not None:
                    copy.land()
                    copy.land, copy.held = None, None
        self.copy_seconds += time.perf_counter() - start
        self._in_flight = [c for c in self._in_flight if c.land is not None]

    def knows(self, copy: Copy, side: str) -> bool:
        """Whether `side` ("device": compute, which also learns what the host learns; "host": the host, or the thread
        asking, if it waited for the copy) knows that `copy` has landed."""
        waited = getattr(self._waited, "ids", None)
        if self.host_knows[copy.stream] >= copy.id or (waited is not None and waited[copy.stream] >= copy.id):
            return True
        return side == "device" and self.compute_knows[copy.stream] >= copy.id


def undefined(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, whose bytes nothing has defined (fresh device memory, a host buffer given up for reuse): NaN
    while the checker is on, so a read before a write shows in every result. Filling costs a pass a GPU does not
    pay, so only while checking."""
    if _active is not None and tensor.dtype.is_floating_point:
        tensor.fill_(float("nan"))
    return tensor


def _copy(token: object) -> Copy:
    if not isinstance(token, Copy):
        raise TypeError(f"expected a token of the simulated device, got {type(token).__name__}")
    return token


def _landing_rng(landing: str) -> random.Random | None:
    if landing in ("wait", "background"):
        return None
    kind, _, seed = landing.partition(":")
    if kind != "random" or not seed.isdigit():
        raise ValueError(f"CHUNKMEM_SIM_LANDING={landing!r}: expected 'background', 'wait' or 'random:SEED' "
                         "(SEED an integer)")
    return random.Random(int(seed))


# -- the happens-before checker ------------------------------------------------------------------------

class Knower(Protocol):
    def knows(self, copy: Any, side: str) -> bool: ...


@dataclasses.dataclass(eq=False)
class Hazard:
    """Bytes [start, end) of a storage that a copy in flight writes (any access races) or reads
    (only writes race), until `side` knows the copy landed. `device` answers that: the simulated
    device for its copies, a disk I/O token for itself (memory/disk.py)."""

    device: Knower
    copy: Any  # a Copy, or anything with `what`, `id` and `stream` (a disk IoToken)
    storage: int  # its address; the hazard goes with the storage (`_watch`): bytes nobody holds race with nothing
    start: int
    end: int
    side: str  # "device" | "host"
    write_only: bool


def _span(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of the bytes a tensor can touch; None without storage."""
    try:
        storage = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if tensor.is_nested:  # sizes per component (nn.TransformerEncoder's fast path with a padding mask): its buffer
        return (storage, 0, tensor.untyped_storage().nbytes()) if storage != 0 else None
    if storage == 0 or tensor.numel() == 0:
        return None
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    extent = 1 + sum((int(n) - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride()))
    return storage, start, start + extent * size


class HazardChecker(TorchDispatchMode):
    """Raises HazardError when an ATen op touches bytes an asynchronous copy may still be using."""

    def __init__(self) -> None:
        super().__init__()
        self.hazards: dict[int, list[Hazard]] = {}  # storage address -> hazards on it
        self.watched: set[int] = set()  # storage addresses whose death drops their hazards (`_watch`)
        self.paused = 0
        self._writes: dict[Any, tuple[tuple[str, bool], ...]] = {}  # op -> (argument, written) per argument
        # Storages die on any thread (the copy thread drops what a landed copy held) and at any moment (a
        # collection inside `forget`): their deaths queue here, and whichever thread next holds the lock drops
        # their hazards (which hold their devices) before the books change or are read. Reentrant: a finalizer
        # run by a collection under the lock may compute, and its ops are checked.
        self._dead: list[int] = []
        self._lock = threading.RLock()

    def add(self, hazard: Hazard) -> None:
        with self._lock:
            self._bury()
            self.hazards.setdefault(hazard.storage, []).append(hazard)
        self._bury_queued()

    def watch(self, address: int) -> bool:
        """Whether the death of the storage at `address` is not yet watched; it is from now on."""
        with self._lock:
            self._bury()
            fresh = address not in self.watched
            self.watched.add(address)
        self._bury_queued()
        return fresh

    def storage_died(self, address: int) -> None:
        self._dead.append(address)
        self._bury_queued()

    def _bury_queued(self) -> None:
        """Drop the deaths queued so far, unless another thread holds the books (it drops them, or its successor)."""
        while self._dead and self._lock.acquire(blocking=False):
            try:
                self._bury()
            finally:
                self._lock.release()

    def _bury(self) -> None:
        while self._dead:
            address = self._dead.pop()
            self.hazards.pop(address, None)
            self.watched.discard(address)

    def forget_known(self, device: SimulatedDevice) -> None:
        """Drop the hazards whose copies `device` now knows have landed."""
        self.forget(lambda h: h.device is device and device.knows(h.copy, h.side))

    def forget(self, done: Callable[[Hazard], bool]) -> None:
        with self._lock:
            self._bury()
            # A copy to walk: a collection at any allocation of the walk may run finalizers that bury deaths on
            # this thread, which holds the (reentrant) lock; dict.copy makes no object a collection starts on
            # before the entries are copied (seen in the suite: "dictionary changed size during iteration").
            for storage, hazards in self.hazards.copy().items():
                left = [h for h in hazards if not done(h)]
                self._bury()  # deaths during the test above: their hazards must not come back
                if storage not in self.hazards:
                    continue
                if left:
                    self.hazards[storage] = left
                else:
                    del self.hazards[storage]
        self._bury_queued()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.hazards and not self.paused:
            self._check(func, args, kwargs)
        return moving_versions(func, args, kwargs)

    def _arguments(self, func: Any) -> tuple[tuple[str, bool], ...]:
        """(name, written) of the op's arguments; none for views and metadata ops, which touch no bytes."""
        if func not in self._writes:
            touches = not func.is_view and func not in _METADATA
            self._writes[func] = tuple((a.name, a.alias_info is not None and a.alias_info.is_write)
                                       for a in func._schema.arguments) if touches else ()
        return self._writes[func]

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        for index, (name, written) in enumerate(self._arguments(func)):
            value = args[index] if index < len(args) else kwargs.get(name)
            tensors = value if isinstance(value, (list, tuple)) else (value,)
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    self._check_tensor(func, tensor, written)

    def _check_tensor(self, func: Any, tensor: torch.Tensor, written: bool,
                      ordered: Callable[[Hazard], bool] | None = None) -> None:
        """HazardError if `func` touching `tensor` races with a copy in flight (unless `ordered` after it)."""
        span = _span(tensor)
        if span is None:
            return
        storage, start, end = span
        with self._lock:
            self._bury()  # a new storage may have the address of one whose death is queued
            hazards = self.hazards.get(storage, ())
        for hazard in hazards:
            if start >= hazard.end or hazard.start >= end or (hazard.write_only and not written):
                continue
            if hazard.device.knows(hazard.copy, hazard.side) or (ordered is not None and ordered(hazard)):
                continue
            raise HazardError(_describe(func, written, hazard))


def check_unseen(op: str, reads: Sequence[torch.Tensor | None], writes: Sequence[torch.Tensor | None]) -> None:
    """Check an op the dispatcher does not see (the native CPU kernel's, a pybind call) as the checker checks ATen
    ops: HazardError if it reads bytes a copy may still be writing, or writes bytes a copy may still be reading."""
    checker = _active
    if checker is None or not checker.hazards or checker.paused:
        return
    for tensors, written in ((reads, False), (writes, True)):
        for tensor in tensors:
            if tensor is not None:
                checker._check_tensor(op, tensor, written)


def invalid_pair(index: int, to: torch.Tensor, from_: torch.Tensor) -> str:
    """What breaks the CUDA copy engine's rules for pair `index` of a batch ("" when nothing does): it copies bytes
    between flat buffers of one dtype (native._invalid_batch checks a batch so). The simulation keeps them too, where
    torch's copy_ would cast and follow strides."""
    if not (to.is_contiguous() and from_.is_contiguous()):
        return f"chunkmem copy engine: pair {index} is not contiguous; chunks are flat buffers, pass them whole"
    if to.nbytes != from_.nbytes or to.dtype != from_.dtype:
        return (f"chunkmem copy engine: pair {index} has {from_.nbytes} bytes for {to.nbytes} bytes, or another "
                "dtype; both sides must match")
    return ""


def _engine_pair(to: torch.Tensor, from_: torch.Tensor) -> None:
    error = invalid_pair(0, to, from_)
    if error:
        raise RuntimeError(error)


def check_copy(device: SimulatedDevice, copy: Copy, tensor: torch.Tensor, written: bool) -> None:
    """HazardError if `copy`, being issued, touches bytes an earlier copy in flight uses without running after it (on
    its stream, or fenced after it): on a GPU the two race, and the simulation could land them in either order."""
    def ordered(hazard: Hazard) -> bool:
        before = hazard.copy
        return hazard.device is device and (before.stream == copy.stream or copy.deps[before.stream] >= before.id)

    if _active is not None and _active.hazards:
        _active._check_tensor(f"issuing the {copy.what} (copy #{copy.id}, fenced after no wait for the copy below)",
                              tensor, written, ordered)


def _describe(func: Any, written: bool, hazard: Hazard) -> str:
    copy = hazard.copy
    who = "compute" if hazard.side == "device" else "the host"
    how = {("device", "h2d"): "compute must wait for the upload (Device.wait on its token) before it touches the buffer",
           ("device", "d2h"): "compute may change a buffer a download reads only after waiting for the download",
           ("device", "comm"): "compute must wait for the collective (Device.wait on its token) first",
           ("host", "d2h"): "the host must wait for the download (Device.wait_host) before it touches the buffer",
           ("host", "h2d"): "the host may change a buffer an upload reads only once it knows the upload landed "
                            "(Device.wait_host on its token, or on a later copy fenced after it)",
           ("host", "disk"): "the host must wait for the disk I/O (IoToken.wait) before it touches the buffer"}
    return (f"chunkmem simulation: {who} op {func} {'writes' if written else 'reads'} bytes "
            f"[{hazard.start}, {hazard.end}) of a {hazard.side} buffer while the {copy.what} (copy #{copy.id} on "
            f"the {copy.stream} stream) may still be in flight: {how.get((hazard.side, copy.stream), 'wait first')}")


_METADATA = {torch.ops.aten.is_pinned.default, torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.default,
             torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default,
             torch.ops.aten.set_.source_Tensor, torch.ops.aten._has_compatible_shallow_copy_type.default}
_active: HazardChecker | None = None  # the checker in force in this process, if any


def _check_and_guard(device: SimulatedDevice, copy: Copy, on_device: torch.Tensor, on_host: torch.Tensor,
                     upload: bool) -> None:
    """`check_copy` and `guard` for both ends of a copy being issued, where a checker is on (every copy comes here)."""
    if _active is None:
        return
    check_copy(device, copy, on_device, written=upload)
    check_copy(device, copy, on_host, written=not upload)
    guard(device, copy, on_device, "device", write_only=not upload)
    guard(device, copy, on_host, "host", write_only=upload)


def guard(device: SimulatedDevice, copy: Copy, tensor: torch.Tensor, side: str, write_only: bool) -> None:
    """Register the bytes of `tensor` as in use by `copy` with the active checker (if one is on)."""
    if _active is None:
        return
    span = _span(tensor)
    if span is not None:
        _active.add(Hazard(device, copy, *span, side, write_only))
        _watch(tensor, span[0])


def guard_io(token: Knower, tensor: torch.Tensor, write_only: bool) -> None:
    """Register the bytes of host buffer `tensor` as in use by an asynchronous file read (`write_only` False:
    it fills them) or write (it reads them) until `learned(token)`: the disk tier's fence, checked as copies are."""
    if _active is None:
        return
    span = _span(tensor)
    if span is not None:
        _active.add(Hazard(token, token, *span, "host", write_only))
        _watch(tensor, span[0])


def _watch(tensor: torch.Tensor, address: int) -> None:
    """Drop the hazards on `tensor`'s storage when it dies. The checker keeps no tensor alive: CUDA frees a device
    block a copy used once the copy is done (record_stream), whoever has learned it, and the simulation's copies
    hold their device buffers until they land, as long. A pinned host block given up early is handed out with
    its hazards (the Note on host buffers)."""
    checker = _active
    if checker is not None and checker.watch(address):
        weakref.finalize(tensor.untyped_storage(), checker.storage_died, address)


def learned(token: object) -> None:
    """The host waited for the I/O behind `token`: its buffer is free again."""
    if _active is not None:
        _active.forget(lambda hazard: hazard.copy is token)


@contextlib.contextmanager
def checking() -> Iterator[HazardChecker]:
    """Check every ATen op against the copies in flight for the duration (re-entrant)."""
    global _active
    if _active is not None:
        yield _active
        return
    checker = HazardChecker()
    _active = checker
    try:
        with checker:
            yield checker
    finally:
        _active = None


def ensure_checking() -> None:
    """Turn the checker on for the rest of this process (CHUNKMEM_SIM_CHECK=1 in a process tests start)."""
    global _active
    if _active is None:
        _active = HazardChecker()
        _active.__enter__()
        atexit.register(_stop_checking, _active)


def _stop_checking(checker: HazardChecker) -> None:
    """At exit the checker lets go of the buffers (and collectives) its hazards keep alive, before
    torch.distributed and the allocators are torn down."""
    global _active
    checker.hazards.clear()
    if _active is checker:
        _active = None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The simulation's own copies are not accesses by compute or host."""
    checker = _active
    if checker is None:
        yield
        return
    checker.paused += 1
    try:
        yield
    finally:
        checker.paused -= 1
