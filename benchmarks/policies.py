"""Reference eviction policies, replayed on a recorded step under the optimum's rules and costs.

Written apart from chunkmem/chunks/plan.py: on-demand fetches, an eviction rule when the next access does
not fit its budget, and the accounting of `optimum.Device` (write-backs of dirty chunks, free empty
gradient chunks, host-rewritten chunks dropped, gradients freed at the step's end) plus the streamed
gradients of groups not homed. A policy's steady state is found by running steps from an empty
device until the state at a step's start repeats; a policy may cycle with a period of several
steps, and its cost is then the average over the cycle.

  lru:    evict the resident chunk accessed least recently (across steps).
  belady: evict the one whose next access is furthest away, counted into the next step (a gradient
          chunk has none after its last access: it is freed); Belady's MIN, optimal in fetches for
          chunks of one size without write-backs, which this problem has.
  belady-step: the same, looking no further than the step's end (ties broken by name): what the
          next step wants first is not seen.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from benchmarks.placement_problem import Access, Device, Instance

INFINITY = 1 << 62
RULES = ("lru", "belady", "belady-step")


@dataclasses.dataclass(frozen=True)
class Steady:
    bytes: float  # per step, averaged over the cycle: h2d + d2h + streamed
    h2d: float
    d2h: float  # write-backs only
    streamed: int
    period: int  # steps in the cycle the policy settles in


class _Lru:
    def __init__(self) -> None:
        self.clock = itertools.count()
        self.last: dict[str, int] = {}

    def accessed(self, t: int, names: Iterable[str]) -> None:
        for name in names:
            self.last[name] = next(self.clock)

    def victim(self, t: int, candidates: set[str]) -> str:
        return min(candidates, key=lambda c: (self.last.get(c, -1), c))

    def key(self, resident: set[str]) -> tuple[str, ...]:
        return tuple(sorted(resident, key=lambda c: self.last.get(c, -1)))


class _Belady:
    def __init__(self, sequence: list[Access], fresh: frozenset[str], cyclic: bool) -> None:
        n = len(sequence)
        self.next: list[dict[str, int]] = [{} for _ in sequence]
        upcoming: dict[str, int] = {}
        for t in range(2 * n - 1 if cyclic else n - 1, -1, -1):  # cyclic: uses in the next step count too
            if t < n:
                self.next[t] = dict(upcoming)
            for name in sequence[t % n].chunks:
                if t < n or name not in fresh:
                    upcoming[name] = t

    def accessed(self, t: int, names: Iterable[str]) -> None:
        pass

    def victim(self, t: int, candidates: set[str]) -> str:
        return min(candidates, key=lambda c: (-self.next[t].get(c, INFINITY), c))

    def key(self, resident: set[str]) -> tuple[str, ...]:
        return tuple(sorted(resident))


def simulate(instance: Instance, rule: str, homes: Iterable[int], max_steps: int = 64) -> Steady:
    """The steady step of on-demand placement by `rule` ("lru" or "belady") with `homes` homed."""
    homes = frozenset(homes)
    sequence = instance.device_accesses(homes)
    if rule not in RULES:
        raise ValueError(f"rule {rule!r}: expected one of {RULES}")
    policy = _Lru() if rule == "lru" else _Belady(sequence, instance.fresh, cyclic=rule == "belady")
    seen: dict[tuple, int] = {}
    costs: list[tuple[int, int]] = []
    resident: set[str] = set()
    dirty: set[str] = set()
    for step in range(max_steps):
        state = (policy.key(resident), frozenset(dirty))
        if state in seen:
            cycle = costs[seen[state]:]
            h2d, d2h = (sum(c[i] for c in cycle) / len(cycle) for i in (0, 1))
            streamed = instance.streamed(homes)
            return Steady(h2d + d2h + streamed, h2d, d2h, streamed, len(cycle))
        seen[state] = step
        device = _step(instance, homes, policy, Device(instance, resident, dirty))
        costs.append((device.h2d, device.d2h))
        resident, dirty = device.resident, device.dirty
    raise RuntimeError(f"{rule} did not settle into a cycle within {max_steps} steps")


def _step(instance: Instance, homes: frozenset[int], policy: _Lru | _Belady, device: Device) -> Device:
    budgets = instance.budgets(homes)
    rewrites = instance.rewrites(homes)
    t = 0
    for access in instance.accesses:
        if not instance.on_device(access, homes):
            device.rewritten_on_host(rewrites.get(access.event, ()))
            continue
        needed = set(access.chunks)
        while sum(instance.sizes[c] for c in device.resident | needed) > budgets[t]:
            device.evict(policy.victim(t, device.resident - needed))
        for name in access.chunks:
            if name not in device.resident:
                device.fetch(name)
        policy.accessed(t, access.chunks)
        device.access(access, budgets[t])
        t += 1
    device.end_step()
    return device

