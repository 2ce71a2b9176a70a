"""The fewest bytes one steady training step can move, as an integer program: a reference for the planner.

chunkmem's plan (chunkmem/chunks/placement.py) is a heuristic: Belady's rule, homes chosen among a few
candidates. This module says what the best plan moves, written apart from chunkmem's code so that it
can judge it: it reads only the raw record of a warm-up step, never chunkmem's planning functions.
The problem (one recorded step, homes, budgets, costs, the cyclic steady state) is written down in
benchmarks/placement_problem.py; `benchmarks/policies.py` replays LRU and Belady under the same rules.

The program
-----------
A schedule can always be put in a normal form at no extra cost and no extra memory at any access:
between two consecutive accesses a and b of a chunk (in cyclic order; for a gradient chunk, within
the step and from its last access to the step's end), either the chunk stays resident throughout or
it leaves right after a and comes back right before b (staying part of the way, or coming back
early, holds memory and saves nothing). So:
  h_g in {0,1}   group g homed;                      keep_j in {0,1}  chunk stays through interval j;
  dirty_p in [0,1]  the chunk is dirty after access p; back_j >= 0      it is written back after j's start.
Accesses of a group's own chunks at its "grad"/"optim" happen iff h_g (act_p = h_g, else 1).
  keep_j <= act of both ends       (a streamed group's update rewrites its chunks on the host: nothing
                                    is carried through it, and a gradient chunk never comes);
  dirty_p >= act_p                 where access p writes the chunk;
  dirty_b >= dirty_a + keep_j - 1  (kept, it stays dirty);        back_j >= dirty_a - keep_j;
  memory at each event t: sum of sizes of the chunks accessed at t (times act) and of the intervals
  kept across t, <= b_t when t is a device access (a row that binds only then; big-M: the largest
  budget any device access since the last "use" can have; _budget_rows).
  minimise  sum_j size * (act_b - keep_j) (not for an empty gradient chunk) + size * back_j
            + sum_g streamed_g * (1 - h_g).
Integral solutions are exactly the normal-form schedules, so the optimum is exact (HiGHS, gap 0);
`solve` replays the schedule it returns (`steady_cost`, with every budget checked) and asserts that
the replay moves what the program says. tests/test_optimum.py compares it with a brute force over
every residency at every access on tiny steps.

The lower bound
---------------
`lower_bound` solves the linear relaxation (0 <= h, keep <= 1). Every schedule is feasible for it
at its own cost, so its optimum is at most the exact one. It bounds more: a schedule that repeats
only every P steps (LRU can cycle so) is a solution of the P-step program, and averaging its P
shifted copies gives a one-step fractional solution of its average cost; the relaxation is
therefore below any steady schedule, periodic or not, under any homes. A MIP stopped by its time
limit also reports HiGHS's proven bound, which is at least the relaxation's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence

import highspy
import numpy as np

from benchmarks.placement_problem import Action, Instance, steady_cost

__all__ = ["Instance", "Solution", "lower_bound", "solve"]


@dataclasses.dataclass(frozen=True)
class Solution:
    bytes: int  # per cycle of `steps` steps: fetches + write-backs + streamed gradients (the best found)
    homes: frozenset[int]
    start: frozenset[str]  # resident when the cycle starts
    schedule: tuple[Action, ...]  # events of all `steps` copies, numbered on
    optimal: bool  # proven optimal (else `bytes` is the best found within the time limit)
    bound: int  # proven lower bound on `bytes`
    seconds: float
    steps: int = 1

    @property
    def per_step(self) -> float:
        return self.bytes / self.steps

    def __str__(self) -> str:
        return "\n".join([f"{self.bytes} bytes, homes {sorted(self.homes)}, start {sorted(self.start)}",
                          *map(str, self.schedule)])


END = -1  # an interval's end: the step's end, where zero_grad frees a gradient chunk


@dataclasses.dataclass(frozen=True)
class _Interval:
    chunk: str
    a: int  # access index of its start
    b: int  # access index of its end (b <= a: it wraps into the next step; END: the step's end)


class _Program:
    """Columns and rows of the program, built once per instance (see the module docstring)."""

    def __init__(self, instance: Instance, homes: frozenset[int] | None) -> None:
        self.instance = instance
        sizes = instance.sizes
        self.unit = math.gcd(*sizes.values()) or 1  # rows count sizes in this unit: smaller, exact numbers
        self.cost_unit = math.gcd(self.unit, *(g.streamed for g in instance.groups)) or 1
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.offset = float(instance.streamed(()))
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.h = {g.index: self._col(0.0, 1.0, -g.streamed * instance.steps) for g in instance.groups}
        if homes is not None:
            for g, col in self.h.items():
                self.lower[col] = self.upper[col] = float(g in homes)
        n = len(instance.accesses)
        self.step_end = [max(j for j in range(k, n) if instance.accesses[j].step == a.step)
                         for k, a in enumerate(instance.accesses)]
        self.positions: dict[str, list[int]] = {}
        for k, access in enumerate(instance.accesses):
            for name in access.chunks:
                self.positions.setdefault(name, []).append(k)
        self.keep: dict[_Interval, int] = {}
        self.dirty: dict[tuple[str, int], int] = {}
        for name, where in self.positions.items():
            self._chunk(name, where)
        self._budget_rows()

    def _col(self, lower: float, upper: float, cost: float) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        return len(self.cost) - 1

    def _row(self, terms: dict[int, float], lower: float, upper: float) -> None:
        self.rows.append((terms, lower, upper))

    def act(self, k: int) -> int | None:
        """The h column an access depends on, None if it always happens."""
        group = self.instance.accesses[k].group
        return None if group is None else self.h[group]

    def _chunk(self, name: str, where: list[int]) -> None:
        instance, size = self.instance, self.instance.sizes[name]
        fresh = name in instance.fresh
        pairs = list(zip(where, where[1:])) + [(where[-1], END if fresh else where[0])]
        written = [k for k in where if name in instance.accesses[k].writes]
        for k in written:  # dirty_p >= act_p
            col = self.dirty[name, k] = self._col(0.0, 1.0, 0.0)
            act = self.act(k)
            self._row({col: 1.0, act: -1.0} if act is not None else {col: 1.0}, 0.0 if act is not None else 1.0, math.inf)
        for k in where:
            if written and (name, k) not in self.dirty:
                self.dirty[name, k] = self._col(0.0, 1.0, 0.0)
        first_write = min(written, default=math.inf)
        for a, b in pairs:
            keep = self.keep[_Interval(name, a, b)] = self._col(0.0, 1.0, 0.0)
            for end in {self.act(a), None if b == END else self.act(b)}:  # keep <= act of both ends
                if end is not None:
                    self._row({keep: 1.0, end: -1.0}, -math.inf, 0.0)
            if b != END and not (fresh and b <= first_write):  # fetch: size * (act_b - keep); empty comes free
                self.cost[keep] -= size
                act = self.act(b)
                if act is None:
                    self.offset += size
                else:
                    self.cost[act] += size
            if written:
                da = self.dirty[name, a]
                if b not in (a, END):
                    db = self.dirty[name, b]
                    self._row({db: 1.0, da: -1.0, keep: -1.0}, -1.0, math.inf)  # dirty_b >= dirty_a + keep - 1
                back = self._col(0.0, math.inf, float(size))
                self._row({back: 1.0, da: -1.0, keep: 1.0}, 0.0, math.inf)  # back >= dirty_a - keep

    def _occupancy(self) -> list[dict[int, float]]:
        """Per event, chunk bytes resident as a linear expression (the constant part under key -1)."""
        n = len(self.instance.accesses)
        occupancy: list[dict[int, float]] = [{} for _ in range(n)]
        for k, access in enumerate(self.instance.accesses):
            act = self.act(k)
            occupancy[k][-1 if act is None else act] = self.instance.need(access) / self.unit
        for interval, col in self.keep.items():
            a, b = interval.a, interval.b
            spans = range(a + 1, self.step_end[a] + 1) if b == END else range(a + 1, b) if a < b \
                else [*range(a + 1, n), *range(0, b)]
            for t in spans:
                occupancy[t][col] = self.instance.sizes[interval.chunk] / self.unit
        return occupancy

    def _budget_rows(self) -> None:
        """memory_t <= b_t at every device access t, a row that binds only when t is one. Its big-M is the
        ceiling: the largest budget any device access since the last "use" can have, which memory at t never
        exceeds (an event that is not a device access holds at most what the device access before it held)."""
        caps = [self.instance.budget(access) // self.unit for access in self.instance.accesses]
        ceilings = self._ceilings(caps)
        for t, memory in enumerate(self._occupancy()):
            constant = memory.pop(-1, 0.0)
            self._row(memory, -math.inf, ceilings[t] - constant)
            self._switched(memory, caps[t] - constant, ceilings[t] - caps[t], on=[t], off=[])

    def _ceilings(self, largest: list[int]) -> list[int]:
        out, since_use = [], None
        for t, access in enumerate(self.instance.accesses):
            since_use = largest[t] if access.group is None else None if since_use is None else max(since_use, largest[t])
            out.append(sum(self.instance.sizes.values()) // self.unit if since_use is None else since_use)
        return out

    def _switched(self, memory: dict[int, float], rhs: float, big: int, on: list[int | None], off: list[int]) -> None:
        """memory <= rhs + big * (sum over `on` of (1 - act) + sum over `off` of act)."""
        if big <= 0:
            return  # the ceiling's row says as much
        terms = dict(memory)
        for k in on:
            col = None if k is None else self.act(k)
            if col is not None:
                terms[col] = terms.get(col, 0.0) + big
                rhs += big
        for k in off:
            col = self.act(k)
            assert col is not None, "only a conditional access can lie between t and its next candidate"
            terms[col] = terms.get(col, 0.0) - big
        self._row(terms, -math.inf, rhs)

    def highs(self, integral: bool, time_limit: float) -> highspy.Highs:
        h = highspy.Highs()
        h.silent()
        h.setOptionValue("threads", 1)
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 0.5)  # the objective counts whole units: 0.5 short of one is exact
        scale = float(self.cost_unit)
        n = len(self.cost)
        h.addCols(n, np.array(self.cost) / scale, np.array(self.lower), np.array(self.upper), 0,
                  np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([], dtype=np.float64))
        starts: list[int] = []
        index: list[int] = []
        value: list[float] = []
        lower: list[float] = []
        upper: list[float] = []
        for terms, lo, up in self.rows:
            starts.append(len(index))
            index += list(terms)
            value += list(terms.values())
            lower.append(lo)
            upper.append(up)
        h.addRows(len(self.rows), np.array(lower, dtype=np.float64), np.array(upper, dtype=np.float64), len(index),
                  np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value, dtype=np.float64))
        h.changeObjectiveOffset(self.offset / scale)
        if integral:
            binaries = [*self.h.values(), *self.keep.values()]
            h.changeColsIntegrality(len(binaries), np.array(binaries, dtype=np.int32),
                                    np.full(len(binaries), highspy.HighsVarType.kInteger, dtype=np.uint8))
        return h

    def schedule(self, values: Sequence[float]) -> tuple[frozenset[int], frozenset[str], tuple[Action, ...]]:
        homes = frozenset(g for g, col in self.h.items() if values[col] > 0.5)
        accesses = self.instance.accesses
        active = [self.instance.on_device(a, homes) for a in accesses]
        start: set[str] = set()
        actions: list[Action] = []
        for name, where in self.positions.items():
            kept = {(i.a, i.b) for i, col in self.keep.items() if i.chunk == name and values[col] > 0.5}
            fresh = name in self.instance.fresh
            for k, prev, nxt in zip(where, [where[-1], *where[:-1]], [*where[1:], END if fresh else where[0]]):
                if not active[k]:
                    continue
                if (prev, k) not in kept:
                    actions.append(Action(accesses[k].event, "fetch", name))
                elif prev >= k:
                    start.add(name)  # kept across the step's end
                if (k, nxt) not in kept:
                    actions.append(Action(accesses[k].event, "evict", name))
        return homes, frozenset(start), tuple(sorted(actions, key=lambda a: (a.at, a.verb == "evict", a.chunk)))


def solve(instance: Instance, homes: Iterable[int] | None = None, time_limit: float = 60.0,
          period: int = 1) -> Solution:
    """The cheapest cyclic steady step; over every choice of homes unless `homes` is given. With
    `period` P, the cheapest cycle of P steps (which can be below P times the best single step)."""
    began = time.perf_counter()
    if period > 1:
        instance = instance.repeated(period)
    program = _Program(instance, None if homes is None else frozenset(homes))
    h = program.highs(integral=True, time_limit=time_limit)
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    if info.primal_solution_status != highspy.kSolutionStatusFeasible:
        raise RuntimeError(f"HiGHS found no schedule within {time_limit} s ({h.modelStatusToString(status)}): "
                           "raise the time limit or use lower_bound()")
    chosen, start, schedule = program.schedule(list(h.getSolution().col_value))
    value = steady_cost(instance, chosen, start, schedule)  # the replay's count, not the solver's float
    claimed = round(info.objective_function_value * program.cost_unit)
    optimal = status == highspy.HighsModelStatus.kOptimal
    # Optimal, the program's count must be the replay's (a dirty flag above need only adds cost elsewhere).
    assert value == claimed if optimal else value <= claimed, \
        f"the program says {claimed} bytes, its schedule moves {value}: the program and the replay disagree"
    bound = value if optimal else _whole(info.mip_dual_bound * program.cost_unit, program.cost_unit)
    return Solution(value, chosen, start, schedule, optimal, bound, time.perf_counter() - began, instance.steps)


def lower_bound(instance: Instance, homes: Iterable[int] | None = None, time_limit: float = 600.0) -> float:
    """The linear relaxation's optimum (less the solver's tolerance): bytes per step that no schedule,
    repeating every step or every few, goes below. Not rounded up to whole units: an average over
    a cycle of several steps need not be whole."""
    program = _Program(instance, None if homes is None else frozenset(homes))
    h = program.highs(integral=False, time_limit=time_limit)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"the relaxation did not solve: {h.modelStatusToString(h.getModelStatus())}")
    value = h.getInfo().objective_function_value * program.cost_unit
    return max(0.0, value - 1e-6 * max(1.0, abs(value)))


def _whole(value: float, unit: int) -> int:
    """The least multiple of `unit` at or above `value`, less a solver's tolerance."""
    return max(0, math.ceil(value / unit - 1e-6) * unit)
