"""From a recorded step to decisions: budgets, the steady accesses, the homes and the plan, on hand-made
records whose best answers are worked out here."""

from __future__ import annotations

import dataclasses

import pytest

from chunkmem.chunks.plan import Access, build_plan, planned_rule, simulate, validate
from chunkmem.chunks.planning import Event, GroupChunks, Step, chunk_budgets, decide_homes, fits, steady_sequence


def group(i: int, size: int = 10, streamed: int = 10) -> GroupChunks:
    return GroupChunks(i, f"param.{i}", f"grad.{i}", (f"exp_avg.{i}",), 3 * size, streamed)


def sizes_of(groups: list[GroupChunks], size: int = 10) -> dict[str, int]:
    return {n: size for g in groups for n in (g.param, g.grad, *g.updated)}


def training_step(groups: list[GroupChunks], nonmodel: int = 0, peak: int = 0) -> list[Event]:
    """Forward over the groups in order, backward in reverse (a gradient per group), then the optimizer;
    `peak` non-model bytes at the end of forward, where activations are largest."""
    forward = [Event("use", (g.param,), -1, nonmodel) for g in groups]
    forward[-1] = Event("use", (groups[-1].param,), -1, peak or nonmodel)
    backward = [e for g in reversed(groups) for e in (Event("use", (g.param,), -1, nonmodel),
                                                      Event("grad", (g.grad,), g.index, nonmodel))]
    return forward + backward + [Event("optim", (), g.index, nonmodel) for g in groups]


def test_budget_is_what_the_steps_non_model_peak_leaves_less_the_margin_at_every_access():
    accesses = [Access(("a",)), Access(("b",)), Access(("c",))]
    budgets = chunk_budgets(accesses, [0, 500, 100], {"a": 10, "b": 10, "c": 10}, limit=1000)
    assert budgets == [1000 - 500 - 50] * 3, "one budget a step: chunk memory does not flow to activations"
    assert chunk_budgets(accesses, [0, 500, 100], {"a": 10, "b": 10, "c": 10}, limit=1000, peak=700) == [250] * 3
    assert chunk_budgets([Access(("a",))], [2000], {"a": 10}, 1000) == [10], "never below the access's own need"


def test_a_homed_groups_update_counts_its_scratch_beside_what_was_recorded():
    groups = [dataclasses.replace(group(0), scratch=25), group(1)]
    events = training_step(groups, nonmodel=5, peak=20)
    _, nonmodel = steady_sequence(events, {g.index: g for g in groups}, {0, 1})
    assert nonmodel[-2:] == [5 + 25, 5], "the warm-up updated on the host: its record has none of the temporaries"
    step = Step.of(events, {g.index: g for g in groups}, {0, 1}, sizes_of(groups), limit=1000)
    assert step.budgets[0] == 1000 - 30 - 50, "one budget a step: the update's peak is above the forward's"


def test_everything_that_fits_is_homed_and_nothing_when_there_is_no_room():
    groups = [group(0), group(1)]
    events, sizes = training_step(groups), sizes_of(groups)
    assert decide_homes(events, groups, sizes, limit=1000).homes == {0, 1}, "everything fits: all home"
    assert decide_homes(events, groups, sizes, limit=20).homes == set(), "no room: the optimizer runs on the host"
    accesses, _ = steady_sequence(events, {g.index: g for g in groups}, {1})
    assert [a.chunks for a in accesses] == [("param.0",), ("param.1",), ("param.1",), ("grad.1",), ("param.0",),
                                            ("param.1", "grad.1", "exp_avg.1")]


def test_a_near_empty_group_streams_and_the_full_one_is_homed_though_backward_needs_it_last():
    # Room for one group's chunks beside the stream. Group 1 comes first in backward (PatrickStar keeps
    # those) but its chunk holds one parameter byte: homing it saves 1 streamed byte and its re-upload;
    # homing group 0 saves 10 and the same re-upload.
    groups = [group(0, streamed=10), group(1, streamed=1)]
    events, sizes = training_step(groups), sizes_of(groups)
    limit = 50  # 48 for chunks: one group's parameter, state and gradient (30) beside the other's parameter
    step = decide_homes(events, groups, sizes, limit)
    assert step.homes == {0}
    by_index = {g.index: g for g in groups}
    costs = {homes: _cost(events, by_index, sizes, limit, homes) for homes in ((), (0,), (1,))}
    assert costs[(0,)] < costs[(1,)] < costs[()]


def _cost(events, groups, sizes, limit, homes) -> int:
    from chunkmem.chunks.planning import step_cost

    return step_cost(Step.of(events, groups, homes, sizes, limit), groups, sizes)


@pytest.mark.parametrize("peak,one_budget,homed", [(35, True, 2), (50, False, 2), (55, False, 1)])
def test_every_group_is_homed_where_all_chunks_fit_beside_each_accesss_non_model_data(peak, one_budget, homed):
    # Activations peak at the end of forward, then go as backward writes the gradient chunks (planning's Note on a
    # step that holds everything). Both groups' kept chunks (40), with a chunk (10) to spare, fit beside a peak of
    # 50 though not the one budget a step (100 - 50 - 5 = 45 for 40 and, in backward, 20 of gradients). At 55 they
    # do not: the one budget (40) holds one group's chunks and gradient.
    groups = [group(0), group(1)]
    events, sizes = training_step(groups, nonmodel=0, peak=peak), sizes_of(groups)
    limit = 100
    by_index = {g.index: g for g in groups}
    assert fits(Step.of(events, by_index, {0, 1}, sizes, limit), by_index, sizes) == one_budget
    step = decide_homes(events, groups, sizes, limit)
    assert len(step.homes) == homed
    if homed == 2:
        assert min(step.budgets) == sum(sizes.values()), "all homed: the plan moves nothing"


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


def test_a_clean_chunk_leaves_before_a_dirty_one_needed_no_sooner():
    # Room for two. At c, `s` (changed on the device) and `a` (clean) are both needed again at the end:
    # plain Belady may evict `s` and pay its write-back; the plan evicts `a`, one fetch instead of two copies.
    accesses = [Access(("s",), frozenset({"s"})), Access(("a",)), Access(("c",)), Access(("a", "s"))]
    sizes, budgets = {"s": 10, "a": 10, "c": 10}, [20] * 4
    plan = build_plan(accesses, sizes, budgets)
    assert "@2 evict a" in map(str, plan.actions)
    moved = simulate(accesses, sizes, budgets, planned_rule(accesses))
    assert (moved["h2d"], moved["d2h"]) == (40, 0)


def test_what_the_next_step_needs_first_stays_at_the_step_end():
    # a, b, c, a, d with room for two: at d, `a` (needed first by the next step) stays and `c` goes.
    accesses = [Access((n,)) for n in "abcad"]
    sizes = {n: 10 for n in "abcd"}
    plan = build_plan(accesses, sizes, [20] * 5, carried=set(sizes))
    assert "@4 evict c" in map(str, plan.actions) and "@4 evict a" not in map(str, plan.actions)


def test_the_homes_search_leaves_a_local_optimum_single_moves_cannot_leave() -> None:
    """Issue 35, item 12: the descent stopped where every add, drop and swap of one group was worse. Here
    {1, 3} is such a place; one group out for two in reaches {0, 2, 3}, and a swap from there the optimum."""
    from chunkmem.chunks.planning import _descend

    costs = {frozenset({1, 3}): 10, frozenset({0, 2, 3}): 9, frozenset({0, 2, 4}): 5}
    evaluated = []

    def score(homes: frozenset[int]) -> tuple[int, int]:
        evaluated.append(homes)
        return costs.get(homes, 20), -len(homes)

    groups = [group(i) for i in range(6)]
    assert _descend(frozenset({1, 3}), groups, score, lambda homes: len(homes) <= 3, lambda: False) == {0, 2, 4}


def test_the_homes_search_spends_at_most_its_evaluations_per_seed(monkeypatch) -> None:
    """With many groups the last pass, the one that finds no better move, must stop at the cap too."""
    from chunkmem.chunks import planning

    monkeypatch.setattr(planning, "EVALUATIONS_PER_SEED", 300)
    evaluated = []

    def score(homes: frozenset[int]) -> tuple[int, int]:
        evaluated.append(homes)
        return 1, 0  # nothing is better: every move is tried until the cap

    groups = [group(i) for i in range(40)]  # 20 in, 20 out: 440 single moves, thousands of pair moves
    start = frozenset(range(20))
    assert planning._descend(start, groups, score, lambda homes: True, lambda: False) == start
    assert len(evaluated) <= 2 * 300  # each move scores itself and the current homes


def test_the_homes_search_stops_once_all_seeds_together_priced_their_share() -> None:
    """Issue 36: uncapped, a 20-layer LLaMA's search priced 12,503 sets of homes over its seeds, 6 minutes of
    planning; decide_homes stops every seed's descent once PRICED_SETS are priced (`spent_all`)."""
    from chunkmem.chunks import planning

    priced: set[frozenset[int]] = set()

    def score(homes: frozenset[int]) -> tuple[int, int]:
        priced.add(homes)
        return 1, 0

    groups, start = [group(i) for i in range(40)], frozenset(range(20))
    assert planning._descend(start, groups, score, lambda homes: True, lambda: len(priced) >= 50) == start
    assert len(priced) <= 50 + 1  # the move that reached the cap, then no more
