"""Pipeline schedules as data: a validator and a unit-cost simulator, usable without any device.

torch.distributed.pipelining executes the schedules (see runner.py); this module only reads them.
An order is, per rank, the list of compute actions that rank runs, in its order: taken from a
torch schedule's `pipeline_order`, or recorded while a real step ran (`Pipeline.last_order`), so
tests check what was executed, not what was meant to be.

[Note: dependencies]
F(s, m) needs F(s-1, m) (its input); B(s, m) needs F(s, m) (its saved activations) and B(s+1, m)
(the gradient of its output). Communication is free in the simulation, so a schedule's bubble is
the idle share of rank-time: for GPipe and 1F1B with unit costs it is (K-1)/(M+K-1).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One stage's forward or (full) backward of one micro-batch."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def needs(self, n_stages: int) -> list[Action]:
        """The actions whose results this one consumes (see the Note on dependencies)."""
        if self.kind is Kind.FORWARD:
            return [Action(self.stage - 1, Kind.FORWARD, self.microbatch)] if self.stage > 0 else []
        deps = [Action(self.stage, Kind.FORWARD, self.microbatch)]
        if self.stage < n_stages - 1:
            deps.append(Action(self.stage + 1, Kind.BACKWARD, self.microbatch))
        return deps


Order = Mapping[int, Sequence[Action]]  # rank -> the actions it runs, in order


def from_torch(pipeline_order: Mapping[int, Sequence[Any]]) -> dict[int, list[Action]]:
    """Convert a torch schedule's `pipeline_order` (rank -> list of _Action or None) to an Order.

    Idle slots (None) and bookkeeping actions (REDUCE_GRAD, sends, receives) carry no compute and
    are dropped; split backwards (I/W, zero-bubble schedules) are not modelled here.
    """
    kinds = {"F": Kind.FORWARD, "B": Kind.BACKWARD}
    out: dict[int, list[Action]] = {}
    for rank, actions in pipeline_order.items():
        out[rank] = []
        for action in actions:
            if action is None:
                continue
            code = str(getattr(action.computation_type, "value", action.computation_type))
            if code in ("I", "W"):
                raise ValueError(f"rank {rank}: action {action} splits the backward (I/W); only full "
                                 "backwards (B) are modelled: use schedule 'gpipe' or '1f1b'")
            if code in kinds:
                out[rank].append(Action(action.stage_index, kinds[code], action.microbatch_index))
    return out


def format_order(order: Order) -> str:
    """One line per rank, e.g. `rank 1: 1F0 1F1 1B0 ...`."""
    return "\n".join(f"rank {rank}: " + " ".join(map(str, actions)) for rank, actions in sorted(order.items()))


def validate(order: Order, n_stages: int, n_microbatches: int) -> None:
    """Raise ValueError unless every (kind, stage, micro-batch) runs exactly once and the order can
    run to the end (no rank waits forever on an action another rank runs later)."""
    seen: dict[Action, int] = {}
    for rank, actions in order.items():
        for action in actions:
            if action in seen:
                raise ValueError(f"action {action} runs twice (ranks {seen[action]} and {rank})")
            seen[action] = rank
    expected = {Action(s, k, m) for s in range(n_stages) for k in Kind for m in range(n_microbatches)}
    missing, extra = expected - set(seen), set(seen) - expected
    if missing or extra:
        raise ValueError(f"schedule for {n_stages} stages x {n_microbatches} micro-batches: missing "
                         f"{sorted(map(str, missing))}, unexpected {sorted(map(str, extra))}")
    simulate(order, n_stages)  # raises on a dependency that cannot be met


@dataclasses.dataclass(frozen=True)
class Timeline:
    """When each action ran in a simulation, and what that says about the schedule."""

    start: dict[Action, float]
    end: dict[Action, float]
    busy: dict[int, float]  # rank -> time spent computing
    makespan: float
    peak_in_flight: dict[int, int]  # stage -> most micro-batches forwarded but not yet backwarded

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time between the first start and the last end."""
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total else 0.0


def simulate(order: Order, n_stages: int, forward_cost: float = 1.0, backward_cost: float = 1.0) -> Timeline:
    """Run `order` with the given costs; each rank runs its actions one at a time, in its order."""
    cost = {Kind.FORWARD: forward_cost, Kind.BACKWARD: backward_cost}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    position = {rank: 0 for rank in order}
    free = {rank: 0.0 for rank in order}
    busy = {rank: 0.0 for rank in order}
    progress = True
    while progress:
        progress = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                deps = action.needs(n_stages)
                if any(d not in end for d in deps):
                    break
                start[action] = max([free[rank], *(end[d] for d in deps)])
                end[action] = free[rank] = start[action] + cost[action.kind]
                busy[rank] += cost[action.kind]
                position[rank] += 1
                progress = True
    stuck = {rank: str(actions[position[rank]]) for rank, actions in order.items() if position[rank] < len(actions)}
    if stuck:
        raise ValueError(f"schedule deadlocks: ranks wait on actions nobody can run first: {stuck}\n"
                         f"{format_order(order)}")
    makespan = max(end.values(), default=0.0) - min(start.values(), default=0.0)
    return Timeline(start, end, busy, makespan, _peak_in_flight(start, end))


def _peak_in_flight(start: Mapping[Action, float], end: Mapping[Action, float]) -> dict[int, int]:
    """Per stage, the most micro-batches whose activations are held: from the start of F to the end of B."""
    events: dict[int, list[tuple[float, int]]] = {}
    for action, t in start.items():
        if action.kind is Kind.FORWARD:
            events.setdefault(action.stage, []).append((t, 1))
    for action, t in end.items():
        if action.kind is Kind.BACKWARD:
            events.setdefault(action.stage, []).append((t, -1))  # sorts before a start at the same time
    peaks = {}
    for stage, items in events.items():
        live = peak = 0
        for _, delta in sorted(items):
            live += delta
            peak = max(peak, live)
        peaks[stage] = peak
    return peaks


def merge(orders: Iterable[Order]) -> dict[int, list[Action]]:
    """Orders recorded on separate ranks, as one."""
    out: dict[int, list[Action]] = {}
    for order in orders:
        for rank, actions in order.items():
            out.setdefault(rank, []).extend(actions)
    return out
