"""A chunk's payloads: what a materialized chunk reads as, and who zeroes it (chunk's Note on unwritten ranges)."""

from __future__ import annotations

import pytest
import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.errors import ChunkStateError
from chunkmem.memory.sim import SimulatedDevice


def test_a_materialized_device_chunk_is_zeroed_where_nobody_wrote_when_first_read():
    dev = SimulatedDevice()
    chunk = Chunk("grad.0", 64, torch.float32, dev)
    chunk.materialize_device(dev)
    chunk.overwrite(lambda flat: flat[16:32]).fill_(2.0)
    chunk.overwrite(lambda flat: flat[32:40]).fill_(3.0)
    assert chunk.unwritten == [(0, 16), (40, 64)]
    # Nothing zeroed it yet: the simulation poisons fresh device memory while checking (as the suite does).
    assert torch.isnan(chunk.device_unfenced[:16]).all() and torch.isnan(chunk.device_unfenced[40:]).all()
    expected = torch.cat([torch.zeros(16), torch.full((16,), 2.0), torch.full((8,), 3.0), torch.zeros(24)])
    assert torch.equal(chunk.device, expected)
    assert chunk.unwritten == []


def test_a_host_chunk_receiving_parts_reads_zeros_elsewhere_and_adds_onto_zeros():
    dev = SimulatedDevice(landing="wait")
    chunk = Chunk("grad.0", 32, torch.float32, dev)
    chunk.materialize_host()
    assert torch.isnan(chunk.host_unfenced).all(), "its old bytes are poisoned, not zeroed, while checking"
    source = dev.alloc(8, torch.float32).fill_(5.0)
    chunk.receive(dev, source, lambda flat: flat[0:8])  # overwrites its part when the copy lands
    staged = torch.empty(8)
    chunk.receive(dev, source, lambda flat: flat[8:16], staged)  # adds onto an unwritten part: onto zeros
    expected = torch.cat([torch.full((8,), 5.0), torch.full((8,), 5.0), torch.zeros(16)])
    assert torch.equal(chunk.host, expected)


def test_an_upload_and_a_write_back_carry_zeros_for_unwritten_ranges():
    dev = SimulatedDevice(landing="wait")
    chunk = Chunk("grad.0", 16, torch.float32, dev)
    chunk.materialize_device(dev)
    chunk.overwrite(lambda flat: flat[:4]).fill_(1.0)
    chunk.download(dev)  # the copy reads the device payload through its accessor, which zeroes the rest first
    chunk.drop_device()
    assert torch.equal(chunk.host, torch.cat([torch.ones(4), torch.zeros(12)]))
    chunk.reset()
    chunk.materialize_host()
    chunk.upload(dev)
    assert torch.equal(chunk.device, torch.zeros(16))


def test_a_chunk_written_whole_and_dropped_gives_its_slot_to_the_next_chunk():
    dev = SimulatedDevice(landing="wait")
    chunk = Chunk("grad.0", 16, torch.float32, dev)
    chunk.materialize_device(dev)
    address = chunk.device_unfenced.data_ptr()
    chunk.overwrite(lambda flat: flat).fill_(1.0)
    chunk.download(dev)
    chunk.drop_device()
    chunk.host  # the download has landed: nothing holds the device buffer any more
    other = Chunk("grad.1", 16, torch.float32, dev)
    other.materialize_device(dev)
    assert other.device_unfenced.data_ptr() == address, "its slot goes to the next chunk (arena.py)"
    assert dev.arena.footprint == 16 * 4


def test_a_lending_chunk_allocates_no_payload_until_read_and_reads_its_lent_tensors_and_zeros():
    dev = SimulatedDevice(landing="wait")
    chunk = Chunk("grad.0", 32, torch.float32, dev, lends=True)
    chunk.materialize_device(dev)
    assert chunk.lending and chunk.device_unfenced is None
    first, second = torch.full((8,), 2.0), torch.full((2, 2), 3.0)
    chunk.lend(8, first)
    chunk.lend(20, second)
    assert chunk.lent_part(8) is first and chunk.lent_part(0) is None
    first.mul_(2.0)  # its holder changes a lent tensor in place: the chunk's value is what it holds
    expected = torch.zeros(32)
    expected[8:16], expected[20:24] = 4.0, 3.0
    assert torch.equal(chunk.device, expected), "assembled: lent ranges copied in, the rest zeros"
    assert not chunk.lending and chunk.lent == {} and chunk.unwritten == []
    second.fill_(7.0)
    assert torch.equal(chunk.device, expected), "once assembled, the payload no longer follows the tensor"


def test_a_lending_chunk_written_back_copies_its_lent_tensors_to_the_host_and_zeros_the_rest():
    dev = SimulatedDevice(landing="random:3")  # copies land late, in a random order
    chunk = Chunk("grad.0", 16, torch.float32, dev, lends=True)
    chunk.materialize_device(dev)
    chunk.lend(4, torch.full((4,), 5.0))
    chunk.download(dev)
    assert chunk.device_unfenced is None, "no device payload was allocated for the write-back"
    chunk.drop_device()
    assert chunk.lent == {}
    assert torch.equal(chunk.host, torch.cat([torch.zeros(4), torch.full((4,), 5.0), torch.zeros(8)]))


def test_only_a_lending_chunk_takes_a_contiguous_tensor_by_reference():
    dev = SimulatedDevice(landing="wait")
    plain = Chunk("grad.0", 16, torch.float32, dev)
    plain.materialize_device(dev)
    with pytest.raises(ChunkStateError, match="lend"):
        plain.lend(0, torch.ones(4))
    lending = Chunk("grad.1", 16, torch.float32, dev, lends=True)
    lending.materialize_device(dev)
    with pytest.raises(ChunkStateError, match="contiguous"):
        lending.lend(0, torch.ones(4, 2).t())


def test_a_reset_chunk_forgets_gradient_additions_still_queued_on_its_host_payload():
    # A streamed gradient chunk receives a gradient, then another through a staging buffer (accumulation),
    # and zero_grad resets it before anyone read it: neither copy may touch the payload after the reset.
    dev = SimulatedDevice(landing="wait")
    chunk = Chunk("grad.0", 8, torch.float32, dev)
    chunk.materialize_host()
    chunk.write_host()
    source = dev.alloc(4, torch.float32).fill_(100.0)
    chunk.receive(dev, source, lambda flat: flat[:4])
    chunk.receive(dev, source, lambda flat: flat[4:], torch.empty(4))
    chunk.reset()
    chunk.materialize_device(dev)
    chunk.overwrite(lambda flat: flat).copy_(torch.arange(8.0))
    chunk.download(dev)
    assert torch.equal(chunk.host, torch.arange(8.0))


def test_the_host_waits_for_an_upload_still_reading_the_host_payload_before_changing_it():
    # Compute waited for the upload (a stream wait on a GPU): the host has not, and the copy may still be reading
    # the pinned buffer when the host writes the next values into it.
    dev = SimulatedDevice(landing="wait")
    chunk = Chunk("param.0", 8, torch.float32, dev)
    chunk.materialize_host()
    chunk.host.copy_(torch.arange(8.0))
    chunk.write_host()
    chunk.upload(dev)
    assert torch.equal(chunk.device, torch.arange(8.0))  # compute waits for the upload
    chunk.drop_device()
    chunk.write_host()  # the host claims the payload to change it (an optimizer step on the host)
    chunk.host.fill_(5.0)
