"""benchmarks/overhead.py's reference: plain PyTorch doing the same work as the chunkmem step it is timed against.

A ratio to plain PyTorch means something only if both sides compute the same thing. In fp32 the plain side is
the model and torch.optim.AdamW; in bf16 it is mixed precision written by hand (bf16 model, fp32 master weights
and states, gradients cast up, the master cast down). Here both sides train a few steps from the same weights
and must end on the same bits: a baseline that skipped work (no cast, no master copy) would differ, and so did
one that cast LLaMA's rotary frequencies (a buffer) to bf16, which chunkmem keeps in fp32.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable

import pytest
import torch

from benchmarks import overhead
from benchmarks.common import gpt2
from benchmarks.overhead import DTYPES, PHASES, chunk_step, loss_fn, mlp, plain_step, timed_phases
from benchmarks.placement import llama

TINY = {"mlp": lambda: mlp(3, 16), "gpt2": lambda: gpt2(2, 32, 64, 8), "llama": lambda: llama(2, 32, 64, 8)}


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(TINY))
def test_the_plain_step_lands_on_chunkmems_bits(name: str, dtype: str, fused: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with both sides' AdamW fused (--fused): torch's kernel over each parameter against the same kernel over a
    chunk group's packed range, elementwise, so the same bits."""
    monkeypatch.setattr(overhead, "ADAMW", functools.partial(torch.optim.AdamW, lr=1e-4, fused=fused))
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


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_both_steps_lap_after_their_loss_and_after_their_backward(dtype: str) -> None:
    """The per-phase columns compare like with like: each side laps once its loss is computed and once its
    backward has run, and nowhere else."""
    events: list[str] = []
    base = loss_fn("mlp", torch.randn(4, 16), DTYPES[dtype])

    def loss(model: torch.nn.Module) -> torch.Tensor:
        value = base(model)
        events.append("loss")
        value.register_hook(lambda grad: events.append("backward"))
        return value

    chunk, _ = chunk_step(mlp(3, 16), loss, dtype, None)
    for step in (plain_step(mlp(3, 16), loss, DTYPES[dtype]), chunk):
        events.clear()
        step(lambda: events.append("lap"))
        assert events == ["loss", "lap", "backward", "lap"]
        assert len(PHASES) == events.count("lap") + 1


def test_timed_phases_splits_a_step_at_its_laps_and_counts_copies_per_phase() -> None:
    device = types.SimpleNamespace(copy_seconds=0.0)

    def step(lap: Callable[[], None]) -> None:
        for phase, (seconds, copied) in enumerate(((0.02, 1.0), (0.06, 0.0), (0.04, 2.5))):
            time.sleep(seconds)
            device.copy_seconds += copied
            if phase < 2:  # no lap after the last phase: timed_phases marks the end
                lap()

    seconds, copies, _ = timed_phases(step, device)
    assert copies == [1.0, 0.0, 2.5]
    assert len(seconds) == 3 and all(s >= need for s, need in zip(seconds, (0.02, 0.06, 0.04))), seconds
    assert timed_phases(step, None)[1] == [0.0] * 3  # plain PyTorch's side has no simulated copies
