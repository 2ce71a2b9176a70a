"""benchmarks/overhead.py's reference: plain PyTorch doing the same work as the chunkmem step it is timed against.

A ratio to plain PyTorch means something only if both sides compute the same thing. In fp32 the plain side is
the model and torch.optim.AdamW; in bf16 it is mixed precision written by hand (bf16 model, fp32 master weights
and states, gradients cast up, the master cast down). Here both sides train a few steps from the same weights
and must end on the same bits: a baseline that skipped work (no cast, no master copy) would differ, and so did
one that cast LLaMA's rotary frequencies (a buffer) to bf16, which chunkmem keeps in fp32.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import gpt2
from benchmarks.overhead import DTYPES, chunk_step, loss_fn, mlp, plain_step
from benchmarks.placement import llama

TINY = {"mlp": lambda: mlp(3, 16), "gpt2": lambda: gpt2(2, 32, 64, 8), "llama": lambda: llama(2, 32, 64, 8)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(TINY))
def test_the_plain_step_lands_on_chunkmems_bits(name: str, dtype: str) -> None:
    make = TINY[name]
    batch = torch.randn(4, 16) if name == "mlp" else torch.randint(0, 64, (2, 8))
    loss = loss_fn(name, batch, DTYPES[dtype])
    plain_model = make()
    start = {n: p.detach().to(DTYPES[dtype]) for n, p in make().named_parameters()}
    plain = plain_step(plain_model, loss, DTYPES[dtype])
    chunk, wrapped = chunk_step(make(), loss, dtype, None)
    for _ in range(3):
        plain()
        chunk()
    ours, theirs = dict(wrapped.module.named_parameters()), dict(plain_model.named_parameters())
    assert ours.keys() == theirs.keys() and ours
    for param_name, value in theirs.items():
        assert value.dtype == DTYPES[dtype]
        assert torch.equal(ours[param_name].detach(), value.detach()), f"{param_name} differs after 3 steps"
    assert any(not torch.equal(value, start[n]) for n, value in ours.items()), "three steps changed nothing"
