"""What a training loop's own code does with parameters and gradients between chunkmem's calls: the same loop on
the plain model and on a prepared one gives the same bits (fp32), whether chunks stay or stream."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.runtime import grads

from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, prepared, tiny_gemma3n, tiny_gpt2, train

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
BUDGETS = [None, 0.3, 1.5]  # of the parameter bytes: all on the device, streaming, streaming with some kept
STEPS = 4
Loop = Callable[[nn.Module, torch.optim.Optimizer], None]


def same_bits(loop: Loop, budget: float | None, model: nn.Module | None = None) -> None:
    model = model or tiny_gpt2()
    plain = copy.deepcopy(model)
    loop(plain, ADAMW(plain.parameters()))
    cm, opt = prepared(model, ADAMW, device_memory=None if budget is None else int(param_bytes(model) * budget))
    loop(cm, opt)
    want, got = plain.state_dict(), cm.state_dict()
    differ = [k for k, v in want.items() if not torch.equal(v, got[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ, {differ[0]} first"


def same_regression_bits(budget: float | None, model: nn.Module) -> None:
    """`same_bits` for a model from 8 inputs to 4 outputs, trained on a mean squared error."""
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(STEPS)]

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for x, y in batches:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    same_bits(loop, budget, model)


def gpt2_budget(budget: float | None) -> int | None:
    return None if budget is None else int(param_bytes(tiny_gpt2()) * budget)


def steps(after: Callable[[nn.Module, torch.optim.Optimizer], None]) -> Loop:
    """A loop whose step ends with `after` (instead of optimizer.zero_grad, where it zeroes)."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids in gpt2_batches(STEPS):
            gpt2_loss(model, ids).backward()
            opt.step()
            after(model, opt)
    return loop


def unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@pytest.mark.parametrize("budget", BUDGETS)
def test_gradients_assigned_by_hand_are_stepped(budget) -> None:
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids in gpt2_batches(2):
            params = list(model.parameters())
            for param, grad in zip(params, torch.autograd.grad(gpt2_loss(model, ids), params)):
                param.grad = grad  # no backward: chunkmem never saw these
            opt.step()
            opt.zero_grad()

    same_bits(loop, budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_gradients_given_other_storage_through_p_grad_data_are_stepped(budget) -> None:
    """`p.grad.data = t` (older code's clipping) keeps the `p.grad` object and changes its storage: chunkmem, which
    found a replaced gradient by the object, stepped the chunk's old values wherever chunks moved (bug hunt)."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids in gpt2_batches(3):
            gpt2_loss(model, ids).backward()
            for param in model.parameters():
                param.grad.data = param.grad.data.clamp(-1e-3, 1e-3)
            opt.step()
            opt.zero_grad()

    same_bits(loop, budget)


def set_none(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for param in model.parameters():
        param.grad = None  # the fast zero_grad of PyTorch's performance guide


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("zero", [set_none, lambda model, opt: unwrapped(model).zero_grad()],
                         ids=["p.grad = None", "module.zero_grad()"])
def test_gradients_cleared_by_hand_are_not_added_to_the_next_ones(budget, zero) -> None:
    same_bits(steps(zero), budget)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("before_backward", [False, True], ids=["after the step", "between forward and backward"])
def test_gradients_zeroed_but_kept_read_as_zeros_and_take_what_is_added(budget, before_backward) -> None:
    shown: list[list[torch.Tensor | None]] = []  # what p.grad reads after each zero_grad, run by run

    def zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad(set_to_none=False)
        shown[-1].extend(None if p.grad is None else p.grad.clone() for p in model.parameters())
        for param in model.parameters():  # an L2 term added by hand, into the zeros
            if param.grad is not None:
                param.grad.add_(param.detach(), alpha=1e-2)

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        shown.append([])
        for ids in gpt2_batches(STEPS):
            loss = gpt2_loss(model, ids)
            if before_backward:
                zero(model, opt)
            loss.backward()
            opt.step()
            if not before_backward:
                zero(model, opt)

    same_bits(loop, budget)
    want, got = shown
    assert [g is None for g in got] == [g is None for g in want]
    assert all(g is None or torch.equal(g, w) for g, w in zip(got, want))
    assert any(g is not None for g in want)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_of_either_kind(budget, reentrant) -> None:
    # Reentrant checkpointing re-computes with no saved-tensor hooks, inside the model's backward: the parameters it
    # saves must still come back to the device when its own backward reads them.
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        unwrapped(model).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        steps(lambda model, opt: opt.zero_grad())(model, opt)

    # The non-reentrant kind's re-computation saves views of a layer's 4 chunks, which stay until its backward is done
    # (hooks' Note on re-computation): 30% of the parameter bytes holds 3.
    same_bits(loop, 0.4 if budget == 0.3 and not reentrant else budget)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("zero", ["accumulate", "set_to_none=False"])
def test_reentrant_checkpointing_with_gradients_kept_from_before(budget, zero) -> None:
    # Reentrant checkpointing runs a backward of its own per segment, nested in the model's: its end showed the
    # gradients so far in p.grad, and the next segment's backward added into them (a streamed group's, on the host:
    # a device mismatch; Hugging Face's gradient checkpointing was reentrant by default).
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        unwrapped(model).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        for i, ids in enumerate(gpt2_batches(STEPS)):
            gpt2_loss(model, ids).backward()
            if zero == "set_to_none=False":
                opt.step()
                opt.zero_grad(set_to_none=False)
            elif i % 2:
                opt.step()
                opt.zero_grad()

    same_bits(loop, budget)


class SharedCheckpointed(nn.Module):
    """One layer at every depth, each call checkpointed apart, reentrant (ALBERT's shared layers; DeBERTa's relative
    embeddings, handed to every layer): each segment's inner backward gives the layer's parameters a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 4)
        self.shared = nn.Sequential(nn.Linear(32, 32), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        for _ in range(4):
            hidden = torch.utils.checkpoint.checkpoint(self.shared, hidden, use_reentrant=True)
        return self.out(hidden)


CHECKPOINTED = ["accumulated", "a retained graph's second backward", "a hook replacing p.grad",
                "a hook scaling p.grad in place"]


def checkpointed_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(8)]


@pytest.mark.parametrize("budget", [None, 2.0])
@pytest.mark.parametrize("how", CHECKPOINTED)
def test_a_layer_checkpointed_at_every_depth_adds_its_gradients_as_plain_pytorch(budget, how) -> None:
    # A resident backward summed the segments' gradients of the shared layer apart, then added the sum into the chunk
    # once, where plain PyTorch adds each into p.grad in turn: 3e-8 apart after 4 steps (helper-84, on DeBERTa). A
    # user's hook that replaced p.grad between them had the chunk's sum added to it again (0.045; helper-89).
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        def halve(param: torch.Tensor) -> None:
            if how == "a hook replacing p.grad":
                param.grad = param.grad * 0.5
            else:
                param.grad.mul_(0.5)

        if "hook" in how:
            for param in unwrapped(model).parameters():
                param.register_post_accumulate_grad_hook(halve)
        for i, (x, y) in enumerate(checkpointed_batches()):
            loss = nn.functional.mse_loss(model(x), y)
            again = how == "a retained graph's second backward"
            loss.backward(retain_graph=again)
            if again:
                (loss * 0.5).backward()
            if i % 2:
                opt.step()
                opt.zero_grad()
    same_bits(loop, budget, SharedCheckpointed())


def test_two_models_of_a_manager_with_layers_checkpointed_at_every_depth_train_as_plain_pytorch() -> None:
    # Each model's forward kept its own gradients shown, and the backward of their joint loss added the first model's
    # segments' gradients apart (3e-8 after 4 steps; helper-89).
    models = [SharedCheckpointed(), SharedCheckpointed()]
    plain = copy.deepcopy(models)
    manager = chunkmem.Manager(chunkmem.Config(device="cpu"))
    prepared_ = [manager.prepare(model, ADAMW(model.parameters())) for model in models]
    for pair in ([(m, ADAMW(m.parameters())) for m in plain], prepared_):
        for i, (x, y) in enumerate(checkpointed_batches()):
            nn.functional.mse_loss(pair[0][0](x) + pair[1][0](x), y).backward()
            if i % 2:
                for _, opt in pair:
                    opt.step()
                    opt.zero_grad()
    for want, (got, _) in zip(plain, prepared_):
        assert all(torch.equal(v, got.state_dict()[k]) for k, v in want.state_dict().items())


@pytest.mark.parametrize("budget", [None, 0.5])
def test_a_module_cast_to_fp32_in_forward_keeps_its_fp32_master_weights(budget) -> None:
    # SwitchTransformers' router casts its classifier to fp32 in every forward: each weight's storage is replaced by
    # its bf16 value widened. That was taken as a value the user gave, and with no budget the master weight became
    # its own bf16 rounding (with lr=0 nothing may change).
    from tests import zoo

    arch = next(a for a in zoo.DATA_DEPENDENT if a.name == "switch")
    model, batch = arch.build(), arch.batches(1)[0]
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cm, opt = prepared(model, functools.partial(torch.optim.AdamW, lr=0.0, weight_decay=0.0), dtype="bf16",
                       device_memory=None if budget is None else int(param_bytes(model) * budget))
    for _ in range(2):
        zoo.loss(cm, batch).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(v, initial[k]) for k, v in cm.state_dict().items())


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def test_an_evaluation_after_each_step_runs_at_the_budget_training_runs_at() -> None:
    # The evaluation's forward is off the plan; it fetched under the budget of the step's last access (a
    # quarter of this one), and its first module of two chunks failed with MemoryBudgetError.
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(3, 128, (4, 32), generator=gen), torch.randint(0, 3, (4,), generator=gen))
               for _ in range(3)]
    evaluated: list[torch.Tensor] = []

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids, labels in batches:
            model.train()
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                evaluated.append(model(input_ids=batches[0][0]).logits)

    same_bits(loop, 60000 / param_bytes(tiny_bert()), tiny_bert())
    half = len(evaluated) // 2
    assert all(torch.equal(a, b) for a, b in zip(evaluated[:half], evaluated[half:]))


@pytest.mark.parametrize("budget", [*BUDGETS, 3.0])
def test_an_evaluation_under_inference_mode_between_steps_leaves_training_as_plain_pytorchs(budget) -> None:
    # Chunks uploaded and parameters pointed at them in an inference-mode forward were inference tensors, which the
    # next training forward could not save for backward where chunks stayed (1.5 and 3 times the parameter bytes).
    evaluated: list[torch.Tensor] = []

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids in gpt2_batches(STEPS):
            gpt2_loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
            with torch.inference_mode():
                evaluated.append(gpt2_loss(model, gpt2_batches(1, seed=3)[0]))

    same_bits(loop, budget)
    half = len(evaluated) // 2
    assert all(torch.equal(a, b) for a, b in zip(evaluated[:half], evaluated[half:]))


def test_the_optimizer_given_to_prepare_refuses_to_step_and_a_scheduler_made_on_it_before_prepare_works() -> None:
    # Stepped, it updated the parameters where the chunks lend them, with states of its own, and nothing said so.
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    plain_opt = ADAMW(plain.parameters())
    original = ADAMW(model.parameters())
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (plain_opt, original)]
    cm, opt = chunkmem.prepare(model, original, chunkmem.Config(device="cpu", device_memory=param_bytes(model) // 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids in gpt2_batches(STEPS):
            for net, optimizer, schedule in zip((plain, cm), (plain_opt, opt), schedules):
                gpt2_loss(net, ids).backward()
                optimizer.step()
                optimizer.zero_grad()
                schedule.step()
    assert not [w for w in caught if "before `optimizer.step()`" in str(w.message)]
    assert not [w for w in caught if "has been overridden after" in str(w.message)]  # its mark is kept
    assert opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"] < 1e-2 / 2**(STEPS - 1)
    want, got = plain.state_dict(), cm.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in want.items())
    gpt2_loss(cm, gpt2_batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"call step\(\) on that one"):
        original.step()
    assert all(torch.equal(v, cm.state_dict()[k]) for k, v in got.items())
    # The prepared optimizer's load_state_dict: torch's gave the user's optimizer groups of its own.
    with pytest.raises(ValueError, match="0 parameter groups, this optimizer 1"):
        original.load_state_dict({"state": {}, "param_groups": []})
    later = torch.optim.lr_scheduler.StepLR(original, 1, gamma=0.5)  # an AttributeError ('__func__')
    opt.step()
    later.step()
    assert opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"] / 2


def test_step_hooks_and_a_scheduler_made_before_prepare_follow_the_prepared_optimizer() -> None:
    # The hooks registered on the user's optimizer never ran (a weight constraint after each step was dropped), and a
    # group added to the prepared optimizer was not the scheduler's (its lr stayed where it started).
    def loop(model: nn.Module, make: Callable[[nn.Module, torch.optim.Optimizer], tuple[nn.Module, Any]]) -> dict:
        calls = []
        optimizer = torch.optim.AdamW(model.transformer.h.parameters(), lr=1e-2)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: [p.data.clamp_(-0.05, 0.05)
                                                                     for p in opt.param_groups[0]["params"]])
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        net, opt = make(model, optimizer)
        rest = [p for n, p in model.named_parameters() if not n.startswith("transformer.h.")]
        optimizer.add_param_group({"params": rest, "lr": 1e-3})  # the user's: the prepared one's too
        for ids in gpt2_batches(STEPS):
            gpt2_loss(net, ids).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
        return {"state": net.state_dict(), "lrs": [g["lr"] for g in opt.param_groups], "calls": calls}

    budget = param_bytes(tiny_gpt2()) // 3
    plain = loop(tiny_gpt2(), lambda m, o: (m, o))
    ours = loop(tiny_gpt2(), lambda m, o: chunkmem.prepare(m, o, chunkmem.Config(device="cpu", device_memory=budget)))
    assert ours["calls"] == plain["calls"] == ["pre"] * STEPS
    assert ours["lrs"] == plain["lrs"] == [1e-2 / 2**STEPS, 1e-3 / 2**STEPS]
    assert all(torch.equal(v, ours["state"][k]) for k, v in plain["state"].items())


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_users_post_accumulate_grad_hook_sees_and_scales_each_gradient(budget) -> None:
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        seen = []

        def halve(param: torch.Tensor) -> None:
            seen.append(param.grad is not None)
            if param.grad is not None:
                param.grad.mul_(0.5)

        for param in unwrapped(model).parameters():
            param.register_post_accumulate_grad_hook(halve)
        steps(lambda model, opt: opt.zero_grad())(model, opt)
        assert seen and all(seen), f"{seen.count(False)} of {len(seen)} calls saw p.grad None"

    same_bits(loop, budget)


LATE = {"before training": (0, 0, False), "after a step": (1, 0, False),  # registered at (step, micro-batch, after
        "between a forward and its backward": (1, 1, True)}                # its forward)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("hook", ["halves", "drops the second"])
@pytest.mark.parametrize("late", LATE)
def test_under_accumulation_a_users_post_accumulate_grad_hook_sees_the_sum_so_far(budget, hook, late) -> None:
    """Autograd calls the hook once the fresh gradient is added into `p.grad`: a second micro-batch's hook sees the
    sum of both, and scales it or sets it to None, which leaves the parameter no gradient (Runtime.sum_for_users).
    Before, it saw the second micro-batch's gradient alone. `late`: registered after the first step, once a model
    with no budget runs resident steps (gradient hooks of chunkmem's off), or between a forward and its backward,
    where it saw None (ours ran first: Runtime.backward_begins puts them last)."""
    at_step, at_micro, after_forward = LATE[late]
    seen: dict[str, list[float]] = {}

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        sums = seen.setdefault("plain" if model is unwrapped(model) else "chunkmem", [])
        micro = 0

        def halve(param: torch.Tensor) -> None:
            sums.append(param.grad.double().sum().item())
            if hook == "halves":
                param.grad.mul_(0.5)
            elif micro == 1 and len(sums) % 2:  # half the parameters, the sum of both micro-batches shown
                param.grad = None

        def hook_all() -> None:
            for param in unwrapped(model).parameters():
                param.register_post_accumulate_grad_hook(halve)

        for step, ids in enumerate(gpt2_batches(STEPS)):
            for micro, half in enumerate(ids.chunk(2)):
                now = (step, micro) == (at_step, at_micro)
                if now and not after_forward:
                    hook_all()
                loss = gpt2_loss(model, half)
                if now and after_forward:
                    hook_all()
                loss.backward()
            opt.step()
            opt.zero_grad()

    same_bits(loop, budget)
    assert seen["chunkmem"] == seen["plain"]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mixed_precision_loop_of_autocast_and_grad_scaler_trains_as_on_the_plain_model(budget, dtype) -> None:
    # A loop written for plain PyTorch's mixed precision, kept as it is on an fp32 prepared model: autocast around
    # the forward; in fp16 a GradScaler that scales the loss, unscales the gradients for clipping, then steps unless
    # they overflowed (the first step does, of a loss scaled by 2**18; the others step).
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, enabled=dtype == torch.float16)
        skipped = 0
        for ids in gpt2_batches(STEPS):
            with torch.autocast("cpu", dtype=dtype):
                loss = gpt2_loss(model, ids)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
            opt.zero_grad()
        assert skipped == (dtype == torch.float16)

    same_bits(loop, budget)


@pytest.mark.parametrize("through", ["p", "p.data"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_parameters_changed_in_place_after_a_step_keep_the_change(budget, through) -> None:
    """Through `p.data` (hand-made weight decay, WGAN's clip), which has a version counter of its own in PyTorch, the
    change was lost where the chunk was on the device (at 1.5: every step after the first trained from the old
    values). chunks/store.py's Note on writes through `p.data`."""
    def constrain(model: nn.Module, opt: torch.optim.Optimizer) -> None:  # a weight constraint, then an evaluation
        opt.zero_grad()
        with torch.no_grad():
            for param in model.parameters():
                (param.data if through == "p.data" else param).mul_(0.9)
            gpt2_loss(model, gpt2_batches(1, seed=3)[0])
            for param in model.parameters():  # written again, the evaluation's uploads of them in flight
                (param.data if through == "p.data" else param).mul_(1.1)

    same_bits(steps(constrain), budget)


@pytest.mark.parametrize("budget", BUDGETS)
def test_parameters_changed_in_place_after_backward_are_what_state_dict_and_a_deep_copy_read(budget) -> None:
    """A step made by hand after backward (`p.sub_(lr * p.grad)`), read before the next forward: the parameters of a
    streamed group view their host payload then, beside a clean device copy, and state_dict(), a deep copy and a
    checkpoint read that copy, the values before the change (fp32 at 0.3 and 1.5). grads.py's `drop_copies`."""
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    cm, _ = prepared(model, ADAMW, device_memory=gpt2_budget(budget))
    for net in (plain, cm):
        gpt2_loss(net, gpt2_batches(1)[0]).backward()
        with torch.no_grad():
            for param in net.parameters():
                param.sub_(0.1 * param.grad)
    want = plain.state_dict()
    for got in (cm.state_dict(), copy.deepcopy(cm).state_dict()):
        differ = [k for k, v in want.items() if not torch.equal(v, got[k])]
        assert not differ, f"{len(differ)} of {len(want)} tensors differ, {differ[0]} first"


@pytest.mark.parametrize("budget", [0.3, 1.5])
def test_a_load_between_backward_and_the_next_forward_is_what_the_parameters_show(budget) -> None:
    """load_state_dict after backward wrote a streamed group's device copy, its parameters viewing the host payload:
    they read the values from before the load until the next forward, and a change made in place then was lost
    (grads.py's `drop_copies`)."""
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    cm, _ = prepared(model, ADAMW, device_memory=gpt2_budget(budget))
    loaded = {k: v + 1.0 if v.is_floating_point() else v for k, v in plain.state_dict().items()}
    for net in (plain, cm):
        gpt2_loss(net, gpt2_batches(1)[0]).backward()
        net.load_state_dict(loaded)
    shown = dict(plain.named_parameters())
    assert all(torch.equal(p.detach(), shown[n.removeprefix("module.")]) for n, p in cm.named_parameters())
    with torch.no_grad():
        for net in (plain, cm):
            for param in net.parameters():
                param.mul_(0.5)
    want, got = plain.state_dict(), cm.state_dict()
    assert all(torch.equal(v, got[k]) for k, v in want.items())


def test_accumulating_a_loss_on_a_captured_activation_after_a_forward_clips_as_plain_pytorch() -> None:
    """Two micro-batches, the second's loss on an activation a forward hook caught (its backward never reaches the
    model's outputs), then torch's clip_grad_norm_: where the model fits, the second forward hid the first's gradients
    and nothing showed them again, so the norm was of the second's alone (0.0078 against 4.1: helper-80)."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        caught = {}
        unwrapped(model).transformer.h[1].register_forward_hook(lambda _m, _a, out: caught.__setitem__("h", out))
        for first, second in zip(*[iter(gpt2_batches(2 * STEPS))] * 2):
            gpt2_loss(model, first).backward()
            model(second)
            hidden = caught["h"][0] if isinstance(caught["h"], tuple) else caught["h"]
            hidden.pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
            opt.step()
            opt.zero_grad()

    same_bits(loop, None)


@pytest.mark.parametrize("clear", ["p.grad = None", "the module's zero_grad", "another optimizer's zero_grad"])
def test_gradients_cleared_by_hand_between_a_forward_and_its_backward_are_cleared_where_the_model_fits(clear) -> None:
    """After a forward, `p.grad` was None (hidden so that the backward adds into the chunk), so a clear made then
    changed nothing chunkmem could see, and the backward added into the last step's gradients. Where gradients are on
    the device with their parameters they stay shown until the backward begins (grads.py's `kept_through_forward`);
    a streamed group's are still hidden at the forward (the README's "not yet")."""
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        other = torch.optim.SGD(model.parameters(), lr=0.0)
        for ids in gpt2_batches(STEPS):
            loss = gpt2_loss(model, ids)
            if clear == "p.grad = None":
                for param in model.parameters():
                    param.grad = None
            else:
                (unwrapped(model) if clear == "the module's zero_grad" else other).zero_grad()
            loss.backward()
            opt.step()

    same_bits(loop, None)


@pytest.mark.parametrize("through", ["p", "p.data", "p.data, default device set"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("budget", [None, 0.3])
def test_in_low_precision_parameters_changed_in_place_keep_the_change(budget, dtype, through) -> None:
    # The fp32 master weights are what the step updates and state_dict() reads: a weight clipped in place (WGAN), or EMA
    # weights copied in before a save, was overwritten from the master at the next step and missing from state_dict().
    # Through `p.data` at every budget, until its version counter was the parameter's; and then still under a
    # torch-function mode of the user's (torch.set_default_device keeps one on, as `with torch.device` does here).
    cm, opt = prepared(tiny_gpt2(), functools.partial(torch.optim.SGD, lr=1e-6), dtype=dtype,
                       device_memory=gpt2_budget(budget))
    with torch.device("cpu") if "default device" in through else contextlib.nullcontext():
        _clamped_then_filled(cm, opt, through.startswith("p.data"))


def _clamped_then_filled(cm: nn.Module, opt: torch.optim.Optimizer, data: bool) -> None:
    for ids in gpt2_batches(2):
        gpt2_loss(cm, ids).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for param in cm.parameters():
                (param.data if data else param).clamp_(-0.01, 0.01)
        assert all(v.abs().max() <= 0.0101 for k, v in cm.state_dict().items() if "attn.bias" not in k)  # 0.01, rounded
    with torch.no_grad():
        for param in cm.parameters():
            (param.data if data else param).fill_(0.5)  # EMA weights swapped in, then saved
    assert all(torch.all(v == 0.5) for k, v in cm.state_dict().items() if "attn.bias" not in k)


@pytest.mark.parametrize("budget", [None, 0.3])
def test_prepare_and_loads_under_inference_mode_train_as_plain_pytorch(budget) -> None:
    # A setup helper or an evaluation script under torch.inference_mode: prepare made inference tensors of the chunks
    # and views (GPT-2's prepare raised "Inference tensors do not track version counter"; an MLP's first step raised),
    # and load_state_dict and load_checkpoint raised that too, where PyTorch's train and load.
    model, plain, batches = tiny_gpt2(), tiny_gpt2(), gpt2_batches(STEPS)
    plain_opt = ADAMW(plain.parameters())
    with torch.inference_mode():
        cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()),
                                   chunkmem.Config(device="cpu", device_memory=gpt2_budget(budget)))
    for net, optimizer in ((plain, plain_opt), (cm, opt)):
        train(net, optimizer, batches[:2], gpt2_loss)
    saved = copy.deepcopy(plain.state_dict()), copy.deepcopy(plain_opt.state_dict())
    for net, optimizer in ((plain, plain_opt), (cm, opt)):
        train(net, optimizer, batches[2:], gpt2_loss)  # a step taken, then undone by the loads
    for net, optimizer in ((plain, plain_opt), (cm, opt)):  # (plain's optimizer adopts the saved tensors themselves)
        with torch.inference_mode():
            net.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
    for net, optimizer in ((plain, plain_opt), (cm, opt)):
        train(net, optimizer, batches[2:], gpt2_loss)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in cm.state_dict().items())


class _LoadsInPlace(nn.Linear):
    """Its own loading writes its weight in place, counting on the caller's torch.no_grad."""

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        self.weight.copy_(state_dict[prefix + "weight"])
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_load_keeps_the_callers_grad_mode(mode) -> None:
    # Leaving inference mode around a load (above) turned gradients on under a caller's torch.no_grad too, and a module
    # whose own loading writes a parameter in place raised where PyTorch loads.
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(_LoadsInPlace(8, 8), nn.Linear(8, 2))

    plain, model = build(), build()
    values = {k: v + 1 for k, v in plain.state_dict().items()}
    cm, _ = prepared(model, ADAMW)
    for net in (plain, cm):
        with getattr(torch, mode)():
            net.load_state_dict(values)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in cm.state_dict().items())


def test_load_checkpoint_under_inference_mode_restores_what_was_saved(tmp_path) -> None:
    cm, opt = prepared(tiny_gpt2(), ADAMW, device_memory=gpt2_budget(0.3))
    gpt2_loss(cm, gpt2_batches(1)[0]).backward()
    opt.step()
    chunkmem.save_checkpoint(tmp_path / "ckpt", cm, opt)
    expected = copy.deepcopy(cm.state_dict())
    gpt2_loss(cm, gpt2_batches(1)[0]).backward()
    opt.step()
    with torch.inference_mode():
        chunkmem.load_checkpoint(tmp_path / "ckpt", cm, opt)
    assert all(torch.equal(v, expected[k]) for k, v in cm.state_dict().items())


@pytest.mark.parametrize("budget", [None, 0.3])
def test_a_default_device_set_elsewhere_leaves_chunkmems_host_memory_on_the_host(budget) -> None:
    # torch.set_default_device("cuda") before a run sends every allocation that names no device to the GPU: chunkmem's
    # pinned pool, its step counters and its host kernels' buffers went there. The meta device stands for it here,
    # where an allocation that lands on it fails the first time its bytes are read.
    model, plain, batches = tiny_gpt2(), tiny_gpt2(), gpt2_batches(STEPS)
    expected = train(plain, ADAMW(plain.parameters()), batches, gpt2_loss)
    torch.set_default_device("meta")
    try:
        cm, opt = prepared(model, ADAMW, device_memory=gpt2_budget(budget))
        got = train(cm, opt, batches, gpt2_loss)
        state = cm.state_dict()
    finally:
        torch.set_default_device(None)
    assert got == expected
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("budget", [None, 0.3])
def test_in_low_precision_a_model_built_on_the_meta_device_keeps_fp32_masters(budget) -> None:
    # Its parameters took their chunk views by a swap that shared the chunk's version counter, which chunkmem's own
    # writes into the chunk move: every step read as a change made in place, and rounded the masters to bf16.
    real = tiny_gpt2()
    with torch.device("meta"):
        model = tiny_gpt2()
    runs = []
    for built in (copy.deepcopy(real), model):
        cm, opt = prepared(built, ADAMW, dtype="bf16", device_memory=gpt2_budget(budget))
        cm.load_state_dict(real.state_dict())
        for ids in gpt2_batches(3):
            gpt2_loss(cm, ids).backward()
            opt.step()
            opt.zero_grad()
        runs.append(cm.state_dict())
    assert all(torch.equal(v, runs[1][k]) for k, v in runs[0].items())
    assert any(not torch.equal(v, v.bfloat16().float()) for v in runs[1].values()), "fp32 masters, not bf16"


def test_in_low_precision_a_change_made_before_the_first_forward_and_one_made_by_forward_are_kept() -> None:
    # The first was missed (no version had been read yet). The second, Embedding(max_norm) renormalizing its rows in
    # forward, was read from a host payload a download was still landing in.
    class Renormalizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.lin = nn.Embedding(10, 16, max_norm=1.0), nn.Linear(16, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.tanh(self.emb(ids)))

    model = Renormalizes()
    cm, opt = prepared(model, functools.partial(torch.optim.SGD, lr=0.0), dtype="bf16",
                       device_memory=int(param_bytes(model) * 1.5))
    with torch.no_grad():
        cm.module.lin.weight.fill_(0.5)
    assert torch.all(cm.state_dict()["lin.weight"] == 0.5)
    for _ in range(3):
        cm(torch.arange(8) % 10).float().sum().backward()
        opt.step()
        opt.zero_grad()
    rows = cm.state_dict()["emb.weight"][:8].norm(dim=1)
    assert torch.all(rows <= 1.01), "the renormalized rows reached the masters"


class _ClampsThroughData(nn.Module):
    """Weight constraints a forward makes through `p.data`, which moves no version counter: on modules it calls
    later, through an in-place method, Python's in-place operator on a view, `out=`, `inplace=True`, one of the
    views `chunk` gives, and `.data` of a view; and a sparse copy of one, read."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 4)
        self.mids = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mids[3].weight.data.clamp_(-0.05, 0.05)
        self.out.weight.data[:, :8] *= 0.9
        torch.clamp(self.mids[0].weight.data, -0.1, 0.1, out=self.mids[0].weight.data)
        nn.functional.hardtanh(self.mids[1].weight.data, -0.1, 0.1, inplace=True)
        self.mids[4].weight.data.chunk(2)[1].mul_(0.9)
        self.mids[5].weight[:, :4].data.mul_(0.9)
        assert self.inp.weight.data.to_sparse()._nnz() > 0
        x = torch.tanh(self.inp(x))
        for mid in self.mids:
            x = torch.tanh(mid(x))
        return self.out(x)


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_forward_that_changes_parameters_in_place_through_data_trains_as_plain_pytorch(budget) -> None:
    """Bug hunt (Gemma3n clamps its AltUp coefficients so): where the chunk was on the device the change was lost,
    the step taking the value from before it."""
    same_regression_bits(budget, _ClampsThroughData())


def test_what_p_data_gave_in_a_forward_keeps_no_chunk_slot_from_the_next_chunk() -> None:
    """Review: the mode kept every `p.data` it followed until the forward's end, and a view of a chunk's device
    payload keeps its slot from being reused: each layer's clamp took a new slot, beyond the budget's count."""
    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc.weight.data.clamp_(-0.2, 0.2)
            return torch.tanh(self.fc(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), *[Clamped() for _ in range(8)], nn.Linear(64, 4))
    cm, opt = prepared(model, ADAMW, chunk_size=64 * 65, device_memory=int(param_bytes(model) * 0.3))
    generator = torch.Generator().manual_seed(1)
    arena = cm.runtime.device.arena
    for step in range(4):
        if step == 2:
            slots = arena.allocations
        cm(torch.randn(4, 8, generator=generator)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert cm.memory_stats()["h2d_bytes"] > cm.memory_stats()["model_data_bytes"]
    assert arena.allocations == slots, "steps on the plan took new slots"


@pytest.mark.slow
def test_gemma3n_whose_forward_clamps_its_altup_coefficients_through_data_trains_as_plain_pytorch() -> None:
    """The bug hunt's model: its clip made small enough to bind, at a budget where chunks stream."""
    model = tiny_gemma3n(altup_coef_clip=0.01)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 128, (2, 16), generator=generator) for _ in range(STEPS)]

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    same_bits(loop, 0.1, model)


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_parameter_changed_in_place_between_forward_and_backward_is_an_error_as_in_pytorch(budget) -> None:
    # Autograd checks the version of every tensor it saved; a parameter chunkmem saved by address was read as it was
    # when backward came: a gradient of another function than the forward computed, silently.
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
        errors = []
        for step, ids in enumerate(gpt2_batches(STEPS)):
            loss = gpt2_loss(model, ids)
            if step == STEPS - 1:
                with torch.no_grad():
                    unwrapped(model).transformer.h[1].mlp.c_fc.weight.mul_(0.5)
            try:
                loss.backward()
            except RuntimeError as error:
                errors.append(str(error))
                break
            opt.step()
            opt.zero_grad()
        return errors

    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    cm, opt = prepared(model, ADAMW, device_memory=None if budget is None else int(param_bytes(model) * budget))
    expected, got = loop(plain, ADAMW(plain.parameters())), loop(cm, opt)
    assert len(expected) == len(got) == 1 and "modified by an inplace operation" in got[0]
    assert "transformer.h.1.mlp.c_fc.weight" in got[0] or budget is None  # resident: autograd's own check


def test_p_data_of_a_managed_parameter_outside_a_forward_moves_its_version_and_is_otherwise_pytorchs() -> None:
    """The one way `p.data` differs from PyTorch's under chunkmem (chunks/store.py's Note): outside a forward it shares
    the parameter's version counter, so a change through it between a forward and its backward is the error a change
    through `p` is. The parameter stays PyTorch's class: `nn.Parameter(p)` and copies work as in PyTorch, and `p.data`
    of a parameter chunkmem does not manage is PyTorch's."""
    cm, opt = prepared(tiny_gpt2(), ADAMW)
    weight = unwrapped(cm).transformer.h[1].mlp.c_fc.weight
    assert type(weight) is nn.Parameter and type(nn.Parameter(weight)) is nn.Parameter
    version = weight._version
    with torch.no_grad():
        weight.data.mul_(1.0)
    assert weight._version == version + 1
    other = nn.Parameter(torch.ones(2))
    other.data.mul_(2.0)
    assert other._version == 0
    loss = gpt2_loss(cm, gpt2_batches(1)[0])
    with torch.no_grad():
        weight.data.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert type(copy.deepcopy(weight)) is nn.Parameter and torch.equal(copy.deepcopy(weight), weight)


class _PrunedCell(nn.Module):
    """A cell called three times in one forward, whose pre-hook prunes its weight through `p.data` at every call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.cell, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.mids = nn.ModuleList(nn.Linear(32, 32) for _ in range(5))
        self.register_buffer("mask", (torch.rand(32, 32) > 0.3).float())
        self.cell.register_forward_pre_hook(self._prune)

    def _prune(self, cell: nn.Module, _inputs: tuple) -> None:
        cell.weight.data.mul_(self.mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = torch.tanh(self.cell(h))
        for mid in self.mids:
            h = torch.tanh(mid(h))
        return self.out(h)


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_weight_pruned_through_p_data_at_each_of_several_calls_in_one_forward_trains_as_plain_pytorch(budget):
    """Review: `p.data` sharing the version counter inside a forward too, the second call's pruning changed a weight
    the first call had saved, and backward raised where PyTorch trains: inside a forward `p.data` is PyTorch's."""
    same_regression_bits(budget, _PrunedCell())


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_deep_copy_kept_as_an_ema_model_holds_plain_pytorchs_values(budget) -> None:
    # timm's ModelEmaV2: a deep copy of the model given, then after each step every state_dict value moves towards
    # the model's. The copy of a prepared model is the plain module, fp32 on the host, its tied weights tied.
    from transformers import GPT2LMHeadModel

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        ema = copy.deepcopy(model)
        assert type(ema) is GPT2LMHeadModel and ema.lm_head.weight is ema.transformer.wte.weight
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in ema.modules())
        for ids in gpt2_batches(STEPS):
            gpt2_loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for mine, theirs in zip(ema.state_dict().values(), model.state_dict().values()):
                    mine.lerp_(theirs.to(mine.device), 0.1)
        with torch.no_grad():  # the EMA's own forward, and the model's values replaced by it (an evaluation)
            loss = gpt2_loss(ema, gpt2_batches(1, seed=3)[0])
            model.load_state_dict(ema.state_dict())
        assert torch.isfinite(loss)

    same_bits(loop, budget, tiny_gpt2())


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_model_and_its_hugging_face_parts_say_they_are_where_chunkmem_computes(budget, monkeypatch) -> None:
    # `batch.to(model.device)`, and the tensors generate (and XLNet's forward) make on `self.device`: a Hugging Face
    # model's device is its first parameter's, which views its host payload while its chunk is off the device, so on
    # CUDA a streaming model said "cpu" after a step.
    from transformers import GPT2LMHeadModel, GPT2Model

    cm, opt = prepared(tiny_gpt2(), ADAMW, device_memory=gpt2_budget(budget))
    for ids in gpt2_batches(2):
        gpt2_loss(cm, ids).backward()
        opt.step()
        opt.zero_grad()
    first = next(cm.parameters())
    assert (cm.runtime.residency.by_storage.get(first.untyped_storage().data_ptr()) is None) == (budget == 0.3)
    monkeypatch.setattr(cm.runtime.device, "torch_device", torch.device("meta"))  # where no parameter is
    assert cm.device == cm.module.device == cm.module.transformer.device == torch.device("meta")
    assert isinstance(cm.module, GPT2LMHeadModel) and isinstance(cm.module.transformer, GPT2Model)
    assert type(cm.module).__name__ == "GPT2LMHeadModel"  # what save_pretrained writes as its architecture


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_parameter_resized_after_prepare_is_an_error_that_says_so(budget) -> None:
    # Hugging Face's resize keeps the Parameter and gives it new data (as `p.data = t`): its chunk has no room for it.
    cm, _ = prepared(tiny_gpt2(), ADAMW, device_memory=gpt2_budget(budget))
    cm.module.resize_token_embeddings(130, mean_resizing=False)
    with pytest.raises(ValueError, match=r"transformer.wte.weight has shape \(130, 64\), and had \(128, 64\) when "
                                         r"chunkmem.prepare.*resize_token_embeddings"):
        gpt2_loss(cm, gpt2_batches(1)[0])


@pytest.mark.parametrize("budget", BUDGETS)
def test_save_pretrained_writes_the_master_weights_that_from_pretrained_loads(budget, tmp_path) -> None:
    # In bf16 the parameters the Hugging Face model's own save_pretrained would read hold the masters rounded.
    from transformers import GPT2LMHeadModel

    cm, opt = prepared(tiny_gpt2(), ADAMW, dtype="bf16", device_memory=gpt2_budget(budget))
    for ids in gpt2_batches(2):
        gpt2_loss(cm, ids).backward()
        opt.step()
        opt.zero_grad()
    kept = cm.config.dtype
    cm.save_pretrained(tmp_path)
    # Its config said bfloat16 (the chunks' dtype, which transformers records), and from_pretrained loaded that.
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    want = cm.state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], v) for k, v in want.items())
    assert cm.config.dtype == kept
    cm.save_pretrained(tmp_path / "rank 1", is_main_process=False)  # writes nothing (another ZeRO rank's call)
    assert cm.config.dtype == kept


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("before_zero_grad", [False, True])
def test_parameters_given_other_storage_keep_their_values(budget, before_zero_grad) -> None:
    # Given before zero_grad, the parameters of a chunk that streams (viewing its host payload since backward) were
    # pointed back at its device copy by zero_grad, and the values assigned were lost.
    def assign(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if not before_zero_grad:
            opt.zero_grad()
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.detach() * 0.9
        if before_zero_grad:
            opt.zero_grad()

    same_bits(steps(assign), budget)


class Sinusoids(nn.Module):
    """Features computed in float64 from a float64 input, as position encodings are."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = torch.sin(t[:, None] * torch.arange(1, 9, dtype=torch.float64))
        return self.linear(features.float())


class Encoder(nn.Module):
    """torch's own transformer encoder: in evaluation with a padding mask it runs a fused fast path on nested tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=True)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=padding))


@pytest.mark.parametrize("budget", BUDGETS)
def test_torchs_transformer_encoder_trains_as_plain_pytorch_and_evaluates_on_nested_tensors(budget) -> None:
    # The simulation's copy checker asked a nested tensor for its sizes, and the evaluation died.
    evaluated: list[torch.Tensor] = []

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        gen = torch.Generator().manual_seed(2)
        for _ in range(STEPS):
            ids = torch.randint(0, 64, (4, 10), generator=gen)
            padding = torch.arange(10).expand(4, 10) >= torch.tensor([[10], [9], [7], [5]])
            model.train()
            nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                evaluated.append(model(ids, padding)[~padding])

    same_bits(loop, budget, Encoder())
    half = len(evaluated) // 2
    # Close, not equal: where chunks stream, chunkmem's torch-function mode takes torch off its fused fast path.
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(evaluated[:half], evaluated[half:]))


def test_float64_inputs_are_not_cast_to_the_compute_dtype() -> None:
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        t = torch.linspace(0, 1000, 16, dtype=torch.float64)  # float32 would round these times
        for _ in range(2):
            model(t).square().mean().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    same_bits(loop, None, Sinusoids())


@pytest.mark.parametrize("budget", BUDGETS)
def test_steps_whose_loss_is_a_penalty_on_parameters_alone_train_as_plain_pytorch(budget) -> None:
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for i, ids in enumerate(gpt2_batches(STEPS)):
            if i % 2:
                gpt2_loss(model, ids).backward()
            else:  # no forward in this step, the first one included
                (1e-2 * sum(p.square().sum() for p in model.parameters())).backward()
            opt.step()
            opt.zero_grad()

    same_bits(loop, budget)


@pytest.mark.parametrize("budget", [0.3, 3.0])  # streaming all; some groups homed, their gradients on the device
def test_gradients_zeroed_but_kept_cost_what_freed_ones_do(budget) -> None:
    # Zeros nothing was added into are freed when the next forward hides them: the same traffic and peak (the
    # next backward adds into zeros, a host add where it streams, where set_to_none's writes).
    stats = []
    for set_to_none in (True, False):
        model = tiny_gpt2()
        cm, opt = prepared(model, ADAMW, device_memory=int(param_bytes(model) * budget))
        steps(lambda model, opt: opt.zero_grad(set_to_none=set_to_none))(cm, opt)
        traffic = cm.memory_stats()
        stats.append({k: traffic[k] for k in ("h2d_bytes", "d2h_bytes", "evictions", "device_chunk_bytes_peak")})
    assert stats[0] == stats[1]


@pytest.mark.parametrize("budget", [None, 0.3])
def test_under_fp16_an_input_gets_its_gradient_without_the_loss_scale(budget) -> None:
    # A module outside the prepared model (an encoder feeding `inputs_embeds`, trained by an optimizer of its own) got
    # every gradient 65536 times too large: the scale chunkmem puts on the model's outputs came back through its inputs.
    ids = gpt2_batches(1)[0]
    norms = {}
    for dtype in ("fp32", "fp16"):
        torch.manual_seed(5)
        outside = nn.Embedding(128, 64)
        cm, _ = prepared(tiny_gpt2(), ADAMW, dtype=dtype, device_memory=gpt2_budget(budget))
        cm(inputs_embeds=outside(ids), labels=ids).loss.float().backward()
        norms[dtype] = outside.weight.grad.norm().item()
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2)


@pytest.mark.parametrize("budget", [0.3, 1.5])
def test_backward_with_create_graph_says_that_p_grad_has_no_graph(budget, caplog) -> None:
    """`loss.backward(create_graph=True)` then a penalty on `p.grad`: the gradients went into chunks as values, so the
    penalty got no gradient, silently. torch.autograd.grad(create_graph=True), which gives the graph, is named once; a
    backward without it is not warned of. (A resident step, where the model fits, leaves autograd's `p.grad`, graph and
    all: runtime's Note on resident steps.)"""
    cm, opt = prepared(tiny_gpt2(), ADAMW, device_memory=gpt2_budget(budget))
    batches = gpt2_batches(3)
    gpt2_loss(cm, batches[0]).backward()
    opt.step()
    assert not any("create_graph" in r.getMessage() for r in caplog.records)
    for ids in batches[1:]:
        opt.zero_grad()
        gpt2_loss(cm, ids).backward(create_graph=True)
    said = [r.getMessage() for r in caplog.records if "create_graph" in r.getMessage()]
    assert len(said) == 1 and "torch.autograd.grad(loss, params, create_graph=True)" in said[0]


def test_under_fp16_a_change_to_scaled_gradients_through_p_grad_is_named(caplog) -> None:
    # torch.nn.utils.clip_grad_norm_ reads p.grad, which holds each gradient times the loss scale: its fp16 norm was
    # inf, it clipped every gradient to zero, and the model stopped learning without a word.
    def train(clip: Callable[[nn.Module], object]) -> list[str]:
        cm, opt = prepared(tiny_gpt2(), ADAMW, dtype="fp16")
        caplog.clear()
        for ids in gpt2_batches(2):
            gpt2_loss(cm, ids).backward()
            clip(cm)
            opt.step()
            opt.zero_grad()
        return [r.getMessage() for r in caplog.records if "p.grad was changed in place" in r.getMessage()]

    with caplog.at_level("WARNING", logger="chunkmem"):
        named = train(lambda cm: torch.nn.utils.clip_grad_norm_(cm.parameters(), 1.0))
        assert len(named) == 1 and "clip with model.clip_grad_norm_" in named[0]  # once
        assert not train(lambda cm: cm.clip_grad_norm_(1.0))  # it unscales first
        assert not train(lambda cm: None)


def raising(model: nn.Module, ids: torch.Tensor) -> None:
    """A forward and a backward that raises halfway (a tensor hook of the user's), its error caught."""
    def boom(_grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    def hook(_module: nn.Module, _args: Any, out: Any) -> None:
        (out[0] if isinstance(out, tuple) else out).register_hook(boom)

    handle = unwrapped(model).transformer.h[1].register_forward_hook(hook)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            gpt2_loss(model, ids).backward()
    finally:
        handle.remove()


@pytest.mark.parametrize("budget", [None, 0.3])
def test_a_forward_with_gradients_between_backward_and_step_is_named_and_clipping_through_the_model_holds(
        budget, caplog) -> None:
    # Such a forward hides p.grad (grads.py's Note), so torch.nn.utils.clip_grad_norm_ after it found no gradient and
    # clipped nothing, where plain PyTorch clips: a silent difference. So did a backward that raised partway, whose end
    # (which shows the gradients) never came.
    def loop(between: Callable[[nn.Module, torch.Tensor], object], accumulate: bool = False) -> Loop:
        def run(model: nn.Module, opt: torch.optim.Optimizer) -> None:
            for ids in gpt2_batches(2):
                gpt2_loss(model, ids).backward()
                between(model, ids)
                if accumulate:
                    gpt2_loss(model, ids.flip(0)).backward()
                clip = getattr(model, "clip_grad_norm_", None)  # chunkmem's reads the chunks
                clip(0.05) if clip else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
                opt.zero_grad()
        return run

    def warned(*args: Any) -> list[str]:
        caplog.clear()
        same_bits(loop(*args), budget)
        return [r.getMessage() for r in caplog.records if "p.grad was None until this step" in r.getMessage()]

    with caplog.at_level("WARNING", logger="chunkmem"):
        named = warned(gpt2_loss)  # a forward whose loss is dropped (a metric computed without torch.no_grad)
        if budget is None:  # gradients on the device stay shown until a backward begins (`kept_through_forward`)
            assert not named
        else:
            assert len(named) == 1 and "or run that forward under torch.no_grad()" in named[0]  # once
        assert not warned(gpt2_loss, True)  # its backward followed: gradient accumulation
        assert not warned(torch.no_grad()(gpt2_loss))
        named = warned(raising)  # a backward that raised partway: its gradients so far stay, as in PyTorch
        assert len(named) == 1 and "a backward raised before it ended" in named[0]
    cm, _ = prepared(tiny_gpt2(), ADAMW, device_memory=gpt2_budget(budget))
    ids = gpt2_batches(1)[0]
    gpt2_loss(cm, ids).backward()
    assert float(torch.nn.utils.clip_grad_norm_(cm.parameters(), 0.05)) > 0
    gpt2_loss(cm, ids)
    clipped = float(torch.nn.utils.clip_grad_norm_(cm.parameters(), 0.05))
    assert clipped > 0 if budget is None else clipped == 0  # what the warning names


@pytest.mark.parametrize("budget", BUDGETS)
def test_torch_func_refused_on_a_submodule_leaves_training_as_plain_pytorchs(budget) -> None:
    # torch.func refuses saved-tensor hooks: the pre-hook that raised left chunkmem's torch-function mode entered for
    # good, and the post-hook, run all the same, released parameters never acquired (the next step: ChunkStateError).
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for ids in gpt2_batches(STEPS):
            mlp = unwrapped(model).transformer.h[0].mlp
            try:
                torch.func.grad(lambda x: mlp(x).square().mean())(torch.ones(2, 3, 64))
            except RuntimeError as error:  # torch's, under chunkmem alone
                assert "saved tensor hooks" in str(error) and model is not unwrapped(model)
            gpt2_loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
    same_bits(loop, budget)
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize("budget", [b for b in BUDGETS if b is not None])  # (resident steps have no moments)
def test_a_forward_whose_module_pre_hook_raised_before_acquiring_leaves_training_as_plain_pytorchs(budget) -> None:
    # A moment before a module acquires its parameters that raised (out of memory making room): the post-hook, run all
    # the same, released parameters never acquired, and the next step failed in a parameter's state machine.
    class Refused(Exception):
        pass

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        runtime = getattr(model, "runtime", None)
        for step, ids in enumerate(gpt2_batches(STEPS)):
            if step == 2 and runtime is not None:
                emit = runtime.emit

                def refused(name: str, stage: str, where: str) -> int | None:
                    if name == "pre_forward" and where.endswith("h.1.mlp.c_fc"):
                        raise Refused(where)
                    return emit(name, stage, where)
                with mock.patch.object(runtime, "emit", refused), pytest.raises(Refused):
                    gpt2_loss(model, ids)
            gpt2_loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
    same_bits(loop, budget)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("budget", [2.5, 4.24])
def test_parameters_read_or_changed_outside_forward_hold_their_values_when_their_chunk_just_left(budget,
                                                                                                 set_to_none) -> None:
    # A parameter chunk an update on the device changed that leaves the device (at a backward's or zero_grad's end,
    # to show gradients on the host; during step(), for room) is sent back to the host, and its parameters view the
    # host payload at once: read there before that download landed, they held the values before the update, and a
    # weight constraint applied after backward was lost (the simulation's checker: HazardError). Below and just over
    # the model data (4 x the parameter bytes under AdamW), groups homed and streamed side by side.
    reads: dict[str, list[float]] = {}

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        seen = reads.setdefault("plain" if model is unwrapped(model) else "chunkmem", [])

        @torch.no_grad()
        def read() -> None:
            seen.append(sum(float(p.sum()) for p in model.parameters()))
        for ids in gpt2_batches(STEPS):
            gpt2_loss(model, ids).backward()
            read()
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.mul_(0.99)  # a weight constraint between backward and step
            opt.step()
            read()
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.2, 0.2)  # and one after step(), which zero_grad sends back to the host
            opt.zero_grad(set_to_none=set_to_none)
            read()
    same_bits(loop, budget)
    assert reads["chunkmem"] == reads["plain"]


@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_a_parameter_used_outside_its_module_first_in_a_lean_forward_trains_as_plain_pytorch(budget) -> None:
    # A branch only later batches of the same shapes take reads another module's weight: the forward ran lean, without
    # the torch-function mode that fetches such a parameter, and its op got a host tensor (on CUDA, a device mismatch).
    class Branching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.out = nn.Linear(16, 64), nn.Linear(64, 4)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6))
            self.branch = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            if self.branch:
                h = h + torch.tanh(nn.functional.linear(h, self.blocks[0][0].weight))
            return self.out(h)

    lean: list[int] = []

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        generator = torch.Generator().manual_seed(1)
        for step in range(7):
            unwrapped(model).branch = step in (4, 6)
            x, y = torch.randn(2, 16, generator=generator), torch.randn(2, 4, generator=generator)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if model is not unwrapped(model):
                lean.append(model.memory_stats()["lean_forwards"])
    same_bits(loop, budget, Branching())
    assert lean[3] > 0 and lean[-1] == lean[4] == lean[3], "lean until step 4's, which ran again; none after it"


def test_under_fp16_a_model_may_change_its_input_in_place() -> None:
    # The node that takes the scale off an input's gradient returned a view of it, which autograd forbids changing in
    # place: a model adding its position embedding into its input (`x += pos`) failed in forward.
    class AddsInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos, self.lin = nn.Parameter(torch.randn(16)), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x += self.pos
            return self.lin(x)

    grads = {}
    for dtype in ("fp32", "fp16"):
        torch.manual_seed(0)
        outside, model = nn.Linear(8, 16), AddsInPlace()
        cm, _ = prepared(model, ADAMW, dtype=dtype)
        features = outside(torch.randn(4, 8))
        cm(features.half() if dtype == "fp16" else features).float().pow(2).mean().backward()
        grads[dtype] = outside.weight.grad
    torch.testing.assert_close(grads["fp16"], grads["fp32"], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("budget", [None, 1.5])
def test_an_activation_changed_in_place_after_it_was_saved_is_an_error_as_in_pytorch(budget) -> None:
    # Autograd skips its version check of a saved tensor that saved-tensor hooks keep, as chunkmem's do: backward read
    # the changed activation, a gradient of another function than the forward's, silently.
    class ChangesItsActivation(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sigmoid(self.a(x))
            out = self.b(h)  # saves h
            h.mul_(2)
            return out

    model = ChangesItsActivation()
    cm, opt = prepared(model, ADAMW, device_memory=None if budget is None else int(param_bytes(model) * budget),
                       chunk_size=16 * 16 + 16)
    for net in (copy.deepcopy(model), cm, cm):  # plain, then chunkmem's warm-up and a step on its plan
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            net(torch.randn(8, 16)).sum().backward()


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("change", ["step", "load_state_dict"])
def test_a_backward_through_parameters_a_step_or_a_load_changed_since_its_forward_raises_as_in_pytorch(budget, change):
    # A retained graph's second backward after a step (a GAN's discriminator stepping between the two backwards through
    # it) mixed the new weights with the old activations, a silent wrong gradient: chunkmem writes a step's and a load's
    # values into the chunks, not through the parameters, and their version counters did not move.
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        first, second = gpt2_batches(2)
        gpt2_loss(model, first).backward()  # a step before: later steps run resident where everything fits
        opt.step()
        opt.zero_grad()
        loss = gpt2_loss(model, second)
        loss.backward(retain_graph=True)
        if change == "step":
            opt.step()
        else:
            model.load_state_dict(model.state_dict())
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        gpt2_loss(model, first).backward()  # and training goes on
        opt.step()
    same_bits(loop, budget)


KEEPS = {"p.grad": lambda g: g, "p.grad.detach()": lambda g: g.detach(), "a slice": lambda g: g[:1]}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("clear", ["zero_grad", "p.grad = None"])
@pytest.mark.parametrize("keep", KEEPS)
def test_gradients_kept_past_their_clearing_keep_their_values(budget, clear, keep) -> None:
    # Gradient surgery keeps one loss's p.grad, clears the gradients and runs the next loss's backward: p.grad viewed
    # the gradient chunk, which that backward wrote, so the kept gradients became the second loss's (cosine 1.0 between
    # them, where plain PyTorch's, new tensors, gave 0.34). Kept as a view of p.grad (detached, sliced), not p.grad
    # itself, they were written so still where chunks stream (by 0.30 on an MLP at 30% of its parameter bytes).
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        batches = gpt2_batches(4)
        for first, second in zip(batches[::2], batches[1::2]):
            gpt2_loss(model, first).backward()
            kept = [KEEPS[keep](p.grad) for p in model.parameters()]
            if clear == "zero_grad":
                opt.zero_grad()
            else:
                for p in model.parameters():
                    p.grad = None
            gpt2_loss(model, second).backward()
            for p, grad in zip(model.parameters(), kept):
                p.grad = p.grad + torch.zeros_like(p.grad).index_add(0, torch.arange(len(grad)), grad) \
                    if grad.dim() and grad.shape != p.grad.shape else p.grad + grad
            opt.step()
            opt.zero_grad()
    same_bits(loop, budget)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("clear", ["zero_grad", "p.grad = None"])
def test_gradients_nobody_kept_are_not_copied_when_cleared(budget, clear, monkeypatch) -> None:
    # Gradients lent to their chunks (autograd's own tensors, every one in a resident step) were copied at every
    # `p.grad = None`: one copy of every gradient a step, on the device, though nobody held them.
    copies = []

    def counted(gradients: list[torch.Tensor]) -> None:  # grads._keep_held, counting what it would copy
        refs = [weakref.ref(g) for g in gradients]
        gradients.clear()
        copies.append(sum(ref() is not None for ref in refs))
    monkeypatch.setattr(grads, "_keep_held", counted)
    cm, opt = prepared(tiny_gpt2(), ADAMW, device_memory=gpt2_budget(budget))
    for ids in gpt2_batches(STEPS):
        gpt2_loss(cm, ids).backward()
        opt.step()
        if clear == "zero_grad":
            opt.zero_grad()
        else:
            for p in cm.parameters():
                p.grad = None
    gpt2_loss(cm, gpt2_batches(1)[0]).backward()  # the last `p.grad = None` is taken here
    assert copies and sum(copies) == 0
    assert cm.runtime.grads.renewed == 0, "no chunk left its host payload to views nobody holds"


@pytest.mark.parametrize("clear", ["accumulate", "zeros kept"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_a_module_of_the_model_called_on_its_own_trains_as_plain_pytorch(budget, clear) -> None:
    # A loss on the hidden states of `model.transformer(ids)`, a module called on its own rather than through the
    # model's forward: its backward added into the gradients the backward before showed in p.grad, on the host where
    # chunks stream (a device mismatch). And a weight constraint after such a call under no_grad raced with the
    # uploads it left landing (the simulation's checker: HazardError).
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for i, ids in enumerate(gpt2_batches(STEPS)):
            model.transformer(ids).last_hidden_state.pow(2).mean().backward()
            if clear == "accumulate" and i % 2 == 0:
                continue
            opt.step()
            opt.zero_grad(set_to_none=clear == "accumulate")
            with torch.no_grad():
                model.transformer(ids)
                for p in model.parameters():
                    p.clamp_(-0.2, 0.2)
    same_bits(loop, budget)


def test_under_fp16_a_module_called_on_its_own_to_train_is_named(caplog) -> None:
    # Its outputs do not carry the loss scale the model's outputs do, and step() divides every gradient by it: a loss on
    # them trained 65536 times too slowly without a word. Not its calls without gradients, nor the model's forward.
    cm, opt = prepared(tiny_gpt2(), ADAMW, dtype="fp16")
    ids = gpt2_batches(1)[0]
    with caplog.at_level("WARNING", logger="chunkmem"):
        with torch.no_grad():
            cm.transformer(ids)
        gpt2_loss(cm, ids).backward()
        assert not caplog.records
        for _ in range(2):
            cm.transformer(ids).last_hidden_state.float().pow(2).mean().backward()
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and "transformer, a module of a dtype='fp16' model" in named[0] and "65536" in named[0]


@pytest.mark.parametrize("budget", [None, 0.3])
def test_a_ddp_accumulation_loop_with_no_sync_runs_unchanged_and_trains_as_plain_pytorch(budget) -> None:
    # `with model.no_sync():` around every micro-batch's backward but the last, as DDP loops accumulate: an
    # AttributeError ended such a loop (bug hunt); a plain model has no no_sync, and sums the same gradients.
    def loop(model: nn.Module, opt: torch.optim.Optimizer, no_sync: Callable[[], Any]) -> None:
        batches = gpt2_batches(4)
        for first, second in zip(batches[::2], batches[1::2]):
            with no_sync():
                gpt2_loss(model, first).backward()
            gpt2_loss(model, second).backward()
            opt.step()
            opt.zero_grad()
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    loop(plain, ADAMW(plain.parameters()), contextlib.nullcontext)
    cm, opt = prepared(model, ADAMW, device_memory=gpt2_budget(budget))
    loop(cm, opt, cm.no_sync)
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in plain.state_dict().items())


class CheckpointedBlocks(nn.Module):
    """Four residual blocks, each checkpointed by torch's non-reentrant kind, and a head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
                                    for _ in range(4))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


@pytest.mark.parametrize("after", ["input gradient", "a backward that raised"])
def test_a_backward_with_no_parameter_gradient_lets_go_of_what_its_re_computations_held(after) -> None:
    # Chunks a re-computation holds were let go when a parameter's gradient hook ended the backward: after
    # torch.autograd.grad of the input (no such hook) or a backward that raised, they stayed pinned through the next
    # forward, which found no room for the next block's chunk (review: a MemoryBudgetError at every step).
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            inputs = x.clone().requires_grad_()
            if after == "input gradient":
                torch.autograd.grad(model(inputs).square().mean(), inputs)
                continue
            out = model(inputs).square().mean()
            inputs.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("a hook failed")))
            with pytest.raises(RuntimeError, match="a hook failed"):
                out.backward()
            opt.zero_grad()
    model = CheckpointedBlocks()
    plain = copy.deepcopy(model)
    loop(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    cm, opt = prepared(model, functools.partial(torch.optim.SGD, lr=0.1), device_memory=int(param_bytes(model) * 0.4),
                       chunk_size=2 * (32 * 32 + 32))  # a block's a chunk
    loop(cm, opt)
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in plain.state_dict().items())
    assert cm.memory_stats()["h2d_bytes"] > 0, "chunks must move for this test to mean anything"
