"""The copy engine's Python face (chunkmem/memory/native.py), without a GPU: the extension returns its errors and
the wrapper raises them, a bad batch never reaches the C++ side, and a refused cudaHostAlloc falls back to pageable
memory (on the lent H100 a C++ exception from the extension ended the process instead)."""

from __future__ import annotations

import logging
import types

import psutil
import pytest
import torch

from chunkmem.memory import native
from chunkmem.memory.hostpool import EngineAllocator, HostPool
from chunkmem.memory.native import CopyEngine

GiB = 1 << 30


def side(cuda: bool, nbytes: int = 64, dtype: torch.dtype = torch.float32) -> types.SimpleNamespace:
    """A tensor as the check sees it: a CUDA one cannot be made here."""
    return types.SimpleNamespace(is_cuda=cuda, get_device=lambda: 0 if cuda else -1,
                                 device=torch.device("cuda" if cuda else "cpu"), is_contiguous=lambda: True,
                                 nbytes=nbytes, dtype=dtype)


class FakeExtension:
    """The compiled CopyEngine's surface, recording the batches that reach it."""

    def __init__(self, error: str = "") -> None:
        self.device, self.error, self.h2d_stream, self.d2h_stream = 0, "", 11, 12
        self.reached: list[tuple] = []
        self.copy_error = error

    def copy(self, dst: list, src: list, after: int) -> tuple[object, str]:
        self.reached.append((dst, src, after))
        event = types.SimpleNamespace(wait=lambda s: "", synchronize=lambda: "cudaEventSynchronize failed",
                                      query=lambda: (False, ""))
        return (None, self.copy_error) if self.copy_error else (event, "")


def test_a_bad_batch_raises_before_it_reaches_the_extension():
    raw = FakeExtension()
    engine = CopyEngine(raw)
    with pytest.raises(RuntimeError, match="wrong direction"):
        engine.copy([side(True)], [side(True)], 0)  # device to device
    with pytest.raises(RuntimeError, match="pair 0 has 32 bytes for 64 bytes"):
        engine.copy([side(True)], [side(False, 32)], 0)
    with pytest.raises(RuntimeError, match="empty batch"):
        engine.copy([], [], 0)
    assert raw.reached == []
    event = engine.copy([side(True)], [side(False)], 7)
    assert len(raw.reached) == 1 and event.query() is False
    with pytest.raises(RuntimeError, match="cudaEventSynchronize"):
        event.synchronize()


def test_an_error_the_extension_returns_is_raised():
    with pytest.raises(RuntimeError, match="cudaMemcpyAsync failed"):
        CopyEngine(FakeExtension("chunkmem copy engine: cudaMemcpyAsync failed")).copy([side(True)], [side(False)], 0)
    broken = FakeExtension()
    broken.error = "chunkmem copy engine: cudaStreamCreateWithFlags (h2d) failed"
    with pytest.raises(RuntimeError, match="cudaStreamCreateWithFlags"):
        CopyEngine(broken)


def test_an_engine_that_cannot_start_leaves_copies_to_pytorchs_streams_and_says_why(monkeypatch):
    # Its streams not made (a device out of memory at prepare): the RuntimeError above ended the run at prepare; the
    # device now copies on PyTorch's streams, as without the extension (CudaDevice), and report_missing names it.
    def broken(device: int) -> FakeExtension:
        raw = FakeExtension()
        raw.error = "chunkmem copy engine: cudaStreamCreateWithFlags (h2d) failed: out of memory"
        return raw

    monkeypatch.setattr(native, "load_copy_engine", lambda: types.SimpleNamespace(CopyEngine=broken))
    monkeypatch.setattr(native, "_missing", {})
    assert native.copy_engine.__wrapped__(0) is None
    assert native.missing()[native.COPY_ENGINE] == (
        "did not start on cuda:0: chunkmem copy engine: cudaStreamCreateWithFlags (h2d) failed: out of memory")


def test_a_refused_cuda_host_alloc_falls_back_to_pageable_memory(monkeypatch, caplog):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=64 * GiB, available=60 * GiB))
    extension = types.SimpleNamespace(pinned_alloc=lambda n: (0, "chunkmem copy engine: cudaHostAlloc of 400 bytes "
                                                               "failed (out of memory)"), pinned_free=lambda p: "")
    pool = HostPool(EngineAllocator(extension))
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        buffer = pool.tensor(100, torch.float32)
    assert buffer.numel() == 100 and pool.stats()["host_pool_fallbacks"] == 1
    assert "cudaHostAlloc of 400 bytes failed" in caplog.text
