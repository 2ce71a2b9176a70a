"""The chunks' slot arena (chunkmem/memory/arena.py)."""

from __future__ import annotations

import torch

from chunkmem.memory.arena import SlotArena

MiB = 1 << 20


class CappedDevice:
    """Allocations up to `cap` bytes, then CUDA's out-of-memory error (the segments left no room)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.allocated = cap, 0

    def alloc(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        if self.allocated + nbytes > self.cap:
            raise torch.OutOfMemoryError("CUDA out of memory")
        self.allocated += nbytes
        return torch.empty(nbytes, dtype=dtype)

    def empty_cache(self) -> None:
        pass

    def holds(self, tensor: torch.Tensor) -> int:  # no copy in flight refers to a slot
        return 0


def test_a_plan_whose_slots_the_allocator_cannot_place_now_reserves_those_it_can():
    # A plan made at a step's end reserves its slots; the allocator's segments (activations' cached ones, rounding)
    # may leave room for fewer. That must not end training: the rest are taken when needed, where an upload out
    # of memory makes room by evicting (the plan --simulate run at 48 MiB in tests/trace/test_planner.py).
    arena = SlotArena(CappedDevice(2 * MiB))  # type: ignore[arg-type]
    arena.reserve({MiB: 3})
    assert arena.footprint == arena.free_bytes == 2 * MiB
    taken = [arena.take(MiB // 4, torch.float32) for _ in range(2)]  # the reserved slots, not new allocations
    assert arena.allocations == 2 and all(t.payload.numel() == MiB // 4 for t in taken)
