"""Device memory that is the chunks' own: payloads live in slots chunkmem keeps, not in blocks it hands back.

[Note: chunk memory]
Chunks are large (hundreds of MiB on a 1B model) and all of one size per dtype. Allocated and freed through the
caching allocator at every upload and eviction, their blocks were carved up by activations in between, and the
next chunk found no hole big enough: the lent H100 ran out of memory in steps whose chunk and activation bytes
were well within the budget, with 402 MiB reserved but free. So a chunk leaving the device hands its payload back
to this arena, not to the allocator, and the next chunk of that size takes it as it is (a slot): activations
never see chunk memory, and chunk memory never fragments. The arena holds what chunks use plus slots kept free
for the next ones; when the chunk budget shrinks (activations grow during the warm-up, a step gives way to a
larger input) free slots go back to the allocator (`fit`), the only time chunk memory and activations trade
bytes. They go back to the device, not to the allocator's cache (`fit` empties it): cached, a slot's segment took
the next activations (best fit), and the next slot, needed while a few of them still lived there, found only
holes (GPT-NeoX and Swin in fp32 at a twentieth of their model data, chunks of three times their largest
parameter: CUDA's error in a later step's backward; benchmarks/budget_sweep.py at a twentieth went from 60 runs
training, 14 refused, 2 CUDA errors to 68, 8 and 0: the README's rows on budget_sweep_cpu_low_shares_*.json).
What that costs on a GPU: each release frees the allocator's other wholly free segments too
(torch.cuda.empty_cache), and cudaFree waits for the device; it happens only where a step's plan lowers the chunk
budget below the slots held, a few times a step at small budgets (not measured on a GPU yet).

Before a plan reserves them (`reserve`: the warm-up), slots are taken as chunks first come, while activations come
and go: a new slot, under a budget, first empties the cache too, or it is carved out of a segment an activation
left, and the rest of that segment is a hole only a smaller block fits. Coarse ResNet in bf16 at its whole model
data (budget_sweep.py --shares 1.0) was refused in its warm-up's optimizer step so: its bf16 chunks had taken halves
of fp32-sized segments, and its fp32 chunks found only those halves. Once a slot, in the warm-up alone.

Why not a private torch.cuda.MemPool: its free blocks are never released while the pool lives (not at the
allocator's cap, not by empty_cache), so chunk memory could not shrink for activations; and a block freed
while its eviction's copy still runs is not reused until the copy ends, so the pool grows by a chunk at every
eviction that is followed at once by an upload. A slot is reused at once instead, its next copy ordered after
the last one on another stream (`Taken.after`), and the budget sees exactly the slots held.

A free slot is reused only once nothing but the arena refers to its memory (an op of backward may still hold a
view of an evicted chunk: CUDA's allocator would keep that block alive too). A copy in flight refers to it in
the simulation, not on CUDA: `Device.holds` says how many references the device keeps for its copies.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from chunkmem.memory.device import Device


@dataclasses.dataclass(eq=False)
class _Slot:
    base: torch.Tensor  # [nbytes] uint8 on the device
    last_copy: object | None = None  # the token of the last copy that read or wrote it, if any


class Taken(NamedTuple):
    payload: torch.Tensor  # [numel] of the dtype asked for, a view of the slot
    after: object | None  # a copy still reading or writing the slot: its next copy or write must come after it


class SlotArena:
    """The device memory of one model's chunk payloads (the Note on chunk memory)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._free: dict[int, collections.deque[_Slot]] = {}  # bytes -> free slots, oldest first
        self._used: dict[int, _Slot] = {}  # storage address -> slot in use
        self.room: int | None = None  # most bytes of slots to hold (the chunk budget); None: no bound
        self.footprint = 0  # bytes of every slot held, in use or free
        self.peak = 0
        self.allocations = 0  # slots allocated from the device
        self.planned = False  # a plan reserved the slots (`reserve`): until then they are taken as chunks come

    def take(self, numel: int, dtype: torch.dtype) -> Taken:
        """A payload of `numel` x `dtype` from a free slot, or from a new one; free slots of other sizes go back
        to the allocator first when the slots held would exceed `room`."""
        nbytes = numel * dtype.itemsize
        slot = self._reusable(nbytes)
        if slot is None:
            room = self.room
            if room is not None:
                self._release(lambda held: held + nbytes > room, keep=nbytes)
            if not self.planned and self.device.capped():  # apart from the segments activations left (the Note)
                self.device.empty_cache()
            slot = self._new(nbytes)
        self._used[slot.base.data_ptr()] = slot
        return Taken(slot.base.view(dtype), slot.last_copy)

    def give(self, payload: torch.Tensor, last_copy: object | None) -> None:
        """A chunk left the device: its payload's slot is free, once `last_copy` (if any) is done with it."""
        slot = self._used.pop(payload.untyped_storage().data_ptr())
        slot.last_copy = last_copy
        self._free.setdefault(slot.base.nbytes, collections.deque()).append(slot)

    def reserve(self, slots: dict[int, int]) -> None:
        """Hold `slots[bytes]` slots of each size, no other free ones, allocated now: called when a plan is made and
        no activation is alive, so that the slots lie apart from the next step's activations (the Note)."""
        self.planned = True
        for nbytes, queue in self._free.items():
            wanted = max(0, slots.get(nbytes, 0) - self._in_use(nbytes))
            while len(queue) > wanted:
                queue.pop()
                self.footprint -= nbytes
        self.device.empty_cache()
        for nbytes, count in slots.items():
            queue = self._free.setdefault(nbytes, collections.deque())
            for _ in range(count - self._in_use(nbytes) - len(queue)):
                try:
                    queue.append(self._new(nbytes))
                except torch.OutOfMemoryError:  # the allocator's segments left no room for it now: taken when
                    return  # needed, where an upload out of memory makes room (Residency.retry_out_of_memory)

    def _in_use(self, nbytes: int) -> int:
        return sum(1 for slot in self._used.values() if slot.base.nbytes == nbytes)

    def _new(self, nbytes: int) -> _Slot:
        slot = _Slot(self.device.alloc(nbytes, torch.uint8))
        self.footprint += nbytes
        self.peak = max(self.peak, self.footprint)
        self.allocations += 1
        return slot

    def fit(self, room: int) -> None:
        """Hold at most `room` bytes of slots from now on: free slots go back to the allocator until they fit."""
        self.room = room
        if self.footprint <= room:  # the plan's budget changes at accesses: most changes leave the slots as they are
            return
        before = self.footprint
        self._release(lambda held: held > room)
        if self.footprint != before:  # to the device, where no activation carves them (the Note)
            self.device.empty_cache()

    def release(self) -> int:
        """Give every free slot back to the allocator; the bytes of the largest, 0 for none."""
        largest = max((nbytes for nbytes, queue in self._free.items() if queue), default=0)
        self._release(lambda held: True)
        return largest

    @property
    def free_bytes(self) -> int:
        return sum(len(q) * nbytes for nbytes, q in self._free.items())

    def _reusable(self, nbytes: int) -> _Slot | None:
        queue = self._free.get(nbytes)
        if not queue:
            return None
        for index, slot in enumerate(queue):
            if self._unreferenced(slot):
                del queue[index]
                return slot
        return None

    def _unreferenced(self, slot: _Slot) -> bool:
        """Nothing refers to the slot's memory but the arena (and, in the simulation, a copy in flight)."""
        users = torch._C._storage_Use_Count(slot.base.untyped_storage()._cdata)
        return users <= 2 + self.device.holds(slot.base)  # the base, the probe's storage, copies in flight

    def _release(self, over: Callable[[int], bool], keep: int = 0) -> None:
        """Drop free slots, those of other sizes than `keep` first, while `over(bytes held)`."""
        for nbytes in sorted(self._free, key=lambda n: n == keep):
            queue = self._free[nbytes]
            while queue and over(self.footprint):
                queue.popleft()
                self.footprint -= nbytes
