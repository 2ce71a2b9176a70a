"""The CUDA path: the same parity as the simulation, on a real device. Skipped without CUDA."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, tiny_gpt2, train

import chunkmem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("fraction", [None, 0.3])
def test_cuda_matches_the_simulation_bit_for_bit(fraction):
    # Same kernels on both sides: chunkmem on CUDA against plain PyTorch on CUDA.
    model, batches = tiny_gpt2(), gpt2_batches(4)
    make_opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    plain = tiny_gpt2().cuda()
    ref = train(plain, make_opt(plain.parameters()), [b.cuda() for b in batches], gpt2_loss)
    budget = None if fraction is None else int(param_bytes(model) * fraction)
    cm, opt = chunkmem.prepare(model, make_opt(model.parameters()),
                               chunkmem.Config(device="cuda", device_memory=budget))
    got = train(cm, opt, batches, gpt2_loss)
    assert got == pytest.approx(ref, rel=1e-5)
    stats = cm.memory_stats()
    assert stats["device_chunk_bytes_peak"] <= stats["device_limit_bytes"]
    assert all(c.host.is_pinned() for c in cm.runtime.store.chunks())


def test_copy_engine_batched_round_trip_and_pinned_pool():
    from chunkmem import native
    from chunkmem.hostpool import EngineAllocator, HostPool, RegisteredAllocator

    engine = native.copy_engine(torch.cuda.current_device())
    if engine is None:
        pytest.skip(f"the CUDA copy engine is not built here: {native.missing().get(native.COPY_ENGINE)}")
    pool = HostPool(EngineAllocator(native.load_copy_engine()))
    sizes = [1, 1000, 1 << 20, 3 * (1 << 20) + 7]  # odd sizes too: copies are byte-exact, not rounded
    hosts = [pool.tensor(n, torch.float32).copy_(torch.randn(n)) for n in sizes]
    assert all(h.is_pinned() for h in hosts)
    assert pool.stats()["host_pinned_bytes"] == 4 * sum(sizes)
    compute = torch.cuda.current_stream()
    devices = [torch.empty(n, device="cuda") for n in sizes]
    uploaded = engine.copy(devices, hosts, compute.cuda_stream)  # one call for the whole list
    uploaded.wait(compute.cuda_stream)  # compute reads the chunks only after the copies
    doubled = [d * 2 for d in devices]
    backs = [pool.tensor(n, torch.float32) for n in sizes]
    downloaded = engine.copy(backs, doubled, compute.cuda_stream)
    downloaded.synchronize()
    assert downloaded.query()
    for host, back in zip(hosts, backs):
        assert torch.equal(back, host * 2)
    address = hosts[2].data_ptr()
    del hosts
    assert pool.tensor(1 << 20, torch.float32).data_ptr() == address  # the freed block, same size
    with pytest.raises(RuntimeError, match="direction"):
        engine.copy([devices[0]], [devices[0]])
    with pytest.raises(RuntimeError, match="bytes"):
        engine.copy([devices[0]], [backs[1]])

    registered = HostPool(RegisteredAllocator())  # the route without the extension: cudaHostRegister
    buffer = registered.tensor(1000, torch.float32).copy_(torch.arange(1000.0))
    assert buffer.is_pinned()
    assert torch.equal(buffer.cuda(non_blocking=True).cpu(), torch.arange(1000.0))


def test_cuda_runtime_uses_the_copy_engine_when_built():
    from chunkmem import native

    model, batches = tiny_gpt2(), gpt2_batches(2)
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               chunkmem.Config(device="cuda", device_memory=int(param_bytes(model) * 0.3)))
    train(cm, opt, batches, gpt2_loss)
    device = cm.runtime.device
    assert (device.engine is not None) == (native.load_copy_engine() is not None)
    stats = cm.memory_stats()
    assert stats["host_pinned_bytes"] >= stats["model_data_bytes"] and stats["host_pageable_bytes"] == 0
