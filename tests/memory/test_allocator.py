"""The model of CUDA's caching allocator (chunkmem/memory/allocator.py) and the simulated device memory it places
(simmemory.py): rounding, pools, best fit, splits and merges, the cap, and fragmentation where CUDA has it."""

from __future__ import annotations

import queue
import random
import sys
import threading

import pytest
import torch

from chunkmem.memory.allocator import CachingAllocator, Sizes

MiB = 1 << 20


def test_requests_are_rounded_and_take_segments_of_their_pool():
    sizes = Sizes()
    assert [sizes.round(n) for n in (1, 512, 513, 3 * MiB + 1)] == [512, 512, 1024, 3 * MiB + 512]
    assert sizes.segment(4096) == 2 * MiB, "small requests share 2 MiB segments"
    assert sizes.segment(5 * MiB) == 20 * MiB, "large requests under 10 MiB share 20 MiB segments"
    assert sizes.segment(250 * MiB + 1) == 252 * MiB, "larger ones get their size rounded up to 2 MiB"
    scaled = Sizes.scaled(1024)
    assert (scaled.min_block, scaled.small, scaled.small_segment, scaled.large_segment) == (1, 1024, 2048, 20480)


def test_best_fit_splits_what_is_worth_keeping_and_freed_neighbours_merge():
    allocator = CachingAllocator()
    a = allocator.malloc(4 * MiB)  # a 20 MiB segment: 4 MiB used, 16 MiB cached
    b = allocator.malloc(4 * MiB)
    assert (allocator.reserved, allocator.allocated) == (20 * MiB, 8 * MiB)
    assert b.address == a.address + 4 * MiB, "carved from the same segment, next to it"
    c = allocator.malloc(int(11.5 * MiB))  # 12 MiB left: the 0.5 MiB rest is not worth a block (<= 1 MiB)
    assert c.size == 12 * MiB and allocator.reserved == 20 * MiB
    allocator.free(a)
    allocator.free(c)
    d = allocator.malloc(5 * MiB)  # best fit: the 4 MiB hole is too small, the 12 MiB one takes it
    assert d.address == c.address
    allocator.free(b)
    allocator.free(d)
    allocator.empty_cache()
    assert allocator.reserved == 0, "all merged back into one free segment, released"


def test_at_the_cap_cached_segments_are_released_and_the_request_retried():
    allocator = CachingAllocator(allowed=40 * MiB)
    blocks = [allocator.malloc(12 * MiB) for _ in range(3)]
    for block in blocks:
        allocator.free(block)
    assert allocator.reserved == 36 * MiB
    allocator.malloc(30 * MiB)  # no cached block holds it, and 36 + 30 > 40: release the free segments first
    assert allocator.reserved == 30 * MiB


def test_activations_freed_out_of_order_leave_holes_a_chunk_cannot_use():
    # The lent H100's failure in miniature: chunk-sized blocks freed between live activations become holes.
    allocator = CachingAllocator(allowed=190 * MiB)
    chunks = [allocator.malloc(40 * MiB) for _ in range(4)]
    for chunk in chunks:
        allocator.free(chunk)  # evicted: cached, 160 MiB reserved and free
    activations = [allocator.malloc(30 * MiB) for _ in range(4)]  # each carved from a 40 MiB hole
    assert allocator.reserved == 160 * MiB and allocator.allocated == 120 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="allocate 40.00 MiB.*40.00 MiB reserved but unallocated"):
        allocator.malloc(40 * MiB)  # 40 MiB free in four 10 MiB holes; a new segment would exceed the cap
    assert len(activations) == 4


def test_room_for_several_blocks_is_certain_within_fresh_segments_or_once_the_cache_is_released():
    # Phi in fp32 at 3% of its model data (budget_sweep.py): a cached free segment counted as room for a weight's
    # gradient, and the smaller gradient of the op's input, allocated first, was carved out of it.
    allocator = CachingAllocator(allowed=54 * MiB)
    live = allocator.malloc(20 * MiB)
    allocator.free(allocator.malloc(16 * MiB))  # a 16 MiB segment, cached and wholly free
    need = allocator.sizes.segment(11 * MiB) + allocator.sizes.segment(20 * MiB)  # 12 + 20 MiB
    room = allocator.room()
    assert room is not None and (room.sure, room.most, room.fresh) == (34 * MiB, 34 * MiB, 18 * MiB)
    assert room.fresh < need <= room.sure
    first = allocator.malloc(11 * MiB)  # best fit: the cached segment, which it splits
    assert allocator.reserved == 36 * MiB, "carved from the cached segment, which is no longer free"
    with pytest.raises(torch.OutOfMemoryError):
        allocator.malloc(20 * MiB)  # 36 + 20 > 54, and nothing is left to release
    allocator.free(first)
    allocator.empty_cache()  # released first, the same requests take new segments within `sure`
    assert allocator.room() == (34 * MiB, 34 * MiB, 34 * MiB)
    blocks = [allocator.malloc(11 * MiB), allocator.malloc(20 * MiB)]
    assert allocator.reserved == 20 * MiB + need and live.used and all(b.used for b in blocks)


@pytest.fixture
def memory(sim_memory):
    return sim_memory(1)


def test_tensors_computed_from_device_tensors_are_device_memory_until_they_die(memory):
    weight = memory.charge(torch.ones(1024, 1024))  # 4 MiB: a 20 MiB large segment
    host = torch.ones(1024)
    assert memory.allocator.allocated == 4 * MiB
    out = weight @ host  # on the device: 4 KiB in a small segment
    assert memory.allocator.allocated == 4 * MiB + 4096 and memory.on_device(out)
    assert not memory.on_device(host * 2), "an op without device inputs runs on the host"
    downloaded = weight.to("cpu", copy=True)
    assert not memory.on_device(downloaded), "a copy to the host is host memory"
    view = weight[:10]
    assert memory.allocator.allocated == 4 * MiB + 4096, "a view takes no memory"
    del out, weight
    assert memory.allocator.allocated == 4 * MiB, "the storage is alive while a view holds it"
    del view
    assert memory.allocator.allocated == 0


def test_an_op_beyond_the_cap_raises_cudas_out_of_memory_error(memory):
    owner = type("Owner", (), {})()
    memory.limit(owner, 24 * MiB, 0)
    weight = memory.charge(torch.ones(1024, 1024))
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        weight.repeat(8, 1)  # 32 MiB: beyond the cap
    del owner
    assert memory.allocator.allowed is None, "the cap goes with the last model that set it"


def test_a_cap_lowered_below_what_is_reserved_gives_the_free_segments_back(memory):
    # What the process holds outside the allocator grew after the cap was set (kernels load lazily): the cap comes
    # down, and cached segments no block uses leave, as on CUDA (device._apply_cap), so the process holds the budget.
    owner = type("Owner", (), {})()
    memory.limit(owner, 64 * MiB, 0)
    kept, dropped = memory.charge(torch.ones(1024, 1024)), memory.charge(torch.ones(6 * 1024, 1024))
    del dropped
    assert memory.allocator.reserved == 20 * MiB + 24 * MiB, "the freed 24 MiB segment stays cached"
    memory.limit(owner, 32 * MiB, 0)
    assert memory.allocator.reserved == 20 * MiB, "the wholly free segment went; the one in use stays"
    assert kept.sum() == 1024 * 1024


def test_blocks_freed_by_another_thread_while_one_allocates_keep_the_books_whole():
    """The simulated copy thread drops the last reference to device tensors as their copies land, so their blocks are
    freed on it while the main thread allocates (the README's fine-tuning job reached it at step 291: a free list lost
    a block, and `free` raised IndexError from a storage's finalizer). With thread switches forced every microsecond,
    the books must still balance: all freed, every segment one free block, listed once."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        allocator = CachingAllocator(sizes=Sizes.scaled(1024))
        handed: queue.SimpleQueue = queue.SimpleQueue()
        errors: list[BaseException] = []

        def free_them() -> None:
            try:
                while (block := handed.get()) is not None:
                    allocator.free(block)
            except BaseException as error:  # noqa: BLE001 - reported by the main thread
                errors.append(error)

        thread = threading.Thread(target=free_them)
        thread.start()
        rng = random.Random(0)
        for _ in range(20000):
            handed.put(allocator.malloc(rng.choice([300, 700, 1500, 5000, 12000])))
        handed.put(None)
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert allocator.allocated == 0 and allocator.reserved == allocator.releasable
    listed = [block for pool in allocator._free.values() for _, _, block in pool]
    assert len(listed) == len({id(b) for b in listed}) == len(allocator._segments)
    assert all(block.size == block.segment.size for block in listed)
