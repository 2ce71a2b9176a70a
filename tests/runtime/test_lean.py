"""Lean forwards (runtime's Note on them): while chunks stream, a forward whose inputs already ran a step under
the plan runs without the torch-function mode, on plain PyTorch's bits; never for a model whose forward needed
the mode; an out-of-memory error in a lean or resident forward runs it again under the mode."""

from __future__ import annotations

import copy
import functools
import logging
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from chunkmem.chunks.placement import Phase
from tests import zoo
from tests.chunks.test_placement import FlakyTanh
from tests.helpers import gpt2_loss, least_accepted, mlp, mlp_batches, mlp_loss, param_bytes, prepared, tiny_gpt2, train
from tests.runtime.test_resident import watched as resident_watched

pytest.importorskip("transformers")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def watched(model: nn.Module, loss_fn, flags: list[bool]):
    """`loss_fn`, noting after each forward whether it started lean."""
    def loss(m: nn.Module, batch) -> torch.Tensor:
        before = model.runtime.lean_forwards
        value = loss_fn(m, batch)
        flags.append(model.runtime.lean_forwards > before)
        return value
    return loss


def streaming(model: nn.Module) -> int:
    """Half the parameter bytes (an eighth of the model data), or the least budget prepare accepts if more."""
    return least_accepted(model, ADAMW, low=param_bytes(model) // 2)


@pytest.mark.parametrize("arch", zoo.available(), ids=[a.name for a in zoo.available()])
def test_a_streaming_architecture_runs_lean_after_its_first_step_on_plain_pytorchs_bits(arch: zoo.Arch) -> None:
    model, batches = arch.build(), arch.batches(4)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, zoo.loss)
    budget = streaming(model)
    for lean in (True, False):
        cm, opt = prepared(model, ADAMW, device_memory=budget)
        cm.runtime.resident_allowed = lean  # off: every forward runs under the mode
        flags: list[bool] = []
        assert train(cm, opt, batches, watched(cm, zoo.loss, flags)) == expected
        assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
        stats = cm.memory_stats()
        assert stats["evictions"] > 0 and stats["resident_steps"] == 0, "chunks must move"
        assert cm.runtime.lean_allowed, "no zoo model uses a parameter outside its module"
        assert flags == [False] + [lean] * 3


# How a model's forward uses its first layer's parameters outside the layer: through an op, or through an attribute
# that views them (an output layer tied to an embedding: `h @ self.embed.weight.T`; those were never fetched, and the
# op that followed got a host tensor under a streaming budget).
BORROWS = {"F.linear": lambda x, w, b: F.linear(x, w, b), ".T": lambda x, w, b: x @ w.T + b,
           ".mT": lambda x, w, b: x @ w.mT + b, ".data": lambda x, w, b: x @ w.data.T + b}


class Borrows(nn.Module):
    """A model whose forward uses its first layer's parameters itself, outside the layer (BORROWS[how])."""

    def __init__(self, how: str = "F.linear") -> None:
        super().__init__()
        self.first, self.rest = nn.Linear(32, 32), mlp()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(torch.tanh(BORROWS[self.how](x, self.first.weight, self.first.bias)))


@pytest.mark.parametrize("how", BORROWS)
def test_a_model_using_a_parameter_outside_its_module_never_runs_lean(how) -> None:
    model, batches = Borrows(how), mlp_batches(5)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, mlp_loss)
    cm, opt = prepared(model, ADAMW, device_memory=streaming(model))
    flags: list[bool] = []
    assert train(cm, opt, batches, watched(cm, mlp_loss, flags)) == expected
    assert not cm.runtime.lean_allowed and flags == [False] * 5
    assert cm.memory_stats()["evictions"] > 0


@pytest.mark.parametrize("lean", [False, True], ids=["resident", "lean"])
def test_out_of_memory_in_a_forward_without_the_mode_runs_it_again_under_it_from_the_same_random_state(
        caplog, lean: bool) -> None:
    model, batches = nn.Sequential(nn.Dropout(0.3), FlakyTanh(), mlp()), mlp_batches(6)
    ref = copy.deepcopy(model)
    torch.manual_seed(5)
    expected = train(ref, ADAMW(ref.parameters()), batches, mlp_loss)
    cm, opt = prepared(model, ADAMW, device_memory=streaming(model) if lean else None)
    flags: list[bool] = []
    loss = (watched if lean else resident_watched)(cm, mlp_loss, flags)
    torch.manual_seed(5)
    losses = train(cm, opt, batches[:2], loss)
    dropped: list[weakref.ref] = []  # the dropout's outputs, of which only the running forward's may be alive at tanh

    def one_alive(*_) -> None:
        assert sum(ref() is not None for ref in dropped) == 1, "the failed forward's activations live on in its rerun"
    cm.module[0].register_forward_hook(lambda _m, _args, out: dropped.append(weakref.ref(out)))
    cm.module[1].register_forward_pre_hook(one_alive)
    cm.module[1].failures = 1  # the forward's dropout has drawn when tanh fails
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        losses += train(cm, opt, batches[2:3], loss)
    assert cm.module[1].failures == 0 and cm.memory_stats()["oom_fallbacks"] == 1
    assert any("out of memory in a forward op" in r.getMessage() for r in caplog.records)
    assert cm.runtime.placer.phase is Phase.RECORD
    losses += train(cm, opt, batches[3:], loss)
    assert losses == expected, "dropout drew the same mask again"
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
    # Without the mode after the first step; the failing forward ended under the mode, not counted lean (lean) nor
    # resident (whose flag is read after the forward); the next step is recorded.
    assert flags == [False, True, False, False, True, True]
    evictions = cm.memory_stats()["evictions"]
    assert evictions > 1 if lean else evictions == 1, "resident, only the chunk the fallback evicted moves"


def test_a_lean_forward_where_the_allocator_is_read_keeps_activations_unmetered(sim_memory) -> None:
    """Where the device reads its allocator (CUDA; the simulation's memory model), a lean forward passes the
    activations autograd saves through no meter (runtime's Note on lean forwards): only the parameters it saves are
    packed, by address, so their chunks may still leave before backward. Plain PyTorch's bits all the same."""
    sim_memory(1024)  # segments of 2 and 20 KiB
    model, batches = tiny_gpt2(), [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
                                   for s in range(4)]
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW, device_memory=streaming(model) + 2**20)  # and room for activations
    assert cm.runtime.device.reads_memory
    kept: list[tuple[int, str]] = []  # (forward, what pack made of a saved tensor)
    pack = cm.runtime.pack

    def noted(tensor: torch.Tensor):
        saved = pack(tensor)
        kept.append((cm.runtime.lean_forwards, type(saved).__name__))
        return saved
    cm.runtime.pack = noted
    flags: list[bool] = []
    assert train(cm, opt, batches, watched(cm, gpt2_loss, flags)) == expected
    # Lean from the first step on the plan: the warm-up no longer falls back (the slots its budget gave back leave the
    # device, where its activations no longer split them: arena.py's Note), so its plan is kept.
    assert flags == [False, True, True, True] and cm.memory_stats()["evictions"] > 0
    assert cm.memory_stats()["oom_fallbacks"] == 0
    first, lean = ({k for n, k in kept if (n > 0) == later} for later in (False, True))
    assert first == {"Saved", "ChunkRef"}, "the warm-up meters activations and packs parameters by address"
    assert lean == {"tuple", "ChunkRef"}, "lean forwards keep activations as they are (and their versions)"
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_a_lean_forward_takes_our_hooks_off_the_modules_inside_units_and_keeps_a_users() -> None:
    # Hooks._idle_hooks: a module inside a unit acquires nothing, so its hooks have nothing to do in a lean forward;
    # without them PyTorch calls it on its short path. A user's hook there still runs, and ours come back after, ours
    # first before the module and last after it.
    model, batches = tiny_gpt2(), [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
                                   for i in range(4)]
    cm, opt = prepared(model, ADAMW, device_memory=2 * param_bytes(model))  # chunks small enough for units
    inner = next(m for m in cm.module.modules() if m in cm.runtime.idle_modules and m._parameters)
    seen: list[tuple[bool, bool]] = []  # per forward of `inner`: lean, our pre-hook on it then
    inner.register_forward_pre_hook(
        lambda m, args: seen.append((cm.hooks.idle_off, cm.hooks._pre_forward in m._forward_pre_hooks.values())))
    flags: list[bool] = []
    ref = copy.deepcopy(model)
    assert train(cm, opt, batches, watched(cm, gpt2_loss, flags)) == train(ref, ADAMW(ref.parameters()), batches,
                                                                           gpt2_loss)
    assert flags == [False, True, True, True] and len(seen) == 4
    assert seen == [(lean, not lean) for lean in flags], "off exactly in the lean forwards"
    pre, post = list(inner._forward_pre_hooks.values()), list(inner._forward_hooks.values())
    assert pre[0] == cm.hooks._pre_forward and len(pre) == 2 and post == [cm.hooks._post_forward]
    cm.hooks.remove()  # the handles still take ours off
    assert list(inner._forward_pre_hooks.values()) == pre[1:] and not inner._forward_hooks
