"""Resident steps (runtime's Note on them): when the whole model fits, steps after the warm-up run without the
torch-function mode or the module hooks' work, on plain PyTorch's bits, and fall back to the full path when
the inputs change shape or activations outgrow the plan (a forward out of memory: tests/runtime/test_lean.py)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.chunks.placement import Phase
from tests import zoo
from tests.helpers import (gpt2_loss, grad_hooks, mlp, mlp_batches, mlp_loss, module_hooks, prepared, tiny_gpt2,
                           train)
from tests.test_zoo import plain_bf16

pytest.importorskip("transformers")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
ARCHS = zoo.available() + zoo.DATA_DEPENDENT


def watched(model: nn.Module, loss_fn, flags: list[bool], hooked: list[bool] | None = None):
    """`loss_fn`, noting after each forward whether it ran resident (and in `hooked`, whether the modules' forward
    hooks are on for the backward and what follows)."""
    def loss(m: nn.Module, batch) -> torch.Tensor:
        value = loss_fn(m, batch)
        flags.append(model.runtime.placer.resident)
        if hooked is not None:
            hooked.append(module_hooks(model) > 0 and grad_hooks(model) > 0)
        return value
    return loss


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_a_fitting_architecture_steps_resident_on_plain_pytorchs_bits(arch: zoo.Arch) -> None:
    model, batches = arch.build(), arch.batches(4)
    ref = copy.deepcopy(model)
    torch.manual_seed(3)  # layers dropped at random draw the same
    expected = train(ref, ADAMW(ref.parameters()), batches, zoo.loss)
    peaks = []
    for resident in (True, False):
        cm, opt = prepared(model, ADAMW)
        cm.runtime.resident_allowed = resident  # off: every step takes the full path
        flags: list[bool] = []
        torch.manual_seed(3)
        assert train(cm, opt, batches, watched(cm, zoo.loss, flags)) == expected
        assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
        assert flags == [False] + [resident] * 3, "resident after the warm-up, unless told not to be"
        assert cm.memory_stats()["resident_steps"] == 3 * resident
        peaks.append(cm.memory_stats()["device_bytes_peak"])
    assert peaks[0] == peaks[1], "the device peak is measured the same way"


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "resnet"])
def test_bf16_steps_resident_unless_batchnorm_needs_the_modes_cast(name: str) -> None:
    arch = zoo.by_name(name)
    model, batches = arch.build(), arch.batches(4)
    cm, opt = prepared(model, ADAMW, dtype="bf16")
    flags: list[bool] = []
    assert train(cm, opt, batches, watched(cm, zoo.loss, flags)) == plain_bf16(copy.deepcopy(model), batches)
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert cm.runtime.resident_allowed != batchnorm
    assert flags == [False] + [not batchnorm] * 3


def test_inputs_of_a_new_shape_run_under_the_mode_once_then_resident() -> None:
    model = tiny_gpt2()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, seq), generator=gen) for seq in (16, 16, 16, 24, 24, 16, 24)]
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW)
    flags: list[bool] = []
    hooked: list[bool] = []
    assert train(cm, opt, batches, watched(cm, gpt2_loss, flags, hooked)) == expected
    assert flags == [False, True, True, False, True, True, True]
    assert cm.runtime.placer.replans == 0, "the new shape ran the plan's accesses"
    # A resident forward takes the modules' forward hooks and the parameters' gradient hooks off (PyTorch's short
    # call path); one that is not puts them back, every one of them.
    assert hooked == [not resident for resident in flags]
    assert module_hooks(cm) == grad_hooks(cm) == 0
    cm(batches[0][:, :8])
    assert module_hooks(cm) == 2 * len(list(model.modules()))
    assert grad_hooks(cm) == len(list(model.parameters()))


def test_a_resident_backward_leaves_each_gradient_as_autograd_made_it_and_its_chunk_holds_it() -> None:
    """Its gradient hooks off, a resident backward takes the gradients into their chunks when it ends (lent: the
    tensor autograd made is the chunk's range and `p.grad`): accumulation over micro-batches and clipping by the
    global norm as in plain PyTorch, bit for bit."""
    model, batches = tiny_gpt2(), [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
                                   for s in range(8)]
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches[:6], gpt2_loss, accumulate=2, clip=0.5)
    cm, opt = prepared(model, ADAMW)
    flags: list[bool] = []
    assert train(cm, opt, batches[:6], watched(cm, gpt2_loss, flags), accumulate=2, clip=0.5) == expected
    assert flags == [False, False, True, True, True, True], "the warm-up's two backwards, then resident"
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
    for one in (ref, cm):
        gpt2_loss(one, batches[6]).backward()
    assert grad_hooks(cm) == 0
    for (name, param), mine in zip(ref.named_parameters(), cm.module.parameters()):
        record = cm.runtime.store.records[mine]
        assert torch.equal(mine.grad, param.grad), name
        assert cm.runtime.data.grad_views([record])[0].data_ptr() == mine.grad.data_ptr(), "lent to its chunk"


@pytest.mark.parametrize("when", ["before", "after", "alone"])
def test_a_backward_that_misses_the_outputs_in_a_resident_step_reaches_the_step(when: str) -> None:
    """A backward of a penalty on parameters alone never reaches the model's outputs, whose backward's end takes the
    gradients of a resident step: they wait in `p.grad`, where the next backward adds to them, until a step (or
    clipping, or zero_grad) reads the gradients. Before the loss's backward, after it, or instead of it."""
    model, batches = tiny_gpt2(), [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
                                   for s in range(4)]

    def step(one: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
        loss = gpt2_loss(one, batch)
        penalty = sum(p.float().square().sum() for p in list(one.parameters())[-3:])
        if when == "before":
            penalty.backward()
        if when != "alone":
            loss.backward()
        if when != "before":
            penalty.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    ref = copy.deepcopy(model)
    ref_opt = ADAMW(ref.parameters())
    cm, opt = prepared(model, ADAMW)
    assert [step(cm, opt, b) for b in batches] == [step(ref, ref_opt, b) for b in batches]
    assert cm.memory_stats()["resident_steps"] == 3
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_with_its_hooks_off_between_resident_steps_a_model_is_still_known_and_its_modules_still_compute() -> None:
    model, batches = tiny_gpt2(), [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
                                   for s in range(3)]
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW)
    assert train(cm, opt, batches, gpt2_loss) == expected
    assert cm.memory_stats()["resident_steps"] == 2 and module_hooks(cm) == 0, "the steps after the warm-up resident"
    # A module without parameters (no gradient hook tells that it is managed) inside another model.
    other = nn.Sequential(nn.Linear(4, 4), cm.module.transformer.h[0].mlp.act)
    with pytest.raises(ValueError, match=r"module 1 of this model is already managed by an earlier chunkmem.prepare"):
        chunkmem.prepare(other, ADAMW(other.parameters()), chunkmem.Config(device="cpu"))
    hidden = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # a module called on its own: every parameter is on the device
        assert torch.equal(cm.module.transformer.h[1](hidden)[0], ref.transformer.h[1](hidden)[0])


class Deepens(nn.Module):
    """tanh applied `times` times: activations that depend on the module's state, not the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.times = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = torch.tanh(x)
        return x


def test_activations_that_outgrow_the_plan_end_the_resident_step_and_the_next_is_recorded() -> None:
    model, batches = nn.Sequential(mlp(), Deepens()), mlp_batches(6)
    probe, _ = prepared(model, ADAMW)
    train(probe, _, batches[:1], mlp_loss)
    stats = probe.memory_stats()
    budget = stats["model_data_bytes"] + 2 * probe.runtime.activations.peak  # everything fits, with room to spare
    ref = copy.deepcopy(model)
    ref_opt = ADAMW(ref.parameters())
    cm, opt = prepared(model, ADAMW, device_memory=budget)
    flags: list[bool] = []
    loss = watched(cm, mlp_loss, flags)
    losses = train(cm, opt, batches[:3], loss)
    expected = train(ref, ref_opt, batches[:3], mlp_loss)
    assert flags == [False, True, True]
    cm.module[1].times = ref[1].times = 400  # 400 saved outputs: far beyond the plan's record and its margin
    losses += train(cm, opt, batches[3:4], loss)
    expected += train(ref, ref_opt, batches[3:4], mlp_loss)
    assert flags[3] is False and cm.runtime.placer.phase is Phase.RECORD
    assert module_hooks(cm) > 0, "the step gave way: its backward and what follows take the full path"
    assert cm.memory_stats()["evictions"] > 0, "chunks gave way to the activations"
    cm.module[1].times = ref[1].times = 1
    losses += train(cm, opt, batches[4:], loss)
    expected += train(ref, ref_opt, batches[4:], mlp_loss)
    assert losses == expected
    assert flags[4:] == [False, True], "recorded, then resident again"


def test_a_resident_step_waits_for_uploads_still_landing() -> None:
    model, batches = mlp(), mlp_batches(4)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, mlp_loss)
    cm, opt = prepared(model, ADAMW)
    flags: list[bool] = []
    loss = watched(cm, mlp_loss, flags)
    losses = train(cm, opt, batches[:2], loss)
    residency = cm.runtime.residency
    for chunk in [c for c in cm.runtime.store.chunks() if c.state.on_device]:
        residency.evict(chunk)
        residency.bring(chunk, "prefetch")  # its upload in flight: parameters are read without a fence
    losses += train(cm, opt, batches[2:], loss)
    assert flags == [False, True, True, True]
    assert losses == expected


def test_a_resident_step_where_the_allocator_is_read_saves_tensors_without_the_hooks(sim_memory) -> None:
    """Where the device reads its allocator (CUDA; the simulation's memory model), a resident forward installs no
    saved-tensor hooks (runtime's Note on resident steps): autograd keeps the parameters it saves, and the step
    is still plain PyTorch's, bit for bit."""
    sim_memory(64)
    model, batches = tiny_gpt2(), [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
                                   for s in range(4)]
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW)
    assert cm.runtime.device.reads_memory
    packed: list[bool] = []
    pack = cm.runtime.pack
    cm.runtime.pack = lambda tensor: packed.append(cm.runtime.placer.resident) or pack(tensor)
    flags: list[bool] = []
    assert train(cm, opt, batches, watched(cm, gpt2_loss, flags)) == expected
    assert flags == [False, True, True, True]
    assert packed and not any(packed), "the warm-up's forward packs its saved tensors, resident ones none"
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
