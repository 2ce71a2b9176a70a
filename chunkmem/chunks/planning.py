"""From one recorded step to the decisions the steady state follows: which chunk groups live on the device
(homes), the accesses a step then makes, the chunk budget at each, and the plan.

[Note: homes]
A homed group keeps its parameter, master and optimizer-state chunks on the device for good (its
gradient chunk from its first write to the step's end) and steps there; every other group streams:
its gradients go to the host as backward writes them and its optimizer runs on the host, which
rewrites its parameter chunk, so that chunk is sent up again when next needed. Homing a group saves
the bytes it streams and the re-upload of its parameter chunk, and costs the device room its chunks
take from every access. The choice is a search over sets of groups, not a rule: a candidate set is
feasible when, at every access of the steady step it implies, its resident chunks and the chunks the
access needs fit the access's budget; feasible sets are scored by the bytes one steady step then moves
under the plan's own eviction rule (`plan.victim`), from the cyclic start (what a step leaves resident
is what the next one starts with). The search starts from the best of: nothing homed, the groups
backward needs first (the suffixes PatrickStar keeps), and a greedy fill by bytes saved per byte of
room; from each it adds, drops or swaps one group at a time while that lowers the bytes moved, and
the best of where they end wins. A near-empty chunk
(a few parameters in a large chunk) saves little for its room and is left to stream.
(benchmarks/placement.py measures the result against an exact integer-programming optimum.)

[Note: homes by time]
On a GPU machine bytes are not the cost: a streamed group's host update (its parameters, gradients, master and
states read and written by the native kernel) takes longer than its copies. So with `host_weight` w > 0 a set of
homes is scored by the bytes it moves plus w times the update bytes of every group it leaves to the host: seconds
of copying and of host updating, in the unit of copy bytes (w = copy speed / host update speed, measured at prepare:
runtime/speeds.py). Everything else is as above. The time model (trace/timing.py) replays the step each choice
makes; benchmarks/time_model.py --homes-by-time compares them.

[Note: a step that holds everything]
Where every group's chunks fit beside the non-model data of each access of the recorded step (gradient chunks from
their first write, as backward frees the activations they replace) with SAFETY_FRACTION of the non-model peak to
spare, at least the largest chunk, and what an earlier step held beyond this record (or the room a fallback asked
for), every group is homed and nothing moves: the steps after run resident (placement's Note on resident steps),
like a run without a budget. The one budget a step (below), with its margin of SAFETY_FRACTION of the whole budget,
did not leave that room: the 1.16B LLaMA on the lent H200, at a budget of its model data and 1.15 times plain
PyTorch's activation peak (30.3 GB; the run without a budget held 28.8), streamed two groups, at 1.89 times plain's
step against 0.90 without a budget. A step that holds more non-model data than its record gives way as any does.

[Note: update scratch]
A low-precision group homed on the device updates there, over its packed range at once, and the update allocates
beside its chunks: fp32 copies of its gradients, and the update rule's temporaries (torch.optim's single-tensor Adam
holds two fp32 copies of the range at once; foreach one; SGD at most one). A step recorded before the group was
homed updated it on the host and saw none of that, so its update's non-model bytes are what was recorded plus its
`scratch`, and a set of homes whose updates do not fit beside the step's peak lowers the budget (or is not chosen):
an allocation failing inside an update has no fallback, for a half-made update cannot be redone. Bytes are not
holes: the update reserves its blocks before it starts, and where this step's allocations left no hole for the whole
range's, it updates a slice of the range at a time (optim's `_room_on_device`: elementwise, so the same bits), the
blocks a slice's size, and only where not even a 64th fits are chunks evicted or the update moved to the host. Steps
recorded later read the temporaries of the update before: counted twice there, on the safe side. Not counted: fp32
groups, updated together at the step's end (the Note on updates made together in runtime/rules.py), parameter by
parameter (temporaries of one at a time) or, with foreach, all of the run's at once: where the budget has no room
for those, the run updates a parameter per call, or where not even its largest parameter's fit, slices of a
parameter, halved down to a 64th (optim's `_reserve_run`: the same bits, the update being elementwise).

[Note: one budget a step]
Chunks get the same room at every access of a steady step: what the step's non-model peak leaves. Giving
them more where activations are fewer (early in the forward, in the optimizer phase) would move memory
between chunks and activations twice a step, through the caching allocator, and memory that moves through it
fragments: chunk slots allocated between activations leave holes the next activations cannot use (the lent
H100 ran out of memory that way, arena.py's Note on chunk memory). With one budget, the arena's slots are
reserved once, when a plan is made and no activation is alive, and stay put.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import NamedTuple

from chunkmem.chunks.plan import Access, Plan, build_plan, planned_rule, simulate

SAFETY_FRACTION = 0.05  # of the device budget: temporaries the estimate cannot see, fragmentation
# How much further than a clean chunk's a dirty chunk's next use must be for the plan to evict it (plan.victim). 2 is
# the cost ratio (a write-back and a fetch against a fetch), but the rule is a heuristic: under gradient accumulation
# benchmarks.placement --accumulate 2 found 3 reaching the optimum where 2 moved 9% more (GPT-2 bf16 at 50%, LLaMA
# bf16 at 75%). Each choice of homes is priced under both, and keeps the cheaper.
WRITE_BACK_FACTORS = (2.0, 3.0)
EVALUATIONS_PER_SEED = 1000  # bounds the search on models with many groups (an evaluation replays one step)
# And all seeds' together: sets of homes priced in one search. Uncapped, a 20-layer LLaMA in bf16 (42 groups, 673
# events a step) priced 12,503 sets in 6 minutes, the homes it chose first priced as the 645th; the placement
# benchmark's 48 rows (up to 32 groups) priced up to 9,515, theirs first priced by the 625th at the latest. Capped,
# they choose the same homes, and the LLaMA plans in a fifth of the time.
PRICED_SETS = 2000


class Event(NamedTuple):  # a tuple: one is made at every chunk access of every step
    """One recorded moment. kind: "use" (chunks needed together), "grad" (a gradient written to a
    group's gradient chunk), "optim" (a group's optimizer update). `held`: chunks the modules around
    this moment keep pinned on the device meanwhile (runtime's Note: a module's chunks stay pinned
    while the modules it calls run)."""

    kind: str
    chunks: tuple[str, ...]
    group: int
    nonmodel: int
    held: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GroupChunks:
    """The chunk names of one trainable chunk group, what it takes and what streaming it costs."""

    index: int
    param: str
    grad: str
    updated: tuple[str, ...]  # what the optimizer writes: master (or param in fp32) and states
    nbytes: int  # every family's chunk
    streamed: int = 0  # bytes its parameters' gradients write in one backward (what streaming sends)
    scratch: int = 0  # device bytes its update allocates beside its chunks when homed (the Note on update scratch)

    @property
    def kept(self) -> tuple[str, ...]:
        """What stays on the device for good when the group is homed."""
        return tuple(dict.fromkeys((self.param, *self.updated)))


Groups = dict[int, GroupChunks]
NO_WRITES: frozenset[str] = frozenset()  # a use's: it writes no chunk


def steady_chunks(events: Sequence[Event], groups: Groups,
                  homes: Collection[int]) -> Iterator[tuple[Event, tuple[str, ...]]]:
    """The events that are device accesses once homes are fixed, each with the chunks it needs on the device
    together: its own and those held around it."""
    for event in events:
        if event.kind == "use":
            yield event, event.chunks + event.held
        elif event.group in homes and event.kind == "grad":
            yield event, (groups[event.group].grad, *event.held)
        elif event.group in homes and event.kind == "optim":
            g = groups[event.group]
            yield event, tuple(dict.fromkeys((g.param, g.grad, *g.updated, *event.held)))


def steady_sequence(events: Sequence[Event], groups: Groups, homes: Collection[int]) -> tuple[list[Access], list[int]]:
    """The device accesses of a step once homes are fixed (what each writes: a gradient its chunk, an update
    what stays homed), and the non-model bytes at each."""
    accesses, nonmodel = [], []
    for event, chunks in steady_chunks(events, groups, homes):
        writes = NO_WRITES if event.kind == "use" else \
            frozenset([chunks[0]]) if event.kind == "grad" else frozenset(groups[event.group].kept)
        accesses.append(Access(chunks, writes))
        nonmodel.append(event.nonmodel + (groups[event.group].scratch if event.kind == "optim" else 0))
    return accesses, nonmodel


def chunk_budgets(accesses: Sequence[Access], nonmodel: Sequence[int], sizes: dict[str, int],
                  limit: int, peak: int = 0) -> list[int]:
    """Budget for chunks at each access: what the step's non-model peak (or `peak`, if more: the most an earlier
    step held) leaves, less the margin (the Note on one budget a step).

    Never below what the access itself needs: if non-model data leaves less, the plan holds only
    that access's chunks there, and the out-of-memory fallback handles the rest.
    """
    floor = limit - max(max(nonmodel, default=0), peak) - int(limit * SAFETY_FRACTION)
    return [max(sum(sizes[c] for c in set(access.chunks)), floor) for access in accesses]


@dataclasses.dataclass(frozen=True)
class Step:
    """The steady step a choice of homes implies: its accesses, their budgets and non-model bytes, and
    the chunks whose device copies stay valid from one step into the next."""

    homes: frozenset[int]
    accesses: list[Access]
    nonmodel: list[int]
    budgets: list[int]
    carried: frozenset[str]
    room_for: int = 0  # the non-model bytes its budgets leave room for: its peak, or more (`leaving_room_for`)
    write_back: float = 2.0  # its eviction rule's factor (plan.victim), the one of WRITE_BACK_FACTORS moving least

    @classmethod
    def of(cls, events: Sequence[Event], groups: Groups, homes: Collection[int], sizes: dict[str, int],
           limit: int, peak: int = 0, write_back: float = 2.0) -> Step:
        accesses, nonmodel = steady_sequence(events, groups, homes)
        # Gradient chunks are freed at every step's end; a streamed group's parameter chunk is rewritten on the host.
        stale = {g.grad for g in groups.values()} | {g.param for i, g in groups.items() if i not in homes}
        return cls(frozenset(homes), accesses, nonmodel, chunk_budgets(accesses, nonmodel, sizes, limit, peak),
                   frozenset(set(sizes) - stale), max(max(nonmodel, default=0), peak), write_back)

    def leaving_room_for(self, peak: int, sizes: dict[str, int], limit: int) -> Step:
        """This step with budgets that leave room for `peak` non-model bytes (fragmentation grew since its record)."""
        return dataclasses.replace(self, budgets=chunk_budgets(self.accesses, self.nonmodel, sizes, limit, peak),
                                   room_for=max(self.room_for, peak))

    def plan(self, sizes: dict[str, int], resident: Collection[str] = (), dirty: Collection[str] = (),
             lending: Collection[str] = ()) -> Plan:
        return build_plan(self.accesses, sizes, self.budgets, resident, dirty, self.carried, lending, self.write_back)


def fits(step: Step, groups: Groups, sizes: dict[str, int], budgets: Sequence[int] | None = None) -> bool:
    """Whether the homes' chunks (gradient chunks from their first write) leave every access of `step` the
    chunks it needs within its budget (or within `budgets`)."""
    kept = {c for i in step.homes for c in groups[i].kept}
    grads = {groups[i].grad for i in step.homes}
    held, written = sum(sizes[c] for c in kept), set[str]()
    for access, budget in zip(step.accesses, step.budgets if budgets is None else budgets):
        for grad in (access.writes & grads) - written:
            written.add(grad)
            held += sizes[grad]
        if held + sum(sizes[c] for c in set(access.chunks) - kept - written) > budget:
            return False
    return True


def step_cost(step: Step, groups: Groups, sizes: dict[str, int], passes: int = 1) -> int:
    """Bytes one steady step moves under `step`'s homes: fetches and write-backs under the plan's eviction
    rule from the cyclic start (two rounds from "the homes are resident" reach it), and streamed gradients,
    sent once in each of the step's `passes` backward passes (gradient accumulation)."""
    grads = {g.grad for g in groups.values()}
    start = {c for i in step.homes for c in groups[i].kept}
    dirty = {c for i in step.homes for c in groups[i].updated}
    rule = planned_rule(step.accesses, step.carried, step.write_back)
    for _ in range(2):
        moved = simulate(step.accesses, sizes, step.budgets, rule, resident=start, dirty=dirty, free=grads)
        start, dirty = moved["end"] & step.carried, moved["end_dirty"] & step.carried
    streamed = passes * sum(g.streamed for i, g in groups.items() if i not in step.homes)
    return moved["h2d"] + moved["d2h"] + streamed


def decide_homes(events: Sequence[Event], groups: Sequence[GroupChunks], sizes: dict[str, int],
                 limit: int, streamed: Collection[int] = (), peak: int = 0, passes: int = 1,
                 host_weight: float = 0.0) -> Step:
    """The homes that move fewest bytes per steady step, among those that fit (see the Note on homes) and leave
    the `streamed` groups (disk-backed ones: chunks/hostcache.py) to stream; budgets leave room for `peak`
    non-model bytes if that is more than the record's peak. The step runs `passes` backward passes.
    `host_weight`: bytes of copying that updating one byte on the host costs as much time as (the Note on homes
    by time); each group left to the host adds its update's bytes at that weight."""
    by_index = {g.index: g for g in groups}
    steps: dict[frozenset[int], Step] = {}
    costs: dict[frozenset[int], int] = {}

    def step(homes: Collection[int]) -> Step:
        key = frozenset(homes)
        if key not in steps:
            steps[key] = Step.of(events, by_index, key, sizes, limit, peak)
        return steps[key]

    def moved(homes: frozenset[int]) -> int:
        if homes not in costs:  # under the eviction rule that moves least for these homes
            ruled = [dataclasses.replace(step(homes), write_back=factor) for factor in WRITE_BACK_FACTORS]
            costs[homes], steps[homes] = min(((step_cost(s, by_index, sizes, passes), s) for s in ruled),
                                             key=lambda priced: priced[0])
        return costs[homes]

    def score(homes: frozenset[int]) -> tuple[float, int]:  # ties keep more groups home: they step on the device
        hosted = sum(update_bytes(g, sizes) for i, g in by_index.items() if i not in homes) if host_weight else 0
        return moved(homes) + host_weight * hosted, -len(homes)

    feasible: Callable[[frozenset[int]], bool] = \
        lambda homes: homes.isdisjoint(streamed) and fits(step(homes), by_index, sizes)
    everything = frozenset(by_index) - frozenset(streamed)
    if not streamed and everything:
        whole = step(everything)
        recorded = max(whole.nonmodel, default=0)
        top = max(recorded, peak)  # an earlier step's more (or room left after a fallback) raises every access's
        spare = top - recorded + max(int(top * SAFETY_FRACTION), max(sizes.values()))
        if fits(whole, by_index, sizes, [limit - nonmodel - spare for nonmodel in whole.nonmodel]):
            # Everything fits beside the non-model data of each access (the Note on a step that holds everything).
            held = sum(sizes.values())
            return dataclasses.replace(whole, budgets=[max(b, held) for b in whole.budgets])
    if feasible(everything) and moved(everything) == passes * sum(by_index[i].streamed for i in streamed):
        return step(everything)  # all home and nothing else moves: no homes do better (nor is a search quick)
    seeds = [frozenset(), _greedy(groups, sizes, feasible)]
    for parity in (0, 1):  # every other group: the optimum single moves could not reach on a 16-layer MLP (issue 35)
        seeds.append(_greedy([g for g in groups if g.index % 2 == parity], sizes, feasible))
    suffix: frozenset[int] = frozenset()
    for group in sorted(groups, key=lambda g: -g.index):  # the groups backward needs first
        suffix = suffix | {group.index}
        if not feasible(suffix):
            break
        seeds.append(suffix)
    best = min((_descend(seed, groups, score, feasible, lambda: len(costs) >= PRICED_SETS) for seed in seeds),
               key=score)
    return step(best)


def update_bytes(group: GroupChunks, sizes: Mapping[str, float]) -> float:
    """What the optimizer reads and writes of a group (parameters, gradients, master and states)."""
    return sum(sizes[c] for c in {group.param, group.grad, *group.updated})


def _descend(homes: frozenset[int], groups: Sequence[GroupChunks],
             score: Callable[[frozenset[int]], tuple[float, int]], feasible: Callable[[frozenset[int]], bool],
             spent_all: Callable[[], bool]) -> frozenset[int]:
    """From `homes`, the first change that lowers the score (add a group, drop one, swap two; then
    pairs: add or drop two, swap one for two or two for one), again and again, until none does or the search
    has spent its evaluations, or all seeds' (`spent_all`)."""
    spent = 0
    while True:
        others = [g.index for g in groups if g.index not in homes]
        pairs = itertools.combinations
        moves = itertools.chain((homes | {j} for j in others), (homes - {i} for i in homes),
                                ((homes - {i}) | {j} for i in homes for j in others),
                                (homes | set(p) for p in pairs(others, 2)), (homes - set(p) for p in pairs(homes, 2)),
                                ((homes - {i}) | set(p) for i in homes for p in pairs(others, 2)),
                                ((homes - set(p)) | {j} for p in pairs(homes, 2) for j in others))
        for move in moves:
            spent += 1
            if spent > EVALUATIONS_PER_SEED or spent_all():
                return homes
            if feasible(move) and score(move) < score(homes):
                homes = move
                break
        else:
            return homes


def _greedy(groups: Sequence[GroupChunks], sizes: dict[str, int],
            feasible: Callable[[frozenset[int]], bool]) -> frozenset[int]:
    """Groups added by bytes saved (streamed gradients, the parameter chunk's re-upload) per byte of room,
    while they fit."""
    homes: frozenset[int] = frozenset()
    for group in sorted(groups, key=lambda g: (-(g.streamed + sizes[g.param]) / max(1, g.nbytes), g.index)):
        if feasible(homes | {group.index}):
            homes = homes | {group.index}
    return homes
