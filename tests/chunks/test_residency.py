"""The device budget: evictions, write-backs, and the bytes counted for each move."""

from __future__ import annotations

import pytest
import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.residency import LeastRecentlyUsed, Residency
from chunkmem.chunks.state import ChunkState
from chunkmem.errors import MemoryBudgetError
from chunkmem.memory.sim import HazardError, SimulatedDevice


def setup(n: int, limit_chunks: int, landing: str | None = None) -> tuple[Residency, list[Chunk], list[str]]:
    dev = SimulatedDevice(landing=landing)
    moved: list[str] = []
    chunks = [Chunk(f"c{i}", 16, torch.float32, dev) for i in range(n)]
    for i, chunk in enumerate(chunks):
        chunk.materialize_host()
        chunk.host.fill_(float(i))
    return Residency(dev, limit_chunks * 64, LeastRecentlyUsed(), lambda c: moved.append(c.name)), chunks, moved


def test_budget_evicts_least_recently_used_and_counts_bytes():
    res, (a, b, c), moved = setup(3, limit_chunks=2)
    res.to_device(a)
    res.to_device(b)
    res.to_device(a)  # a is now the most recent
    res.to_device(c)  # evicts b
    assert not b.state.on_device and a.state.on_device and c.state.on_device
    assert res.stats.h2d_bytes == 3 * 64 and res.stats.d2h_bytes == 0, "clean eviction copies nothing"
    assert res.stats.device_chunk_bytes_peak == 128 == res.limit
    assert moved == ["c0", "c1", "c1", "c2"], "b leaves before c arrives"


def test_an_eviction_does_not_wait_for_its_copy_and_the_first_read_does():
    res, (a, b), _ = setup(2, limit_chunks=1, landing="wait")  # not at random, whatever CHUNKMEM_SIM_LANDING says
    slot = res.to_device(a).fill_(42.0).data_ptr()
    a.write_device()
    res.to_device(b)  # evicts a: its write-back starts, and the host does not wait for it
    assert a.landings and res.stats.d2h_bytes == 64
    assert b.device_unfenced.data_ptr() == slot, "b's upload goes into a's slot, on its stream after a's write-back"
    with pytest.raises(HazardError, match="host op .* reads .* download of c0"):
        a.host_unfenced.sum()  # reading without waiting: a race on a GPU
    assert torch.equal(a.host, torch.full((16,), 42.0)) and not a.landings
    res.to_device(a)  # the upload reads the host payload, so it too would have waited
    assert torch.equal(a.device, torch.full((16,), 42.0))


def test_dirty_eviction_writes_back_and_the_value_survives():
    res, (a, b), _ = setup(2, limit_chunks=1)
    res.to_device(a).fill_(42.0)
    a.write_device()
    res.to_device(b)
    assert a.state is ChunkState.HOST
    assert res.stats.d2h_bytes == 64
    assert torch.equal(res.to_device(a), torch.full((16,), 42.0))


def test_pinned_chunks_are_never_evicted_and_overflow_is_a_clear_error():
    res, (a, b), _ = setup(2, limit_chunks=1)
    res.to_device(a)
    a.pins = 1
    with pytest.raises(MemoryBudgetError, match=r"chunk c1 needs 64 bytes .* 64 of the 64 allowed .* \(c0\)"):
        res.to_device(b)
    assert a.state.on_device


def test_host_for_write_makes_the_host_copy_the_only_one():
    res, (a,), _ = setup(1, limit_chunks=1)
    res.to_device(a).fill_(5.0)
    a.write_device()
    host = res.host_for_write(a)
    assert torch.equal(host, torch.full((16,), 5.0))
    assert a.state is ChunkState.HOST and res.stats.device_chunk_bytes == 0 and "c0" not in res.resident


def test_reset_frees_device_memory_and_reads_as_zeros():
    res, (a,), _ = setup(1, limit_chunks=1)
    res.to_device(a)
    res.reset(a)
    assert a.state is ChunkState.FREE and res.stats.device_chunk_bytes == 0
    assert torch.equal(res.to_device(a), torch.zeros(16)), "a FREE chunk comes back as zeros, without a copy"
    assert res.stats.h2d_bytes == 64


def test_a_prefetch_the_allocator_has_no_room_for_is_dropped_and_evicts_nothing(monkeypatch):
    """An access fetched `a` (single chunks are fetched unpinned: nothing else comes meanwhile), then the plan
    prefetches `b` and the allocator refuses it. The out-of-memory fallback would evict `a`, which the access is
    about to read; the prefetch is dropped instead and `b` comes when needed (which may fall back: it needs it)."""
    res, (a, b), _ = setup(2, limit_chunks=2)
    res.to_device(a)
    upload = b.upload
    refusals = iter([True, True, False])

    def refused(device):
        if next(refusals):
            raise torch.OutOfMemoryError("no room for c1")
        upload(device)
    monkeypatch.setattr(b, "upload", refused)
    res.bring(b, "prefetch")
    assert a.state.on_device and not b.state.on_device
    assert (res.stats.prefetches_dropped, res.stats.oom_fallbacks, res.stats.evictions) == (1, 0, 0)
    res.to_device(b)  # needed now: the fallback frees what is not pinned, a, and b comes
    assert b.state.on_device and not a.state.on_device and res.stats.oom_fallbacks == 1


def test_a_chunk_the_allocator_has_no_room_for_with_nothing_left_to_evict_is_refused_with_what_to_change(monkeypatch):
    """In backward an op cannot be retried, but an access can: when even with every other chunk gone the allocator
    refuses the one the access needs, activations leave no room for it, and the error says what to change."""
    res, (a, b), _ = setup(2, limit_chunks=2)
    res.to_device(a)

    def refused(device):
        raise torch.OutOfMemoryError("no room for c1")
    monkeypatch.setattr(b, "upload", refused)
    with pytest.raises(MemoryBudgetError, match=r"c1 needs 64 bytes .*checkpoint activations.*Config.chunk_size"):
        res.to_device(b)
    assert not a.state.on_device and not b.state.on_device, "a gave way before the refusal"
