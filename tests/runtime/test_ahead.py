"""Host updates made ahead of step() (runtime/ahead.py's Note): on a worker while backward goes on, adopted by
step() only when nothing they read changed, so a run with them has the bits of the same run without them; and
the simulation catches a worker that reads gradients before their downloads land."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from chunkmem.memory import native, sim
from chunkmem.memory.sim import HazardError, SimulatedDevice
from tests import zoo
from tests.helpers import gpt2_batches, gpt2_loss, least_accepted, param_bytes, prepared, tiny_gpt2, train

pytest.importorskip("transformers")
if native.load() is None:
    pytest.skip("the native extension could not be built here", allow_module_level=True)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
NATIVE = dict(native_optimizer=True, dtype="bf16")
STEPS = 4


def run(model: nn.Module, budget: int, overlap: bool, batches: list, loss_fn: Callable = gpt2_loss,
        **kwargs) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    cm, opt = prepared(model, ADAMW, device_memory=budget, overlap_update=overlap, **NATIVE)
    losses = train(cm, opt, batches, loss_fn, **kwargs)
    return losses, {k: v.clone() for k, v in cm.state_dict().items()}, cm


def streaming(model: nn.Module) -> int:
    return least_accepted(model, ADAMW, low=param_bytes(model) // 2, **NATIVE)


def assert_same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0], "losses differ"
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], v) for k, v in b[1].items()), "weights differ"


ARCHS = [a for a in zoo.available() if a.name in ("llama", "bert", "t5", "vit")]


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_updates_made_ahead_are_adopted_and_give_the_bits_of_updates_after_backward(arch: zoo.Arch) -> None:
    model, batches = arch.build(), arch.batches(STEPS)
    budget = streaming(model)
    after = run(model, budget, False, batches, zoo.loss)
    ahead = run(model, budget, True, batches, zoo.loss)
    assert_same(ahead, after)
    runtime = ahead[2].runtime
    assert runtime.memory_stats()["evictions"] > 0, "chunks must stream"
    # Step 1 is the warm-up and step 2 follows a step with one backward: steps 2-4 update host groups ahead.
    assert runtime.ahead.adopted > 0 and runtime.ahead.redone == 0


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, list, int]:
    model = tiny_gpt2()
    return model, gpt2_batches(STEPS), streaming(model)


def test_decay_and_no_decay_param_groups_sharing_chunks_are_updated_ahead_too(gpt2) -> None:
    # chunkmem finetune's param groups (Hugging Face's): weights with decay, biases and norms without, alternating in
    # every chunk. Such chunks were never updated ahead, nor by the native kernel: now a pass a run of one group's.
    def split(params) -> torch.optim.Optimizer:
        params = list(params)
        return ADAMW([{"params": [p for p in params if p.dim() >= 2]},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}])

    model, batches, budget = gpt2
    results = []
    for overlap in (False, True):
        cm, opt = prepared(model, split, device_memory=budget, overlap_update=overlap, **NATIVE)
        results.append((train(cm, opt, batches, gpt2_loss), {k: v.clone() for k, v in cm.state_dict().items()}, cm))
    assert_same(results[1], results[0])
    assert results[1][2].runtime.ahead.adopted > 0 and results[1][2].runtime.ahead.redone == 0


@pytest.mark.parametrize("clip,adopted", [(1e9, True), (0.05, False)], ids=["clip-changes-nothing", "clip-scales"])
def test_clipping_is_exact_adopted_where_it_changed_no_byte_redone_where_it_did(gpt2, clip: float,
                                                                                  adopted: bool) -> None:
    model, batches, budget = gpt2
    ahead = run(model, budget, True, batches, clip=clip)
    assert_same(ahead, run(model, budget, False, batches, clip=clip))
    counts = ahead[2].runtime.ahead
    assert (counts.adopted > 0, counts.redone > 0) == (adopted, not adopted)
    if adopted:  # the model's clip_grad_norm_ left the host gradients unwritten: no copy of them was needed
        assert counts.unkept == 0 and not counts.keep
    else:  # step 2's were redone for want of a copy, step 3's with one: step 4 makes none
        assert counts.unkept > 0 and counts.rested == 1


def test_torch_clipping_by_one_has_updates_keep_a_copy_of_their_gradients_and_adopts_them(gpt2) -> None:
    def edit(i: int, model: nn.Module, opt) -> None:  # writes every gradient, multiplied by 1
        nn.utils.clip_grad_norm_(model.parameters(), 1e9)

    model, _, budget = gpt2
    batches = gpt2_batches(5)
    ahead = edited(model, budget, True, batches, edit)
    assert_same(ahead, edited(model, budget, False, batches, edit))
    counts = ahead[2].runtime.ahead
    # Step 2 made its updates without a copy and redoes them; steps 3-5 keep copies and adopt theirs.
    assert counts.redone == counts.unkept > 0 and counts.adopted > 0 and counts.rested == 0 and counts.keep
    assert ahead[2].runtime.memory_stats()["ahead_unkept"] == counts.unkept


def test_after_a_step_whose_updates_were_all_redone_the_next_makes_none_and_then_they_are_adopted_again(gpt2) -> None:
    def edit(i: int, model: nn.Module, opt) -> None:
        if i in (1, 2):  # the first steps with updates made ahead: all of them are redone (without a copy, with one)
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(0.5)

    model, _, budget = gpt2
    batches = gpt2_batches(6)
    ahead = edited(model, budget, True, batches, edit)
    assert_same(ahead, edited(model, budget, False, batches, edit))
    counts = ahead[2].runtime.ahead
    assert counts.rested == 1 and counts.redone > counts.unkept > 0 and counts.adopted > 0, "steps 5-6 adopt again"
    assert ahead[2].runtime.memory_stats()["ahead_rested"] == 1


def edited(model: nn.Module, budget: int, overlap: bool, batches: list, edit: Callable[[int, nn.Module, object], None],
           **config) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    """A training loop in which `edit(step index, model, optimizer)` runs between backward and step()."""
    cm, opt = prepared(model, ADAMW, device_memory=budget, overlap_update=overlap, **(NATIVE | config))
    losses = []
    for i, ids in enumerate(batches):
        loss = gpt2_loss(cm, ids)
        loss.backward()
        losses.append(loss.item())
        edit(i, cm, opt)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.clone() for k, v in cm.state_dict().items()}, cm


def first_grad(model: nn.Module) -> torch.Tensor:
    return next(p.grad for p in model.parameters() if p.grad is not None)


def test_a_new_learning_rate_or_an_edited_gradient_between_backward_and_step_is_redone(gpt2) -> None:
    def edit(i: int, model: nn.Module, opt) -> None:  # after the updates ahead started, before step() adopts them
        if i == 2:
            opt.param_groups[0]["lr"] *= 0.5
        if i == 3:
            first_grad(model).mul_(2.0)

    model, batches, budget = gpt2
    ahead = edited(model, budget, True, batches, edit)
    assert_same(ahead, edited(model, budget, False, batches, edit))
    assert ahead[2].runtime.ahead.redone > 0 and ahead[2].runtime.ahead.adopted > 0


def test_a_gradient_written_into_a_group_after_its_update_started_voids_that_update(gpt2) -> None:
    """Late in backward (the embedding's output gradient), backward tells the worker that a gradient was added into
    a group whose update already started: that update is redone by step(), not adopted."""
    voided: list[int] = []

    def late(grad: torch.Tensor, cm: nn.Module) -> None:
        ahead = cm.runtime.ahead
        if ahead is not None and ahead.jobs and not voided:
            index = next(iter(ahead.jobs))
            record = next(r for r in cm.runtime.store.records.values() if r.group.index == index)
            ahead.written(record, True)
            voided.append(index)

    def hooked(model: nn.Module, budget: int, overlap: bool) -> tuple:
        cm, opt = prepared(model, ADAMW, device_memory=budget, overlap_update=overlap, **NATIVE)

        def embedded(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda grad: late(grad, cm))

        cm.module.transformer.wte.register_forward_hook(embedded)
        losses = train(cm, opt, batches, gpt2_loss)
        return losses, {k: v.clone() for k, v in cm.state_dict().items()}, cm

    model, batches, budget = gpt2
    ahead = hooked(model, budget, True)
    assert_same(ahead, hooked(model, budget, False))
    counts = ahead[2].runtime.ahead
    assert voided and counts.redone == 1 and counts.unkept == 0 and counts.adopted > 0


def test_updates_take_half_the_threads_while_backward_runs_and_all_once_the_host_waits(gpt2, monkeypatch) -> None:
    """Late in backward the test waits for the updates started so far, so that some run while backward does."""
    calls: list[tuple[int, bool]] = []  # each worker update's team, and whether backward had ended
    kernel = native.adam_step

    def recorded(*args, threads: int = 0, **kwargs):
        calls.append((threads, cm.runtime.ahead.joined))
        return kernel(*args, threads=threads, **kwargs)

    def late(grad: torch.Tensor) -> None:
        cm.runtime.device.synchronize()  # the gradients' downloads land (the simulation's `wait` landing: once known)
        for job in list(cm.runtime.ahead.jobs.values()):
            job.done.result()

    model, batches, budget = gpt2
    cm, opt = prepared(model, ADAMW, device_memory=budget, overlap_update=True, **NATIVE)

    def embedded(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(late)

    cm.module.transformer.wte.register_forward_hook(embedded)
    monkeypatch.setattr(native, "adam_step", recorded)
    train(cm, opt, batches, gpt2_loss)
    full = torch.get_num_threads()
    ahead = [threads for threads, joined in calls if threads and not joined]
    assert ahead and all(threads == max(1, full // 2) for threads in ahead), calls
    assert all(threads == full for threads, joined in calls if threads and joined), calls


def test_accumulated_gradients_start_nothing_ahead(gpt2) -> None:
    model, batches, budget = gpt2
    ahead = run(model, budget, True, batches * 2, accumulate=2)
    assert_same(ahead, run(model, budget, False, batches * 2, accumulate=2))
    assert (ahead[2].runtime.ahead.adopted, ahead[2].runtime.ahead.redone) == (0, 0)


def test_an_fp16_step_skipped_for_an_overflow_adopts_nothing_and_keeps_the_bits(gpt2) -> None:
    def edit(i: int, model: nn.Module, opt) -> None:
        if i == 2:  # an overflow found by step(), after the updates ahead started
            first_grad(model)[0] = float("inf")

    model, batches, budget = gpt2
    ahead = edited(model, budget, True, batches, edit, dtype="fp16")
    assert_same(ahead, edited(model, budget, False, batches, edit, dtype="fp16"))
    runtime = ahead[2].runtime
    assert runtime.scaler.scale == 2.0 ** 15, "step 3 must have been skipped"
    assert runtime.ahead.adopted > 0 and runtime.ahead.redone == 0


def test_a_worker_that_reads_gradients_before_their_downloads_land_is_caught(gpt2,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker sees the kernel read gradient bytes whose downloads may still be in flight. Without it, the
    simulation's downloads land only when the host learns of them (CHUNKMEM_SIM_LANDING=wait): a worker that skipped
    its wait would update from the gradients of the step before, and give other bits. So the suite would catch it."""
    model, batches, budget = gpt2
    right = run(model, budget, True, batches)
    monkeypatch.setattr(SimulatedDevice, "wait_landed", lambda self, token: None)
    if sim._active is not None:
        with pytest.raises(HazardError, match="native adam_step reads .* download of grad"):
            run(model, budget, True, batches)
    monkeypatch.setattr(sim, "check_unseen", lambda *args: None)
    wrong = run(model, budget, True, batches)
    assert right[0][:2] == wrong[0][:2], "the first steps take no update ahead"
    assert any(not torch.equal(right[1][k], v) for k, v in wrong[1].items())


def test_overlap_update_needs_the_native_adam_and_says_when_it_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    import chunkmem

    with pytest.raises(ValueError, match="overlap_update=True needs the native optimizer"):
        chunkmem.Config(device="cpu", overlap_update=True, native_optimizer=False)
    with pytest.raises(ValueError, match="overlap_update=1: expected True or False"):
        chunkmem.Config(device="cpu", overlap_update=1)  # type: ignore[arg-type]
    model = tiny_gpt2()
    cm, _ = prepared(model, functools.partial(torch.optim.SGD, lr=0.1), overlap_update=True, **NATIVE)
    assert cm.runtime.ahead is None
    assert "overlap_update=True is ignored: it updates Adam and AdamW only" in caplog.text
    cm, _ = prepared(copy.deepcopy(model), ADAMW, overlap_update=True, **NATIVE)
    assert cm.runtime.ahead is not None


def test_a_backward_that_fails_after_updates_started_leaves_the_next_steps_bits(gpt2) -> None:
    class Failure(Exception):
        pass

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise Failure  # late in backward: the last layers' groups have started their updates

    def fail_later(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(fail)

    results = []
    for overlap in (False, True):
        cm, opt = prepared(gpt2[0], ADAMW, device_memory=gpt2[2], overlap_update=overlap, **NATIVE)
        losses = []
        for i, ids in enumerate(gpt2[1] * 2):
            handle = cm.module.transformer.wte.register_forward_hook(fail_later) if i == 2 else None
            loss = gpt2_loss(cm, ids)
            if handle is not None:
                handle.remove()
                with pytest.raises(Failure):
                    loss.backward()
                opt.zero_grad()
                continue
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        results.append((losses, {k: v.clone() for k, v in cm.state_dict().items()}, cm))
    assert_same(results[1], results[0])
    assert results[1][2].runtime.ahead.adopted > 0


def test_spares_count_against_host_memory_groups_they_would_push_past_it_update_in_step(gpt2, caplog) -> None:
    def nothing(*_) -> None:
        pass

    model, batches, budget = gpt2
    after = edited(model, budget, False, batches, nothing)
    host = after[2].runtime.memory_stats()["host_pinned_bytes_peak"]  # what the run needs without spares
    with caplog.at_level("WARNING", logger="chunkmem"):
        ahead = edited(model, budget, True, batches, nothing, host_memory=host)
    assert_same(ahead, after)
    runtime = ahead[2].runtime
    stats = runtime.memory_stats()
    assert runtime.ahead.over_budget, "some group's spares must not fit"
    assert "spare buffers need" in caplog.text and f"host_memory={host}" in caplog.text
    # Before spares counted, 65 buffers went to pageable memory past the budget.
    assert stats["host_pool_fallbacks"] == 0 and stats["host_pinned_bytes_peak"] <= host, \
        "no host buffer may go past Config.host_memory, pinned or pageable"


def another_backward(i: int, model: nn.Module, opt) -> None:
    if i == 2:  # a second micro-batch, after steps of one backward: it adds to the gradients the updates ahead read
        gpt2_loss(model, gpt2_batches(1)[0]).backward()


def backward_again(i: int, model: nn.Module, opt) -> None:
    if i == 2:  # the first backward thrown away (a loss found bad), another batch's taken
        opt.zero_grad()
        gpt2_loss(model, gpt2_batches(1)[0]).backward()


def load_weights(i: int, model: nn.Module, opt, saved: dict = {}) -> None:  # noqa: B006  one run's snapshot
    if i == 0:
        saved[id(model)] = {k: v.clone() for k, v in model.state_dict().items()}
    if i == 2:  # a roll-back: master weights written after the updates ahead read them
        model.load_state_dict(saved.pop(id(model)))


@pytest.mark.parametrize("edit", [another_backward, backward_again, load_weights], ids=lambda f: f.__name__)
def test_gradients_or_weights_changed_between_backward_and_step_have_the_updates_made_ahead_redone(gpt2, edit) -> None:
    model, batches, budget = gpt2
    ahead = edited(model, budget, True, batches, edit)
    assert_same(ahead, edited(model, budget, False, batches, edit))
    unchanged = edited(model, budget, True, batches, lambda *_: None)[2].runtime.ahead.adopted
    assert 0 < ahead[2].runtime.ahead.adopted < unchanged, "step 3's updates are not adopted, steps 2 and 4's are"


def test_an_optimizer_of_some_parameters_makes_updates_ahead_for_its_groups_only(gpt2) -> None:
    def half(params) -> torch.optim.Optimizer:  # the rest still get gradients, which model.zero_grad() clears
        params = list(params)
        return ADAMW(params[: len(params) // 2])

    model, batches, budget = gpt2
    runs = []
    for overlap in (False, True):
        cm, opt = prepared(model, half, device_memory=budget, overlap_update=overlap, **NATIVE)
        losses = []
        for ids in batches:
            loss = gpt2_loss(cm, ids)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            cm.zero_grad()
        runs.append((losses, {k: v.clone() for k, v in cm.state_dict().items()}, cm))
    assert_same(runs[1], runs[0])
    assert runs[1][2].runtime.ahead.adopted > 0


def test_an_update_ahead_that_fails_raises_from_backward_and_step_makes_it(gpt2, monkeypatch) -> None:
    kernel, failures = native.adam_step, []

    def fails_once(*args, **kwargs):
        if kwargs.get("into") is not None and not failures:  # the worker's, in step 3
            failures.append(cm.runtime.step_count)
            raise RuntimeError("the worker's kernel failed")
        return kernel(*args, **kwargs)

    model, batches, budget = gpt2
    after = run(model, budget, False, batches)
    cm, opt = prepared(model, ADAMW, device_memory=budget, overlap_update=True, **NATIVE)
    monkeypatch.setattr(native, "adam_step", fails_once)
    losses = []
    for ids in batches:
        loss = gpt2_loss(cm, ids)
        try:
            loss.backward()
        except RuntimeError as error:
            assert "the worker's kernel failed" in str(error) and failures
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert_same((losses, cm.state_dict()), after)
    assert cm.runtime.ahead.redone > 0 and cm.runtime.ahead.adopted > 0
