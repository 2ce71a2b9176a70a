"""The Belady plan on synthetic access traces with known answers."""

from __future__ import annotations

import pytest

from chunkmem.chunks.plan import INFINITY, Access, build_plan, next_uses, simulate, validate

# The textbook reference string: with 3 frames the optimum takes 7 faults and LRU 10.
REFERENCE = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


def trace(names: list[int]) -> list[Access]:
    return [Access((f"c{n}",)) for n in names]


def sizes_for(accesses: list[Access], size: int = 10) -> dict[str, int]:
    return {name: size for a in accesses for name in a.chunks}


def belady(accesses):
    nexts = next_uses(accesses)
    return lambda i, held, _: max(sorted(held), key=lambda c: nexts[i].get(c, INFINITY))


def lru(accesses):
    def rule(i, held, _):
        last = {c: max(j for j in range(i) if c in accesses[j].chunks) for c in held}
        return min(sorted(held), key=last.get)
    return rule


def test_plan_takes_the_optimal_number_of_fetches_on_the_textbook_string():
    accesses = trace(REFERENCE)
    sizes = sizes_for(accesses)
    budgets = [30] * len(accesses)
    plan = build_plan(accesses, sizes, budgets)
    fetches = [a for a in plan.actions if a.verb in ("fetch", "prefetch")]
    assert len(fetches) == 7
    assert simulate(accesses, sizes, budgets, belady(accesses))["fetches"] == 7
    assert simulate(accesses, sizes, budgets, lru(accesses))["fetches"] == 10
    validate(plan, accesses, sizes)


def test_plan_evicts_the_chunk_needed_furthest_away():
    accesses = trace([1, 2, 3, 1, 2])
    plan = build_plan(accesses, sizes_for(accesses), [20] * 5)
    # At c3, c1 is needed next at access 3 and c2 at access 4: c2 goes. LRU would evict c1.
    assert [str(a) for a in plan.actions if a.verb == "evict"] == ["@2 evict c2", "@4 evict c1"]
    assert sum(a.verb != "evict" for a in plan.actions) == 4


def test_prefetch_fills_free_room_and_never_exceeds_either_budget():
    accesses = trace([1, 2, 3, 4])
    plan = build_plan(accesses, sizes_for(accesses), [40] * 4)
    assert [str(a) for a in plan.actions] == ["@0 fetch c1", "@1 prefetch c2", "@2 prefetch c3", "@3 prefetch c4"]
    tight = build_plan(accesses, sizes_for(accesses), [40, 20, 40, 40])
    validate(tight, accesses, sizes_for(accesses))
    assert "@1 prefetch c2" in map(str, tight.actions) and "@2 prefetch c3" not in map(str, tight.actions)


def test_a_shrinking_budget_forces_evictions_even_without_a_new_chunk():
    accesses = trace([1, 2, 2, 1])
    plan = build_plan(accesses, sizes_for(accesses), [20, 20, 10, 20])
    assert "@2 evict c1" in map(str, plan.actions)
    validate(plan, accesses, sizes_for(accesses))


def test_chunks_needed_together_are_never_evicted_for_each_other():
    accesses = [Access(("a", "b")), Access(("c",)), Access(("a", "b"))]
    sizes = {"a": 10, "b": 10, "c": 10}
    plan = build_plan(accesses, sizes, [20, 20, 20])
    validate(plan, accesses, sizes)
    with pytest.raises(ValueError, match=r"access 0 needs 20 bytes of chunks at once \(a, b\) but its budget is 10"):
        build_plan(accesses, sizes, [10, 20, 20])


def test_write_backs_are_counted_only_for_changed_chunks():
    accesses = [Access(("a",), frozenset({"a"})), Access(("b",)), Access(("a",))]
    moved = simulate(accesses, {"a": 10, "b": 10}, [10, 10, 10], belady(accesses))
    assert moved["h2d"] == 30 and moved["d2h"] == 10
    free = simulate(accesses, {"a": 10, "b": 10}, [10, 10, 10], belady(accesses), free={"a"})
    assert free["h2d"] == 20, "a chunk without data (a fresh gradient) costs nothing to bring in"


def test_validate_rejects_a_plan_that_misses_a_chunk():
    accesses = trace([1, 2])
    plan = build_plan(accesses, sizes_for(accesses), [20, 20])
    with pytest.raises(ValueError, match="needs"):
        validate(plan, trace([1, 3]), sizes_for(trace([1, 2, 3])))
