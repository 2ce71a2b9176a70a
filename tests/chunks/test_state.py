"""Every legal and illegal move of the chunk and tensor state machines."""

from __future__ import annotations

import itertools

import pytest
import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.state import (CHUNK_MOVES, TENSOR_MOVES, ChunkState, TensorState, next_chunk_state,
                                   next_tensor_state)
from chunkmem.errors import ChunkStateError
from chunkmem.memory.device import SimulatedDevice

CHUNK_METHODS = ["materialize_host", "materialize_device", "upload", "download", "drop_device",
                 "write_host", "write_device", "reset"]
TENSOR_EVENTS = ["write", "acquire", "release", "free"]
# A plain chunk never reaches DISK: only a disk-backed one does (tests/chunks/test_hostcache.py walks those moves).
PLAIN_STATES = [s for s in ChunkState if s is not ChunkState.DISK]


@pytest.mark.parametrize("state,move", itertools.product(ChunkState, CHUNK_METHODS + ["spill", "load"]))
def test_chunk_table_accepts_exactly_the_listed_moves(state, move):
    if (state, move) in CHUNK_MOVES:
        assert next_chunk_state(state, move, "c") is CHUNK_MOVES[(state, move)]
    else:
        with pytest.raises(ChunkStateError, match=f"illegal move '{move}' from state {state.name}"):
            next_chunk_state(state, move, "c")


@pytest.mark.parametrize("state,move", itertools.product(TensorState, TENSOR_EVENTS))
def test_tensor_table_accepts_exactly_the_listed_moves(state, move):
    if (state, move) in TENSOR_MOVES:
        assert next_tensor_state(state, move, "t") is TENSOR_MOVES[(state, move)]
    else:
        with pytest.raises(ChunkStateError):
            next_tensor_state(state, move, "t")


def chunk_in(state: ChunkState) -> tuple[Chunk, SimulatedDevice]:
    dev = SimulatedDevice()
    chunk = Chunk("c", 8, torch.float32, dev)
    if state is not ChunkState.FREE:
        chunk.materialize_host()
        chunk.host.copy_(torch.arange(8.0))
    if state.on_device:
        chunk.upload(dev)
    if state is ChunkState.DEVICE_DIRTY:
        chunk.write_device()
    assert chunk.state is state
    return chunk, dev


@pytest.mark.parametrize("state,move", itertools.product(PLAIN_STATES, CHUNK_METHODS))
def test_chunk_methods_follow_the_table_and_keep_payloads_consistent(state, move):
    chunk, dev = chunk_in(state)
    method = getattr(chunk, move)
    args = (dev,) if move in ("materialize_device", "upload", "download") else ()
    if (state, move) not in CHUNK_MOVES:
        with pytest.raises(ChunkStateError):
            method(*args)
        assert chunk.state is state, "a refused move changes nothing"
        return
    method(*args)
    assert chunk.state is CHUNK_MOVES[(state, move)]
    assert (chunk.device is not None) == chunk.state.on_device
    if chunk.state.on_device and move == "upload":
        assert torch.equal(chunk.device.to("cpu", copy=True), chunk.host)  # a download: CUDA compares on one device


def test_dirty_device_copy_travels_back_on_download():
    chunk, dev = chunk_in(ChunkState.DEVICE)
    chunk.write_device()
    chunk.device.fill_(7.0)
    chunk.download(dev)
    assert torch.equal(chunk.host, torch.full((8,), 7.0))


def test_pinned_chunk_cannot_leave_the_device():
    chunk, _ = chunk_in(ChunkState.DEVICE)
    chunk.pins = 1
    with pytest.raises(ChunkStateError, match="in COMPUTE"):
        chunk.drop_device()
    with pytest.raises(ChunkStateError, match="in COMPUTE"):
        chunk.reset()
    assert chunk.state is ChunkState.DEVICE


def test_free_chunk_reads_as_zeros():
    chunk, _ = chunk_in(ChunkState.FREE)
    assert torch.equal(chunk.payload(), torch.zeros(8))
