"""Pipeline schedules as data: the orders, a validator and a unit-cost simulator, usable without any device.

An order is, per rank, the list of actions that rank runs, in its order: built here (GPipe, 1F1B,
PipeDream-2BW), read from a torch schedule's `pipeline_order` (interleaved 1F1B, zero bubble), or
recorded while a real step ran (`Pipeline.last_order`), so tests check what was executed, not what
was meant to be. torch.distributed.pipelining executes the flushing schedules; chunkmem's own
executor (flow.py) runs 2BW's orders as they are written here.

[Note: dependencies]
F(s, m) needs F(s-1, m) (its input). The backward of (s, m) is either one action B, or I (the
gradient of the input) then W (the gradients of the weights), as zero-bubble schedules split it:
B and I need F(s, m) (its saved activations) and the input gradient of (s+1, m) (B or I there); W
needs I(s, m). U(s, u) is stage s's optimizer step on mini-batch u's coalesced gradient: it needs
every B or W of stage s for the micro-batches of u. Under 2BW a forward of mini-batch u computes
with the weights version u-1, which U(s, u-2) made: F(s, m) also needs U(s, m // M - 2). That edge
bounds a stage to two weight versions: mini-batch u needs version u-1 until its last backward, and
U(s, u), which makes version u+1, comes after that backward, so versions u and u+1 are all that is
left then (versions.py keeps them as chunk families).
Communication and updates are free in the simulation; a backward costs twice a forward (I and W
one each), and a virtual stage (v per rank) a v-th of that. A schedule's bubble is then the idle
share of rank-time: for GPipe and 1F1B (K-1)/(M+K-1).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward of a micro-batch
    INPUT = "I"  # the backward for the stage input only (zero bubble)
    WEIGHT = "W"  # the backward for the weights, after I
    UPDATE = "U"  # the stage's optimizer step; `microbatch` is the mini-batch


F, B, I, W, U = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT, Kind.WEIGHT, Kind.UPDATE
GRADIENT_DONE = (B, W)  # the action after which a micro-batch's weight gradients are in


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One stage's forward or backward (or part of it) of one micro-batch, or its update of a mini-batch."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


Order = Mapping[int, Sequence[Action]]  # rank -> the actions it runs, in order


# -- orders ------------------------------------------------------------------------------------------
def gpipe(n_stages: int, n_microbatches: int) -> dict[int, list[Action]]:
    """All forwards, then all backwards."""
    return {s: [Action(s, F, m) for m in range(n_microbatches)] + [Action(s, B, m) for m in range(n_microbatches)]
            for s in range(n_stages)}


def one_f_one_b(n_stages: int, n_microbatches: int) -> dict[int, list[Action]]:
    """Stage s runs min(M, K - s) forwards, then alternates backward and forward, then drains its backwards."""
    order = {}
    for s in range(n_stages):
        warmup = min(n_microbatches, n_stages - s)
        fwd = [Action(s, F, m) for m in range(n_microbatches)]
        bwd = [Action(s, B, m) for m in range(n_microbatches)]
        steady = [a for i in range(n_microbatches - warmup) for a in (bwd[i], fwd[warmup + i])]
        order[s] = fwd[:warmup] + steady + bwd[n_microbatches - warmup:]
    return order


def twobw_segment(stage: int, n_stages: int, n_microbatches: int, minibatch: int) -> list[Action]:
    """What stage `stage` runs in the step of mini-batch t under PipeDream-2BW: 1F1B that never flushes.

    Micro-batches are numbered across mini-batches (g = t*M + j). Stage s keeps w = K - s in flight:
    the backward of g - w comes just before the forward of g, and a mini-batch's update just after
    its last backward. The step of mini-batch t runs its M forwards and the backwards before each.
    """
    w, m = n_stages - stage, n_microbatches
    out: list[Action] = []
    for g in range(minibatch * m, (minibatch + 1) * m):
        if g >= w:
            out += _backward(stage, g - w, m)
        out.append(Action(stage, F, g))
    return out


def twobw_drain(stage: int, n_stages: int, n_microbatches: int, minibatches: int) -> list[Action]:
    """The backwards (and updates) still due at stage `stage` after `minibatches` steps of 2BW."""
    end = minibatches * n_microbatches
    return [a for g in range(max(0, end - (n_stages - stage)), end) for a in _backward(stage, g, n_microbatches)]


def _backward(stage: int, g: int, n_microbatches: int) -> list[Action]:
    last = g % n_microbatches == n_microbatches - 1
    return [Action(stage, B, g)] + ([Action(stage, U, g // n_microbatches)] if last else [])


def check_twobw(n_stages: int, n_microbatches: int) -> None:
    """2BW keeps two weight versions only if a stage's in-flight micro-batches (K - s) span at most two
    mini-batches: M >= K - 1 (the Note on dependencies)."""
    if n_microbatches < n_stages - 1:
        raise ValueError(f"schedule='2bw' with {n_stages} stages needs n_microbatches >= {n_stages - 1} (got "
                         f"{n_microbatches}): the first stage keeps {n_stages} micro-batches in flight, and with "
                         "fewer per mini-batch they would span three weight versions; use more micro-batches")


def twobw(n_stages: int, n_microbatches: int, minibatches: int) -> dict[int, list[Action]]:
    """`minibatches` steps of 2BW and the drain after them."""
    check_twobw(n_stages, n_microbatches)
    return {s: [a for t in range(minibatches) for a in twobw_segment(s, n_stages, n_microbatches, t)]
            + twobw_drain(s, n_stages, n_microbatches, minibatches) for s in range(n_stages)}


TORCH_SCHEDULES = {"interleaved": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble",
                   "zbv": "ScheduleZBVZeroBubble"}


def torch_order(name: str, n_ranks: int, n_microbatches: int, virtual: int) -> dict[int, list[Action]]:
    """torch's own order (`pipeline_order`) for a schedule with `virtual` stages per rank, computed without
    stages or process groups (what the schedule's constructor computes before it lowers communication)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, TORCH_SCHEDULES[name])
    fake = cls.__new__(cls)  # the order depends only on these numbers
    rounds = max(1, n_microbatches // n_ranks)
    for field, value in dict(pp_group_size=n_ranks, n_local_stages=virtual, _n_microbatches=n_microbatches,
                             number_of_rounds=rounds, microbatches_per_round=n_microbatches // rounds,
                             num_stages=n_ranks * virtual, _num_stages=n_ranks * virtual).items():
        setattr(fake, field, value)
    order = {rank: fake._calculate_single_rank_operations(rank) for rank in range(n_ranks)}
    if hasattr(fake, "_add_bubbles_to_actions"):
        fake.pipeline_order = order
        order = fake._add_bubbles_to_actions(n_ranks * virtual)
    return from_torch(order)


def from_torch(pipeline_order: Mapping[int, Sequence[Any]]) -> dict[int, list[Action]]:
    """Convert a torch schedule's `pipeline_order` (rank -> list of _Action or None) to an Order.

    Idle slots (None) and bookkeeping actions (sends, receives, REDUCE_GRAD) carry no compute and are dropped.
    """
    kinds = {"F": F, "B": B, "I": I, "W": W}
    out: dict[int, list[Action]] = {}
    for rank, actions in pipeline_order.items():
        out[rank] = []
        for action in actions:
            code = None if action is None else str(getattr(action.computation_type, "value",
                                                               action.computation_type))
            if code in kinds:
                out[rank].append(Action(action.stage_index, kinds[code], action.microbatch_index))
    return out


def format_order(order: Order) -> str:
    """One line per rank, e.g. `rank 1: 1F0 1F1 1B0 ...`."""
    return "\n".join(f"rank {rank}: " + " ".join(map(str, actions)) for rank, actions in sorted(order.items()))


# -- checking ----------------------------------------------------------------------------------------
def validate(order: Order, n_stages: int, n_microbatches: int, minibatches: int = 1) -> None:
    """Raise ValueError unless every action runs exactly once, each micro-batch's backward is either B or
    I then W, there is one update per stage and mini-batch or none, and the order can run to the end (no
    rank waits forever on an action another rank runs later). `n_microbatches` is per mini-batch."""
    seen: dict[Action, int] = {}
    for rank, actions in order.items():
        for action in actions:
            if action in seen:
                raise ValueError(f"action {action} runs twice (ranks {seen[action]} and {rank})")
            seen[action] = rank
    total = n_microbatches * minibatches
    split = {(a.stage, a.microbatch) for a in seen if a.kind is I}
    updates = any(a.kind is U for a in seen)
    expected = {Action(s, F, m) for s in range(n_stages) for m in range(total)}
    expected |= {Action(s, k, m) for s in range(n_stages) for m in range(total)
                 for k in ((I, W) if (s, m) in split else (B,))}
    if updates:
        expected |= {Action(s, U, u) for s in range(n_stages) for u in range(minibatches)}
    missing, extra = expected - set(seen), set(seen) - expected
    if missing or extra:
        raise ValueError(f"schedule for {n_stages} stages x {total} micro-batches: missing "
                         f"{sorted(map(str, missing))}, unexpected {sorted(map(str, extra))}")
    simulate(order, n_stages, n_microbatches)  # raises on a dependency that cannot be met


def needs(action: Action, n_stages: int, present: Iterable[Action], n_microbatches: int) -> list[Action]:
    """The actions whose results `action` consumes (see the Note on dependencies); `present` is the order's
    set of actions (it tells B from I and whether updates are part of it)."""
    present = present if isinstance(present, (set, frozenset)) else set(present)
    s, m = action.stage, action.microbatch
    if action.kind is F:
        deps = [Action(s - 1, F, m)] if s > 0 else []
        version = Action(s, U, m // n_microbatches - 2)
        return deps + ([version] if version in present else [])
    if action.kind is W:
        return [Action(s, I, m)]
    if action.kind is U:
        return [a for g in range(m * n_microbatches, (m + 1) * n_microbatches)
                for a in (Action(s, B, g), Action(s, W, g)) if a in present]
    deps = [Action(s, F, m)]
    if s < n_stages - 1:
        deps.append(Action(s + 1, I, m) if Action(s + 1, I, m) in present else Action(s + 1, B, m))
    return deps


@dataclasses.dataclass(frozen=True)
class Timeline:
    """When each action ran in a simulation, and what that says about the schedule."""

    start: dict[Action, float]
    end: dict[Action, float]
    busy: dict[int, float]  # rank -> time spent computing
    makespan: float
    peak_in_flight: dict[int, int]  # stage -> most micro-batches forwarded whose backward has not ended

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time between the first start and the last end."""
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total else 0.0


def unit_costs(virtual: int = 1) -> dict[Kind, float]:
    """F 1, B 2 (I and W 1 each), U free; each of `virtual` stages per rank has a v-th of the rank's layers."""
    return {F: 1.0 / virtual, B: 2.0 / virtual, I: 1.0 / virtual, W: 1.0 / virtual, U: 0.0}


def simulate(order: Order, n_stages: int, n_microbatches: int | None = None,
             costs: Mapping[Kind, float] | None = None) -> Timeline:
    """Run `order` with the given costs; each rank runs its actions one at a time, in its order.
    `n_microbatches` (per mini-batch) matters only for orders with updates (2BW)."""
    cost = dict(unit_costs()) | dict(costs or {})
    present = {a for actions in order.values() for a in actions}
    per_minibatch = n_microbatches or 1 + max((a.microbatch for a in present), default=0)
    deps = {a: needs(a, n_stages, present, per_minibatch) for a in present}
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
                if any(d not in end for d in deps[action]):
                    break
                start[action] = max([free[rank], *(end[d] for d in deps[action])])
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
    """Per stage, the most micro-batches whose activations are held: from the start of F to the end of
    B (or of W, when the backward is split: I keeps the graph for W)."""
    events: dict[int, list[tuple[float, int]]] = {}
    split = {(a.stage, a.microbatch) for a in end if a.kind is W}
    for action, t in start.items():
        if action.kind is F:
            events.setdefault(action.stage, []).append((t, 1))
    for action, t in end.items():
        if action.kind in GRADIENT_DONE and (action.kind is W or (action.stage, action.microbatch) not in split):
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


# -- what the simulator says about a schedule --------------------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv", "2bw")


def order_of(name: str, n_ranks: int, n_microbatches: int, virtual: int = 1,
             minibatches: int = 1) -> dict[int, list[Action]]:
    """One step's order (rank -> actions) of a named schedule; 2BW's runs `minibatches` steps and drains."""
    if name == "gpipe":
        return gpipe(n_ranks, n_microbatches)
    if name == "1f1b":
        return one_f_one_b(n_ranks, n_microbatches)
    if name == "2bw":
        return twobw(n_ranks, n_microbatches, minibatches)
    if name in TORCH_SCHEDULES:
        return torch_order(name, n_ranks, n_microbatches, virtual)
    raise ValueError(f"schedule={name!r}: expected one of {list(SCHEDULES)}")


def bubble(name: str, n_ranks: int, n_microbatches: int, virtual: int = 2) -> float:
    """The idle share of rank-time per mini-batch in the steady state, with unit costs (see the Note).

    Flushing schedules repeat one step, so it is one step's bubble. 2BW never flushes: its period is
    what one more mini-batch adds to the makespan, against the work of one mini-batch.
    """
    v = virtual if name in TORCH_SCHEDULES else 1
    stages = n_ranks * v
    if name != "2bw":
        return simulate(order_of(name, n_ranks, n_microbatches, v), stages, costs=unit_costs(v)).bubble
    makespans = [simulate(twobw(n_ranks, n_microbatches, t), n_ranks, n_microbatches).makespan for t in (8, 9)]
    work = n_microbatches * (unit_costs()[F] + unit_costs()[B])
    return 1.0 - work / (makespans[1] - makespans[0])


def in_flight(name: str, n_ranks: int, n_microbatches: int, virtual: int = 1) -> dict[int, int]:
    """Per stage, the most micro-batches holding activations at once under unit costs (balance.py's need)."""
    v = virtual if name in TORCH_SCHEDULES else 1
    order = order_of(name, n_ranks, n_microbatches, v, minibatches=3)
    return simulate(order, n_ranks * v, n_microbatches, unit_costs(v)).peak_in_flight

