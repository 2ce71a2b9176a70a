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


def test_a_slot_given_back_to_the_allocator_leaves_the_device_rather_than_its_cache(sim_memory):
    # Cached, the slot's segment was where the next activations went (best fit), and the next slot, needed while a
    # few of them still lived there, found only holes: GPT-NeoX and Swin in fp32 at a twentieth of their model data,
    # chunks of three times their largest parameter, died of CUDA's out-of-memory error in a later step's backward.
    from chunkmem.memory.device import make_device

    memory = sim_memory(1.0)
    arena = SlotArena(make_device("cpu"))
    taken = arena.take(30 * MiB // 4, torch.float32)
    arena.give(taken.payload, None)
    del taken
    assert memory.allocator.reserved == 30 * MiB
    arena.fit(0)  # the chunk budget shrank below the free slot: activations get its room
    assert arena.footprint == 0 and memory.allocator.reserved == 0, "released, not cached"
