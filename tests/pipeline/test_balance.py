"""Balance: the partition is the optimal block partition under memory budgets; profiling measures."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from chunkmem.errors import MemoryBudgetError
from chunkmem.pipeline.balance import LayerCost, StageNeeds, even_counts, partition, profile, stage_bytes

NEVER = StageNeeds(1, "never")


def costs(times: list[float], params: int = 100, act: int = 10) -> list[LayerCost]:
    return [LayerCost(t, params, act, 4) for t in times]


def brute_force(layer_costs: list[LayerCost], k: int, budgets: list, needs: list) -> float:
    best = float("inf")
    n = len(layer_costs)
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        stages = [layer_costs[a:b] for a, b in zip(bounds, bounds[1:])]
        inputs = [8] + [layer_costs[a - 1].output_bytes for a in bounds[1:-1]]
        if all(b is None or stage_bytes(s, i, nd) <= b for s, i, b, nd in zip(stages, inputs, budgets, needs)):
            best = min(best, max(sum(c.seconds for c in s) for s in stages))
    return best


def slowest(layer_costs: list[LayerCost], counts: list[int]) -> float:
    bounds = list(itertools.accumulate([0, *counts]))
    return max(sum(c.seconds for c in layer_costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_partition_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(40):
        n, k = rng.randint(3, 9), rng.randint(2, 3)
        layer_costs = [LayerCost(rng.uniform(0.1, 3.0), rng.randint(1, 50), rng.randint(1, 50), 4) for _ in range(n)]
        needs = [StageNeeds(min(2, k - s), rng.choice(["never", "always", "except_last"])) for s in range(k)]
        budgets = [rng.choice([None, 120, 200]) for _ in range(k)]
        expected = brute_force(layer_costs, k, budgets, needs)
        if expected == float("inf"):
            with pytest.raises(MemoryBudgetError, match="raise Config.device_memory"):
                partition(layer_costs, k, 8, budgets, needs)
            continue
        counts = partition(layer_costs, k, 8, budgets, needs)
        assert sum(counts) == n and len(counts) == k and min(counts) >= 1
        assert slowest(layer_costs, counts) == pytest.approx(expected)


def test_a_slow_layer_gets_a_stage_of_its_own() -> None:
    assert partition(costs([1, 1, 1, 6, 1, 1]), 3, 8, [None] * 3, [NEVER] * 3) == [3, 1, 2]


def test_every_stage_gets_parameters() -> None:
    layer_costs = [LayerCost(1, 100, 10, 4), LayerCost(5, 0, 10, 4), LayerCost(1, 100, 10, 4)]
    assert partition(layer_costs, 2, 8, [None] * 2, [NEVER] * 2) in ([1, 2], [2, 1])
    free_first = [LayerCost(4, 0, 10, 4), LayerCost(1, 100, 10, 4), LayerCost(4, 100, 10, 4)]
    assert partition(free_first, 2, 8, [None] * 2, [NEVER] * 2) == [2, 1], "[1, 2] is faster but stage 0 has no parameters"


def test_budget_moves_layers_off_a_small_stage() -> None:
    # Stage 0 may hold the activations of one layer only (working set 100 + 10 each).
    assert partition(costs([1, 1, 1, 1]), 2, 8, [110, None], [NEVER, NEVER]) == [1, 3]


def test_checkpointing_lowers_the_memory_estimate_and_re_computes_with_every_layers_parameters() -> None:
    # The stage re-computes under one non-reentrant checkpoint, which holds every layer's chunks until its backward
    # is done: a split counting the largest layer's alone was accepted and ran out of its budget in that backward.
    layer_costs = costs([1, 1, 1], act=50)
    assert stage_bytes(layer_costs, 8, StageNeeds(4, "never")) == 100 + 4 * 150
    assert stage_bytes(layer_costs, 8, StageNeeds(4, "always")) == 3 * 100 + 4 * 8 + 150
    assert stage_bytes(layer_costs, 8, StageNeeds(4, "except_last")) == 3 * 100 + 3 * 8 + 150


def test_parameters_are_counted_in_whole_chunks_where_their_size_is_known() -> None:
    # 300 bytes of parameters fill 3 chunks of 128 bytes, and a layer may straddle two: 4 chunks.
    layer_costs = costs([1, 1, 1], act=50)
    assert stage_bytes(layer_costs, 8, StageNeeds(4, "always", chunk_bytes=128)) == 4 * 128 + 4 * 8 + 150
    assert stage_bytes(layer_costs, 8, StageNeeds(4, "never", chunk_bytes=128)) == 2 * 128 + 4 * 150


def test_too_many_stages_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="at most 2 stages"):
        partition(costs([1, 1]), 3, 8, [None] * 3, [NEVER] * 3)
    assert even_counts(7, 3) == [3, 2, 2]


def test_profile_measures_time_parameters_and_activations() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)]
    measured = profile(layers, torch.randn(5, 16), torch.device("cpu"), torch.float32, repeats=1)
    assert [c.param_bytes for c in measured] == [(16 * 32 + 32) * 4, 0, (32 * 4 + 4) * 4]
    assert [c.output_bytes for c in measured] == [5 * 32 * 4, 5 * 32 * 4, 5 * 4 * 4]
    assert measured[0].activation_bytes == 5 * 16 * 4, "Linear saves its input, not its weight"
    assert measured[1].activation_bytes == 5 * 32 * 4, "Tanh saves its output"
    assert all(c.seconds > 0 for c in measured)
