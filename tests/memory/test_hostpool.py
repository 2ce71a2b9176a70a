"""The host memory pool: exact-size reuse, accounting, caps, the pageable fallback, and a run under a cap.

All on CPU: the simulation's allocator is the pinned allocator's twin, so the policy tested here is
the one CUDA runs (tests/test_cuda.py covers the real page-locked allocators).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import logging
import types
import weakref
from typing import Any

import pytest
import torch

from chunkmem.memory import hostpool, native
from chunkmem.memory.device import make_device
from chunkmem.memory.hostpool import Block, HostPool, PlainAllocator, reserve_bytes
from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, prepared, train

FakeMemory = collections.namedtuple("FakeMemory", "total available")
GiB = 1 << 30


class Recording(PlainAllocator):
    """The simulation's allocator, keeping a log of frees; `fail` makes alloc raise as cudaHostAlloc can."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(pinned=True)
        self.fail = fail
        self.freed: list[int] = []

    def alloc(self, nbytes: int) -> Block:
        if self.fail:
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return super().alloc(nbytes)

    def free(self, block: Block) -> None:
        self.freed.append(block.nbytes)
        super().free(block)


@pytest.fixture
def plenty_of_ram(monkeypatch):
    """Available RAM far above the reserve, whatever this machine has, so only the tested cap binds."""
    monkeypatch.setattr(hostpool.psutil, "virtual_memory", lambda: FakeMemory(64 * GiB, 60 * GiB))


def ram(monkeypatch, slack: int) -> None:
    """Make the machine report `slack` bytes of available RAM above the pool's reserve."""
    total = 64 * GiB
    monkeypatch.setattr(hostpool.psutil, "virtual_memory",
                        lambda: FakeMemory(total, reserve_bytes(total) + slack))


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "chunkmem" and r.levelno == logging.WARNING]


def test_a_freed_buffer_is_reused_by_a_request_of_exactly_its_size(plenty_of_ram):
    pool = HostPool(PlainAllocator(pinned=True))
    first = pool.tensor(1000, torch.float32)
    address = first.data_ptr()
    del first
    again = pool.tensor(1000, torch.float32)
    assert again.data_ptr() == address
    del again
    same_bytes = pool.tensor(2000, torch.bfloat16)  # 4000 bytes too: the dtype does not matter
    assert same_bytes.data_ptr() == address and same_bytes.dtype is torch.bfloat16
    smaller = pool.tensor(999, torch.float32)  # 3996 bytes: never rounded into the 4000-byte block
    assert smaller.data_ptr() != address
    stats = pool.stats()
    assert (stats["host_pool_hits"], stats["host_pool_misses"]) == (2, 2)
    assert stats["host_pinned_bytes"] == 4000 + 3996 and stats["host_cached_bytes"] == 0


def test_a_block_comes_back_only_when_its_last_view_dies(plenty_of_ram):
    pool = HostPool(PlainAllocator(pinned=True))
    buffer = pool.tensor(64, torch.float32)
    view = buffer.view(8, 8)[2:]
    del buffer
    gc.collect()
    assert pool.stats()["host_cached_bytes"] == 0  # the view still reads the block
    del view
    assert pool.stats()["host_cached_bytes"] == 256


def test_accounting_tracks_pinned_cached_peak_and_trim(plenty_of_ram):
    allocator = Recording()
    pool = HostPool(allocator)
    a, b = pool.tensor(100, torch.float32), pool.tensor(50, torch.float64)
    assert pool.stats()["host_pinned_bytes"] == 800
    del a
    stats = pool.stats()
    assert (stats["host_pinned_bytes"], stats["host_cached_bytes"], stats["host_pinned_bytes_peak"]) == (800, 400, 800)
    assert pool.trim() == 400 and allocator.freed == [400]
    assert pool.stats()["host_pinned_bytes"] == 400 and pool.stats()["host_cached_bytes"] == 0
    assert pool.stats()["host_pinned_bytes_peak"] == 800
    assert b.fill_(1.0).sum().item() == 50  # a block handed out is untouched by trim
    empty = pool.tensor(0, torch.float32)
    assert empty.numel() == 0 and pool.stats()["host_pool_misses"] == 2


def test_host_memory_caps_pinned_bytes_and_the_rest_is_pageable(plenty_of_ram, caplog):
    pool = HostPool(PlainAllocator(pinned=True), limit=10_000)
    pinned = pool.tensor(2000, torch.float32)  # 8000 bytes
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        over = [pool.tensor(1000, torch.float32) for _ in range(3)]  # 4000 bytes each: over the cap
    stats = pool.stats()
    assert stats["host_pinned_bytes"] == 8000 and stats["host_pageable_bytes"] == 12_000
    assert stats["host_pool_fallbacks"] == 3
    assert len(warnings_of(caplog)) == 1
    message = warnings_of(caplog)[0].getMessage()
    assert "Config.host_memory allows 10000" in message and "pageable" in message
    del over
    stats = pool.stats()  # pageable buffers are freed, not cached: pinning may succeed next time
    assert stats["host_pageable_bytes"] == 0 and stats["host_cached_bytes"] == 0
    assert pinned.numel() == 2000


def test_cached_blocks_of_other_sizes_make_room_before_falling_back(plenty_of_ram):
    allocator = Recording()
    pool = HostPool(allocator, limit=10_000)
    pool.tensor(2000, torch.float32)  # 8000 bytes, cached as soon as the unused result is dropped
    fits = pool.tensor(1000, torch.float32)
    assert allocator.freed == [8000]
    stats = pool.stats()
    assert (stats["host_pinned_bytes"], stats["host_cached_bytes"], stats["host_pool_fallbacks"]) == (4000, 0, 0)
    assert fits.numel() == 1000


def test_available_ram_caps_pinning_with_a_reserve(monkeypatch, caplog):
    ram(monkeypatch, slack=3000)
    pool = HostPool(PlainAllocator(pinned=True))
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        small = pool.tensor(500, torch.float32)  # 2000 bytes: fits above the reserve
        large = pool.tensor(1000, torch.float32)  # 4000: would eat into it
        pool.tensor(1000, torch.float32)
    stats = pool.stats()
    assert (stats["host_pinned_bytes"], stats["host_pool_fallbacks"]) == (2000, 2)
    assert len(warnings_of(caplog)) == 1 and "unpinned" in warnings_of(caplog)[0].getMessage()
    assert small.numel() + large.numel() == 1500
    assert reserve_bytes(64 * GiB) == int(6.4 * GiB) and reserve_bytes(4 * GiB) == GiB


def test_a_failing_pinned_allocator_falls_back_with_one_warning(plenty_of_ram, caplog):
    pool = HostPool(Recording(fail=True))
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        buffers = [pool.tensor(10, torch.float32) for _ in range(2)]
    assert [b.numel() for b in buffers] == [10, 10]
    assert pool.stats()["host_pageable_bytes"] == 80 and pool.stats()["host_pinned_bytes"] == 0
    assert len(warnings_of(caplog)) == 1 and "cudaHostAlloc failed" in warnings_of(caplog)[0].getMessage()


def test_a_dropped_pool_frees_its_blocks_once_no_buffer_is_out(plenty_of_ram):
    allocator = Recording()
    pool = HostPool(allocator)
    kept = pool.tensor(10, torch.float32)
    pool.tensor(20, torch.float32)  # dropped at once: cached
    del pool
    gc.collect()
    assert allocator.freed == []  # `kept` will give its block back to the pool, so the pool lives on
    del kept
    gc.collect()
    assert sorted(allocator.freed) == [40, 80]


def test_the_device_passes_host_memory_to_its_pool_and_memory_stats_reports_it(plenty_of_ram):
    device = make_device("cpu", "1MiB")
    assert device.host_pool.limit == 1 << 20
    model = mlp()
    cm, _ = prepared(model, functools.partial(torch.optim.SGD, lr=0.1))
    stats = cm.memory_stats()
    assert stats["host_pinned_bytes"] == stats["model_data_bytes"]
    assert stats["host_pageable_bytes"] == 0 and stats["host_pool_fallbacks"] == 0


def test_missing_native_parts_are_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(native, "_reported", set())
    monkeypatch.setattr(native, "_missing", {})
    monkeypatch.setattr(native, "_copy_engine_blocker", lambda: "nvcc not found")
    monkeypatch.setattr(native, "_cpu_kernel_blocker", lambda: None)
    with caplog.at_level(logging.INFO, logger="chunkmem"):
        make_device("cpu")
        make_device("cpu")
    lines = [r for r in caplog.records if r.name == "chunkmem"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO  # the simulation does not use the engine
    assert "CUDA copy engine (nvcc not found)" in lines[0].getMessage()


def _reference(model, make_opt, batches):
    import copy

    ref = copy.deepcopy(model)
    losses = train(ref, make_opt(ref.parameters()), batches, mlp_loss)
    return losses, ref.state_dict()


def _assert_same(cm, losses, ref_losses, ref_state):
    assert losses == ref_losses
    state = cm.state_dict()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_training_under_a_host_cap_that_forces_pageable_memory_matches_pytorch(plenty_of_ram, caplog, fraction):
    # Activations of 8 x 128 fp32 are offloaded through the pool; the cap is the model data exactly,
    # so the chunks are pinned and every offloaded activation falls back to pageable memory.
    model, batches = mlp(width=128, depth=4), mlp_batches(4, width=128)
    make_opt = torch.optim.AdamW
    ref_losses, ref_state = _reference(model, make_opt, batches)
    budget = None if fraction is None else int(param_bytes(model) * fraction)
    probe, _ = prepared(model, make_opt, device_memory=budget, chunk_size=20_000)
    cap = probe.memory_stats()["model_data_bytes"]
    cm, opt = prepared(model, make_opt, device_memory=budget, chunk_size=20_000, host_memory=cap,
                       offload_activations=True)
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        losses = train(cm, opt, batches, mlp_loss)
    _assert_same(cm, losses, ref_losses, ref_state)
    stats = cm.memory_stats()
    assert stats["host_pinned_bytes"] == cap and stats["host_pool_fallbacks"] > 0
    assert stats["activation_offload_bytes"] > 0
    assert len(warnings_of(caplog)) == 1


def test_training_with_every_chunk_in_pageable_memory_matches_pytorch(monkeypatch):
    # Too little RAM above the reserve for any chunk: all host payloads fall back.
    ram(monkeypatch, slack=0)
    model, batches = mlp(), mlp_batches(4)
    make_opt = torch.optim.Adam
    ref_losses, ref_state = _reference(model, make_opt, batches)
    cm, opt = prepared(model, make_opt, device_memory=int(param_bytes(model) * 0.4), chunk_size=2048)
    _assert_same(cm, train(cm, opt, batches, mlp_loss), ref_losses, ref_state)
    stats = cm.memory_stats()
    assert stats["host_pinned_bytes"] == 0 and stats["host_pageable_bytes"] == stats["model_data_bytes"]


def test_trim_lets_copies_finish_before_blocks_go_back_to_the_allocator(plenty_of_ram):
    # A block's last view can die while a copy still uses it (CUDA copies hold no Python reference), and
    # an unpinned block may be handed to anyone at once: the device synchronises first.
    order: list[str] = []
    allocator = Recording()
    allocator.free = lambda block: order.append("free")  # type: ignore[method-assign]
    pool = HostPool(allocator, before_free=lambda: order.append("synchronize"))
    pool.tensor(100, torch.float32)  # dropped at once: cached
    assert pool.trim() == 400 and order == ["synchronize", "free"]
    assert pool.trim() == 0 and order == ["synchronize", "free"], "nothing cached: nothing to wait for"


def test_a_pool_that_goes_lets_copies_finish_before_its_blocks_go_back(plenty_of_ram):
    # As trim: when the model goes, a download may still be writing into a block whose last view died. The pool's
    # finalizer freed them at once, and a CUDA device's bound synchronize would have kept the pool alive for good.
    class Owner:  # what a device is to its pool: it holds the pool, and its bound method is the pool's before_free
        def __init__(self) -> None:
            self.pool = HostPool(allocator, before_free=self.synchronize)

        def synchronize(self) -> None:
            order.append("synchronize")

    order: list[str] = []
    allocator = Recording()
    allocator.free = lambda block: order.append("free")  # type: ignore[method-assign]
    pool = HostPool(allocator, before_free=lambda: order.append("synchronize"))
    pool.tensor(100, torch.float32)  # dropped at once: cached
    del pool
    gc.collect()
    assert order == ["synchronize", "free"]
    order.clear()
    owner = weakref.ref(Owner())
    gc.collect()
    assert owner() is None, "the finalizer holds a bound before_free weakly"


def test_a_failed_unregistration_clears_the_cuda_error_it_leaves(caplog):
    cudart = FakeCudart()
    allocator = hostpool.RegisteredAllocator(cudart, clear_error=lambda: setattr(cudart, "last_error", 0))
    block = allocator.alloc(100)
    cudart.cudaHostUnregister = lambda ptr: setattr(cudart, "last_error", 1) or 1  # type: ignore[method-assign]
    allocator.free(block)
    assert cudart.last_error == 0 and "cudaHostUnregister of 100 bytes failed with CUDA error 1" in caplog.text


def test_blocks_of_one_tag_are_never_handed_to_another(plenty_of_ram):
    pool = HostPool(PlainAllocator(pinned=True))
    staged = pool.tensor(100, torch.float32, tag="transient")
    address = staged.data_ptr()
    del staged
    assert pool.tensor(100, torch.float32).data_ptr() != address, "a chunk payload never reuses a transient block"
    assert pool.tensor(100, torch.float32, tag="transient").data_ptr() == address


class FakeCudart:
    """cudaHostRegister as the driver keeps it: page-granular, refusing a page registered already, and
    leaving its error as the thread's last CUDA error."""

    PAGE = 4096

    def __init__(self, fail: bool = False) -> None:
        self.pages: set[int] = set()
        self.fail = fail
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        pages = set(range(ptr // self.PAGE, (ptr + nbytes - 1) // self.PAGE + 1))
        if self.fail or pages & self.pages:
            self.last_error = 2 if self.fail else 712  # cudaErrorMemoryAllocation, ...HostMemoryAlreadyRegistered
            return self.last_error
        self.pages |= pages
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.pages -= {p for p in self.pages if p >= ptr // self.PAGE}
        return 0


def test_registered_blocks_never_share_a_page():
    # Two small blocks from a general allocator share a page, and registering the second one fails.
    cudart = FakeCudart()
    allocator = hostpool.RegisteredAllocator(cudart, clear_error=lambda: None)
    blocks = [allocator.alloc(n) for n in (100, 100, 5000, 1)]
    assert all(b.pinned for b in blocks) and len({b.ptr // FakeCudart.PAGE for b in blocks}) == 4
    for block in blocks:
        allocator.free(block)
    assert not cudart.pages


def test_a_failed_registration_clears_the_cuda_error_it_leaves():
    cudart = FakeCudart(fail=True)
    allocator = hostpool.RegisteredAllocator(cudart, clear_error=lambda: setattr(cudart, "last_error", 0))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 100 bytes failed with CUDA error 2"):
        allocator.alloc(100)
    assert cudart.last_error == 0, "torch's next kernel-launch check would report it as its own"


@pytest.mark.parametrize("kind", ["registered", "engine"])
def test_pinned_blocks_go_back_on_their_own_device_whatever_thread_frees_them(kind, monkeypatch):
    # The pool's finalizer runs on whichever thread the garbage collector ran on; one that never chose a device would
    # make GPU 0's context for cudaFreeHost or cudaHostUnregister (half a GiB on a GPU a rank under torchrun leaves).
    current = ["the thread's own"]

    @contextlib.contextmanager
    def device(index: int):
        before, current[0] = current[0], index
        yield
        current[0] = before
    monkeypatch.setattr(torch.cuda, "device", device)
    freed_on = []
    if kind == "registered":
        cudart = FakeCudart()
        unregister = cudart.cudaHostUnregister
        cudart.cudaHostUnregister = lambda ptr: freed_on.append(current[0]) or unregister(ptr)  # type: ignore
        allocator: Any = hostpool.RegisteredAllocator(cudart, clear_error=lambda: None, device=3)
    else:
        engine = types.SimpleNamespace(pinned_alloc=lambda n: (4096, ""),
                                       pinned_free=lambda ptr: freed_on.append(current[0]) or "")
        allocator = hostpool.EngineAllocator(engine, device=3)  # type: ignore[arg-type]
    allocator.free(allocator.alloc(100))
    assert freed_on == [3] and current[0] == "the thread's own"
