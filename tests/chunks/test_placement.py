"""Warm-up placement on the real runtime: plans, homes, re-warm, fallback, activations."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch

import chunkmem
from chunkmem.chunks.placement import Event, GroupChunks, Phase, chunk_budgets, decide_homes, steady_sequence
from chunkmem.chunks.plan import INFINITY, Access, build_plan, next_uses, simulate, validate
from tests.helpers import gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss, param_bytes, prepared, tiny_gpt2, train

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def group(i: int, size: int = 10) -> GroupChunks:
    return GroupChunks(i, f"param.{i}", f"grad.{i}", (f"exp_avg.{i}",), 3 * size)


def test_budget_is_what_non_model_data_leaves_now_and_next_less_the_margin():
    accesses = [Access(("a",)), Access(("b",)), Access(("c",))]
    budgets = chunk_budgets(accesses, [0, 500, 100], {"a": 10, "b": 10, "c": 10}, limit=1000)
    assert budgets == [1000 - 500 - 50, 1000 - 500 - 50, 1000 - 100 - 50]
    assert chunk_budgets([Access(("a",))], [2000], {"a": 10}, 1000) == [10], "never below the access's own need"


def test_homes_take_what_the_margin_holds_and_pay_off():
    groups = [group(0), group(1)]
    sizes = {n: 10 for g in groups for n in (g.param, g.grad, *g.updated)}
    events = [Event("use", ("param.0",), -1, 0), Event("use", ("param.1",), -1, 0),
              Event("use", ("param.1",), -1, 0), Event("grad", ("grad.1",), 1, 0),
              Event("use", ("param.0",), -1, 0), Event("grad", ("grad.0",), 0, 0),
              Event("optim", (), 0, 0), Event("optim", (), 1, 0)]
    assert decide_homes(events, groups, sizes, limit=1000) == {0, 1}, "everything fits: all home"
    assert decide_homes(events, groups, sizes, limit=20) == set(), "no margin: the optimizer runs on the host"
    accesses, _ = steady_sequence(events, {g.index: g for g in groups}, {1})
    assert [a.chunks for a in accesses] == [("param.0",), ("param.1",), ("param.1",), ("grad.1",), ("param.0",),
                                            ("param.1", "grad.1", "exp_avg.1")]


def test_chunks_held_around_an_access_count_in_its_budget_and_stay_resident():
    # An adapter's chunk stays pinned while the base it calls runs: the plan must hold both at once.
    events = [Event("use", ("param.0",), -1, 0), Event("use", ("frozen_param.0",), -1, 0, held=("param.0",)),
              Event("use", ("param.1",), -1, 0)]
    sizes = {"param.0": 10, "param.1": 10, "frozen_param.0": 10}
    accesses, nonmodel = steady_sequence(events, {}, set())
    assert [a.chunks for a in accesses] == [("param.0",), ("frozen_param.0", "param.0"), ("param.1",)]
    budgets = chunk_budgets(accesses, [1000] * 3, sizes, limit=100)  # activations leave nothing: the need only
    assert budgets == [10, 20, 10]
    assert validate(build_plan(accesses, sizes, budgets), accesses, sizes) == {"param.1"}


def steady_run(model, batches, loss_fn, budget):
    cm, opt = prepared(model, ADAMW, device_memory=budget)
    train(cm, opt, batches[:2], loss_fn)
    placer = cm.runtime.placer
    # The host optimizer's rewritten parameter chunks go up during that step (counted in `moved`): a
    # replay starts without them and fetches them on demand.
    start = set(placer.start) - {g.param for g in placer.groups if g.index not in placer.homes}
    dirty = {c.name for c in cm.runtime.store.chunks() if c.state.name == "DEVICE_DIRTY"}
    before = cm.memory_stats()
    losses = train(cm, opt, batches[2:3], loss_fn)
    after = cm.memory_stats()
    moved = sum(after[k] - before[k] for k in ("h2d_bytes", "d2h_bytes")) - \
        (after["grad_stream_bytes"] - before["grad_stream_bytes"])
    return cm, placer, start, dirty, moved, losses


def test_steady_state_moves_exactly_what_the_optimum_moves_on_the_recorded_sequence():
    model, batches = tiny_gpt2(), gpt2_batches(3)
    probe, *_ = steady_run(model, batches, gpt2_loss, None)
    budget = probe.runtime.activations.peak + param_bytes(model) // 3
    cm, placer, start, dirty, moved, _ = steady_run(model, batches, gpt2_loss, budget)
    assert placer.phase is Phase.FOLLOW and cm.runtime.warmup is False
    accesses, budgets = placer.follower.accesses, placer.follower.plan.budgets
    nexts = next_uses(accesses)
    grads = {c.name for c in cm.runtime.store.chunks() if c.name.startswith("grad")}
    best = simulate(accesses, placer.sizes, budgets, lambda i, held, _: max(
        held, key=lambda c: nexts[i].get(c, INFINITY)), resident=start, dirty=dirty, free=grads)
    assert moved == best["h2d"] + best["d2h"] > 0
    stats = cm.memory_stats()
    assert stats["prefetches"] > 0 and stats["device_chunk_bytes_peak"] <= stats["device_limit_bytes"]


def test_a_larger_input_re_records_and_results_stay_identical(caplog):
    model = tiny_gpt2()
    longer = [torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(9))]
    batches = gpt2_batches(3) + longer + gpt2_batches(2)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) * 8)
    phases, losses = [], []
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        for batch in batches:
            phases.append(cm.runtime.placer.phase)
            losses += train(cm, opt, [batch], gpt2_loss)
    assert phases == [Phase.RECORD, Phase.FOLLOW, Phase.FOLLOW, Phase.FOLLOW, Phase.RECORD, Phase.FOLLOW]
    assert any("non-model data at chunk access" in r.getMessage() for r in caplog.records)
    assert losses == expected
    state, ref_state = cm.state_dict(), ref.state_dict()
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_another_branch_re_records(caplog):
    from tests.runtime.test_parity import Awkward

    model = Awkward()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)]
    branch = [False, False, True, False]
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0], use_branch=branch.pop(0)), b[1])  # noqa: E731
    cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) // 2)
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        train(cm, opt, batches, loss_fn)
    assert any("another branch" in r.getMessage() for r in caplog.records)
    assert cm.runtime.placer.phase is Phase.FOLLOW, "the step after the branch was recorded and planned"


def test_out_of_memory_falls_back_and_the_step_completes_identically(caplog):
    model, batches = mlp(), mlp_batches(4)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, mlp_loss)
    cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) // 2)
    losses = train(cm, opt, batches[:2], mlp_loss)
    cm.runtime.device.fail_allocations = 1
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        losses += train(cm, opt, batches[2:], mlp_loss)
    assert cm.memory_stats()["oom_fallbacks"] == 1
    assert any("out of memory" in r.getMessage() for r in caplog.records)
    assert losses == expected
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


class FlakyTanh(torch.nn.Module):
    """tanh through an op that runs out of device memory the next `failures` times, as a large
    activation would. The op takes part in torch-function dispatch like a torch op."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)

    def op(self, x: torch.Tensor) -> torch.Tensor:
        if torch.overrides.has_torch_function((x,)):
            return torch.overrides.handle_torch_function(self.op, (x,), x)
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("simulated: no device memory for an activation")
        return torch.tanh(x)


def test_out_of_memory_in_a_forward_op_falls_back_and_the_step_completes_identically(caplog):
    model, batches = torch.nn.Sequential(FlakyTanh(), mlp()), mlp_batches(5)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, mlp_loss)
    cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) // 2)
    losses = train(cm, opt, batches[:2], mlp_loss)
    assert cm.runtime.placer.phase is Phase.FOLLOW
    flaky = cm.module[0]
    flaky.failures = 1
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        losses += train(cm, opt, batches[2:3], mlp_loss)
    assert flaky.failures == 0 and cm.memory_stats()["oom_fallbacks"] == 1
    assert any("out of memory in a forward op" in r.getMessage() for r in caplog.records)
    assert cm.runtime.placer.phase is Phase.RECORD, "the step after the fallback is recorded anew"
    losses += train(cm, opt, batches[3:], mlp_loss)
    assert cm.runtime.placer.phase is Phase.FOLLOW
    assert losses == expected
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_activation_meter_counts_saved_tensors_until_backward_frees_them():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    cm, _ = chunkmem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), chunkmem.Config(device="cpu"))
    out = cm(torch.randn(32, 64))
    # Linear 1 saves its input, tanh its output, Linear 2 its input (= tanh's output): two distinct storages.
    assert cm.runtime.activations.live == 2 * 32 * 64 * 4
    out.sum().backward()
    del out
    assert cm.runtime.activations.live == 0


def test_offloading_activations_keeps_results_and_lowers_the_device_peak():
    model, batches = tiny_gpt2(), gpt2_batches(3)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    results = {}
    for offload in (False, True):
        cm, opt = prepared(model, ADAMW, offload_activations=offload)
        cm.train()
        losses = train(cm, opt, batches, gpt2_loss)
        results[offload] = (losses, cm.state_dict(), cm.runtime.activations.peak, cm.memory_stats())
    assert results[True][0] == results[False][0]
    assert all(torch.equal(results[True][1][k], v) for k, v in results[False][1].items())
    assert results[True][2] < results[False][2] / 2
    assert results[True][3]["activation_offload_bytes"] > 0 == results[False][3]["activation_offload_bytes"]


@pytest.mark.parametrize("offload", [False, True])
def test_activation_checkpointing_with_chunks_moving_matches_plain_pytorch(offload: bool) -> None:
    # Re-computation in backward fetches evicted chunks again and must release them when it ends.
    model, batches = tiny_gpt2(), gpt2_batches(3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) // 4, offload_activations=offload)
    losses = train(cm, opt, batches, gpt2_loss)
    stats = cm.memory_stats()
    assert stats["h2d_bytes"] > stats["model_data_bytes"], "chunks must move for this test to mean anything"
    assert losses == expected
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


class DeviceBytes:
    """An observer: chunk bytes plus non-model bytes on the device at every moment of the warm-up."""

    def __init__(self, runtime) -> None:
        self.runtime, self.seen = runtime, []

    def moment(self, moment) -> None:
        if moment.warmup:
            self.seen.append(self.runtime.residency.stats.device_chunk_bytes + self.runtime.nonmodel_bytes())

    def moved(self, move) -> None:
        pass


@pytest.mark.parametrize("model_data_fits", [True, False])
def test_warm_up_gives_chunks_only_what_activations_leave(model_data_fits: bool) -> None:
    model, batches = tiny_gpt2(), [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(s))
                                   for s in range(3)]
    probe, _ = prepared(model, ADAMW)
    gpt2_loss(probe, batches[0]).backward()
    activations, model_data = probe.runtime.activations.peak, probe.memory_stats()["model_data_bytes"]
    # Model data fits but not with the activations; or activations take most of a budget it does not fit.
    limit = model_data + activations // 2 if model_data_fits else int(activations * 1.5)
    assert (limit >= model_data) == model_data_fits and limit < model_data + activations
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    cm, opt = prepared(model, ADAMW, device_memory=limit)
    meter = DeviceBytes(cm.runtime)
    cm.runtime.observers.append(meter)
    assert train(cm, opt, batches, gpt2_loss) == expected
    assert meter.seen and max(meter.seen) <= limit, f"warm-up held {max(meter.seen)} bytes, budget {limit}"


class Timeline:
    """An observer: moments of the optimizer, and uploads with their reason, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def moment(self, moment) -> None:
        if moment.stage == "optim" or moment.name == "pre_forward":
            self.events.append((moment.name, moment.where))

    def moved(self, move) -> None:
        if move.dst == "device":
            self.events.append((move.reason, move.chunk))


def test_host_updated_parameters_upload_during_the_optimizer_step_for_the_same_bytes():
    """Each streamed group's new parameter chunk goes up right after its host update (overlapping the
    next group's update on CUDA) instead of in the next forward, when the plan wants it at the start."""
    model, batches = tiny_gpt2(), gpt2_batches(5)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, gpt2_loss)
    moved, losses = {}, {}
    for early in (True, False):
        cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) * 3)
        if not early:
            cm.runtime.placer.updated_on_host = lambda chunk: None
        timeline = Timeline()
        losses[early] = train(cm, opt, batches[:3], gpt2_loss)
        before = cm.memory_stats()
        cm.runtime.observers.append(timeline)
        losses[early] += train(cm, opt, batches[3:], gpt2_loss)
        after = cm.memory_stats()
        moved[early] = (after["h2d_bytes"] - before["h2d_bytes"], after["d2h_bytes"] - before["d2h_bytes"])
        in_optimizer = [c for (r, c), prev in zip(timeline.events[1:], timeline.events)
                        if r == "prefetch" and c.startswith("param.") and prev[0] == "pre_optimizer"]
        assert bool(in_optimizer) == early, timeline.events
        assert len(cm.runtime.placer.homes) < len(cm.runtime.placer.groups), "some groups must stream"
    assert losses[True] == losses[False] == expected
    assert moved[True] == moved[False], "the same bytes, only earlier"


def test_evaluation_between_steps_leaves_the_plan_alone(caplog):
    model, batches = tiny_gpt2(), gpt2_batches(4)
    cm, opt = prepared(model, ADAMW, device_memory=param_bytes(model) * 2)
    train(cm, opt, batches[:2], gpt2_loss)
    with caplog.at_level(logging.WARNING, logger="chunkmem"), torch.no_grad():
        cm.eval()
        cm(batches[0])
        cm.train()
    train(cm, opt, batches[2:], gpt2_loss)
    assert cm.runtime.placer.phase is Phase.FOLLOW
    assert not [r for r in caplog.records if "warm-up recorded" in r.getMessage()]
