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
