"""One recorded training step as a placement problem, and what a schedule of chunk moves costs on it.

Written apart from chunkmem's planner (chunkmem/chunks/placement.py, chunkmem/chunks/plan.py) so that it can judge
it: it reads only the raw record of a warm-up step. `benchmarks/optimum.py` finds the best schedule,
`benchmarks/policies.py` replays LRU and Belady, `benchmarks/record.py` records real steps; all count
bytes with `Device` here.

The problem
-----------
One recorded step is a list of events, each with the non-model bytes on the device at that moment:
"use" (these chunks on the device together), "grad" (a gradient written into a group's gradient
chunk), "optim" (a group's optimizer update). A trainable group has a parameter chunk, a gradient
chunk and the chunks its optimizer rewrites (the fp32 master, which in fp32 is the parameter chunk,
and the state chunks). A choice of homes H (a set of groups) decides where each group's optimizer runs:
  * homed: its gradients are written on the device ("grad" is a device access writing the gradient
    chunk), its update runs there ("optim" needs param, grad, master and states, and writes all but
    the gradient);
  * streamed: its gradients go to the host as backward writes them (their bytes, every step), its
    update runs on the host, which rewrites its parameter, master and state chunks: a device copy of
    any of them is worthless from that moment.
The device accesses of a step are then every "use" and the homed groups' "grad" and "optim". At
device access i the chunks resident may hold at most
    b_i = max(need_i, L - margin - P)
bytes, P the most non-model bytes at any event of the step, need_i the bytes access i names: the
runtime's budget (a 5% margin of the limit L), the same at every access of a step (chunk memory does not
trade bytes with activations within a step: chunkmem/chunks/planning.py's Note on one budget a step).
Costs per step: a chunk brought to the device costs its size, unless it holds no data yet (a gradient
chunk before its first write in the step); a chunk leaving the device costs its size if it changed
there since it came (a write-back); streamed groups add their gradient bytes. Gradient chunks are
freed at the step's end (zero_grad): never written back then, absent and empty when the next step
starts; until then they hold the gradients (readable after the update too), so a written one that
leaves earlier is written back. The steady state is cyclic: what a step leaves resident (and valid)
is what the next starts with, every step the same schedule. The optimum minimises bytes per step over H
and the schedule. A schedule repeating only every P steps can move less on average (a, b, c read
with room for two: 1.5 fetches a step against 2); `optimum.solve(period=P)` gives the best P-step cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

MARGIN_FRACTION = 0.05  # of the limit, kept free of chunks (the README's "less a 5% margin")


class RecordedEvent(Protocol):  # chunkmem.chunks.placement.Event has this shape
    kind: str
    chunks: tuple[str, ...]
    group: int
    nonmodel: int


class RecordedGroup(Protocol):  # chunkmem.chunks.placement.GroupChunks has this shape
    index: int
    param: str
    grad: str
    updated: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    index: int
    param: str
    grad: str
    updated: tuple[str, ...]  # rewritten by the update: master (the parameter chunk in fp32) and states
    streamed: int  # gradient bytes sent to the host per step when not homed

    @property
    def rewritten(self) -> frozenset[str]:
        return frozenset((self.param, *self.updated))


@dataclasses.dataclass(frozen=True)
class Access:
    """One event as the device sees it; `group` set: it is a device access only if that group is homed."""

    event: int
    kind: str
    chunks: tuple[str, ...]
    writes: frozenset[str]
    group: int | None
    nonmodel: int
    step: int = 0  # which copy of the recorded step (Instance.repeated)


@dataclasses.dataclass(frozen=True)
class Instance:
    accesses: tuple[Access, ...]  # one per recorded event, in order
    sizes: Mapping[str, int]
    groups: tuple[Group, ...]
    limit: int
    margin: int
    fresh: frozenset[str]  # start every step empty and absent, freed at its end: the gradient chunks
    steps: int = 1  # copies of the recorded step in `accesses`

    @classmethod
    def from_events(cls, events: Sequence[RecordedEvent], sizes: Mapping[str, int],
                    groups: Sequence[RecordedGroup], limit: int, margin: int | None = None,
                    streamed: Mapping[int, int] | None = None) -> Instance:
        """`streamed[g]`: gradient bytes group g sends per step when streamed (default its chunk's size)."""
        mine = {g.index: Group(g.index, g.param, g.grad, tuple(g.updated),
                               (streamed or {}).get(g.index, sizes[g.grad])) for g in groups}
        accesses = []
        for i, event in enumerate(events):
            if event.kind == "use":
                accesses.append(Access(i, "use", tuple(dict.fromkeys(event.chunks)), frozenset(), None, event.nonmodel))
            elif event.kind in ("grad", "optim"):
                g = mine[event.group]
                chunks = (g.grad,) if event.kind == "grad" else tuple(dict.fromkeys((g.param, g.grad, *g.updated)))
                writes = frozenset([g.grad]) if event.kind == "grad" else g.rewritten
                accesses.append(Access(i, event.kind, chunks, writes, g.index, event.nonmodel))
            else:
                raise ValueError(f"event {i} has kind {event.kind!r}: expected 'use', 'grad' or 'optim'")
        return cls(tuple(accesses), dict(sizes), tuple(mine.values()), limit,
                   int(limit * MARGIN_FRACTION) if margin is None else margin, frozenset(g.grad for g in mine.values()))

    def repeated(self, steps: int) -> Instance:
        """`steps` copies of the step in a row, one cycle: schedules that repeat only every `steps` steps.
        Each copy has its own gradient chunks (`grad.3@1`), freed at its end; the homes are shared."""
        assert self.steps == 1, "repeat a one-step instance"
        n = len(self.accesses)

        def name(chunk: str, k: int) -> str:
            return f"{chunk}@{k}" if k and chunk in self.fresh else chunk

        accesses = tuple(dataclasses.replace(a, event=a.event + k * n, step=k, chunks=tuple(name(c, k) for c in a.chunks),
                                             writes=frozenset(name(c, k) for c in a.writes))
                         for k in range(steps) for a in self.accesses)
        sizes = {name(c, k): size for k in range(steps) for c, size in self.sizes.items()}
        return dataclasses.replace(self, accesses=accesses, sizes=sizes, steps=steps,
                                   fresh=frozenset(name(c, k) for k in range(steps) for c in self.fresh))

    def on_device(self, access: Access, homes: Iterable[int]) -> bool:
        return access.group is None or access.group in set(homes)

    def need(self, access: Access) -> int:
        return sum(self.sizes[c] for c in access.chunks)

    def budget(self, access: Access) -> int:
        peak = max(a.nonmodel for a in self.accesses if a.step == access.step)
        return max(self.need(access), self.limit - self.margin - peak)

    def device_accesses(self, homes: Iterable[int]) -> list[Access]:
        homes = set(homes)
        return [a for a in self.accesses if self.on_device(a, homes)]

    def budgets(self, homes: Iterable[int]) -> list[int]:
        """The chunk budget at each device access (`device_accesses(homes)`)."""
        return [self.budget(a) for a in self.device_accesses(homes)]

    def rewrites(self, homes: Iterable[int]) -> dict[int, frozenset[str]]:
        """Event index -> chunks the host optimizer rewrites there (streamed groups' updates)."""
        homes = set(homes)
        by_group = {g.index: g for g in self.groups}
        return {a.event: by_group[a.group].rewritten for a in self.accesses
                if a.kind == "optim" and a.group is not None and a.group not in homes}

    def streamed(self, homes: Iterable[int]) -> int:
        homes = set(homes)
        return self.steps * sum(g.streamed for g in self.groups if g.index not in homes)


@dataclasses.dataclass(frozen=True)
class Action:
    at: int  # event index: "fetch" comes right before it, "evict" right after it
    verb: str
    chunk: str

    def __str__(self) -> str:
        return f"@{self.at} {self.verb} {self.chunk}"


class Device:
    """Residency and its costs, one chunk move at a time: the accounting every schedule is judged by."""

    def __init__(self, instance: Instance, resident: Iterable[str] = (), dirty: Iterable[str] = ()) -> None:
        self.instance = instance
        self.resident, self.dirty = set(resident), set(dirty)
        self.empty = set(instance.fresh) - self.resident
        self.h2d = self.d2h = 0

    def held(self) -> int:
        return sum(self.instance.sizes[c] for c in self.resident)

    def fetch(self, name: str) -> None:
        assert name not in self.resident, f"{name} is already resident"
        self.resident.add(name)
        self.h2d += 0 if name in self.empty else self.instance.sizes[name]

    def evict(self, name: str) -> None:
        self.resident.remove(name)
        if name in self.dirty:
            self.dirty.discard(name)
            self.d2h += self.instance.sizes[name]

    def rewritten_on_host(self, names: Iterable[str]) -> None:
        for name in set(names) & self.resident:
            self.evict(name)  # a stale copy is worth nothing (and a dirty one is written back first)

    def access(self, access: Access, budget: int) -> None:
        missing = set(access.chunks) - self.resident
        assert not missing, f"event {access.event} needs {sorted(missing)}, which are not resident"
        assert self.held() <= budget, f"event {access.event}: {self.held()} bytes resident, budget {budget}"
        self.dirty |= access.writes
        self.empty -= access.writes

    def end_step(self) -> None:
        """zero_grad: gradient chunks are freed, without a write-back."""
        self.resident -= self.instance.fresh
        self.dirty -= self.instance.fresh
        self.empty = set(self.instance.fresh)


def replay(instance: Instance, homes: Iterable[int], start: Iterable[str], schedule: Sequence[Action],
           dirty: Iterable[str] = ()) -> Device:
    """One cycle of a schedule from `start`: checks every access and budget, counts the bytes."""
    homes = set(homes)
    device = Device(instance, start, dirty)
    before: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    for action in schedule:
        (before if action.verb == "fetch" else after).setdefault(action.at, []).append(action.chunk)
    rewrites = instance.rewrites(homes)
    ahead = iter(instance.budgets(homes))
    for k, access in enumerate(instance.accesses):
        if instance.on_device(access, homes):
            for name in before.get(access.event, []):
                device.fetch(name)
            device.access(access, next(ahead))
            for name in after.get(access.event, []):
                device.evict(name)
        else:
            device.rewritten_on_host(rewrites.get(access.event, ()))
        if k + 1 == len(instance.accesses) or instance.accesses[k + 1].step != access.step:
            device.end_step()
    return device


def steady_cost(instance: Instance, homes: Iterable[int], start: Iterable[str], schedule: Sequence[Action]) -> int:
    """Bytes per cycle (the instance's steps) of a cyclic schedule, which must end where it starts;
    which chunks are dirty across the cycle's end is found by replaying until it repeats."""
    homes, start = set(homes), set(start)
    dirty: set[str] = set()
    for _ in range(4):
        device = replay(instance, homes, start, schedule, dirty)
        assert device.resident == start, f"the schedule ends with {sorted(device.resident)}, starts with {sorted(start)}"
        if device.dirty == dirty:
            return device.h2d + device.d2h + instance.streamed(homes)
        dirty = device.dirty
    raise AssertionError("dirty chunks at the step's end did not settle")
