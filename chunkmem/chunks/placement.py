"""Warm-up statistics turned into placement: what to record, what to decide, how to follow the plan.

[Note: warm-up]
The first step runs under a conservative chunk budget and records, at every access of chunks, the
non-model bytes on the device and which chunks were needed ("use"), which gradient chunk was written
("grad") and which chunk group the optimizer updated ("optim"). The conservative budget also gives
way at every moment to the non-model bytes measured then (less the margin, never below one module's
working set); growth inside one module between two moments cannot be foreseen without a record, and
on CUDA the out-of-memory fallback catches it. At the end of that step:
  1. homes: chunk groups whose whole optimizer data (param, grad, master, states) fits in what the
     peak non-model data and the streaming working set leave free stay on the device for good and
     are updated there; the rest stream, and their optimizer runs on the host (PatrickStar's margin);
  2. the steady-state access sequence follows from the record and the homes;
  3. the chunk budget at each access is the device budget minus the non-model bytes at that access
     and the next, minus a safety margin; a Belady plan over that sequence says what moves when.
A later step that accesses chunks in another order than recorded (a new shape, another branch)
falls back to least-recently-used placement under the conservative budget, and is recorded anew.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Sequence

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.plan import INFINITY, Access, Plan, build_plan, next_uses, simulate
from chunkmem.chunks.residency import LeastRecentlyUsed, Residency
from chunkmem.chunks.store import ChunkGroup, ParamStore

log = logging.getLogger("chunkmem")

WARMUP_FRACTION = 0.5  # of the device budget, for chunks, while nothing is known of non-model data
SAFETY_FRACTION = 0.05  # of the device budget: temporaries the estimate cannot see, fragmentation


class Phase(enum.Enum):
    RECORD = "record"  # warm-up: conservative budget, LRU, record
    FOLLOW = "follow"  # steady state: follow the plan
    DIVERGED = "diverged"  # this step left the recorded path: conservative until it ends, then record


@dataclasses.dataclass(frozen=True)
class Event:
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
    """The chunk names of one trainable chunk group, and its bytes in all families."""

    index: int
    param: str
    grad: str
    updated: tuple[str, ...]  # what the optimizer writes: master (or param in fp32) and states
    nbytes: int


def decide_homes(events: Sequence[Event], groups: Sequence[GroupChunks], sizes: dict[str, int],
                 limit: int) -> set[int]:
    """Chunk groups that stay on the device and step there: the cheapest choice the margin allows.

    The margin (PatrickStar's rule) is what the peak non-model data, the streaming working set and
    the safety margin leave; it bounds how many groups could live on the device. Among keeping the
    last k groups (the first that backward needs) for k up to that bound, the one whose plan moves
    fewest bytes wins, a streamed-gradient host group counting its gradient chunk. Ties keep more
    groups home: their optimizer runs on the device.
    """
    peak = max((e.nonmodel for e in events), default=0)
    streaming = max((sum(sizes[c] for c in {*e.chunks, *e.held}) for e in events if e.kind == "use"), default=0)
    room = limit - peak - int(limit * SAFETY_FRACTION) - streaming
    ordered = sorted(groups, key=lambda g: -g.index)
    choices: list[set[int]] = [set()]
    for group in ordered:
        if group.nbytes > room:
            break
        room -= group.nbytes
        choices.append(choices[-1] | {group.index})
    by_index = {g.index: g for g in groups}
    return min(choices, key=lambda homes: (_traffic(events, by_index, homes, sizes, limit), -len(homes)))


def _traffic(events: Sequence[Event], groups: dict[int, GroupChunks], homes: set[int],
             sizes: dict[str, int], limit: int) -> int:
    """Bytes one steady step moves if `homes` stay on the device: Belady from the steady start.

    A step starts with what the last one left resident, less the gradient chunks (zero_grad frees
    them; re-making them copies nothing) and less the parameter chunks the host optimizer rewrote.
    Two rounds from "the homes are resident" reach that start in practice.
    """
    accesses, nonmodel = steady_sequence(events, groups, homes)
    budgets = chunk_budgets(accesses, nonmodel, sizes, limit)
    nexts = next_uses(accesses)
    grads = {g.grad for g in groups.values()}
    rewritten = {g.param for index, g in groups.items() if index not in homes}
    start = {name for i in homes for name in (groups[i].param, *groups[i].updated)}
    for _ in range(2):
        moved = simulate(accesses, sizes, budgets, lambda i, held, _: max(held, key=lambda c: nexts[i].get(c, INFINITY)),
                         resident=start, dirty=start, free=grads)
        start = moved["end"] - grads - rewritten
    streamed = sum(sizes[g.grad] for index, g in groups.items() if index not in homes)
    return moved["h2d"] + moved["d2h"] + streamed


def steady_sequence(events: Sequence[Event], groups: dict[int, GroupChunks],
                    homes: set[int]) -> tuple[list[Access], list[int]]:
    """The device accesses of a step once homes are fixed, and the non-model bytes at each. An access
    needs its chunks and those held around it on the device together."""
    accesses, nonmodel = [], []
    for event in events:
        if event.kind == "use":
            accesses.append(Access(event.chunks + event.held))
        elif event.group in homes and event.kind == "grad":
            accesses.append(Access((groups[event.group].grad, *event.held), frozenset([groups[event.group].grad])))
        elif event.group in homes and event.kind == "optim":
            g = groups[event.group]
            accesses.append(Access(tuple(dict.fromkeys((g.param, g.grad, *g.updated, *event.held))),
                                   frozenset((g.param, *g.updated))))
        else:
            continue
        nonmodel.append(event.nonmodel)
    return accesses, nonmodel


def chunk_budgets(accesses: Sequence[Access], nonmodel: Sequence[int], sizes: dict[str, int],
                  limit: int) -> list[int]:
    """Budget for chunks at each access: what non-model data (now and next) leaves, less the margin.

    Never below what the access itself needs: if non-model data leaves less, the plan holds only
    that access's chunks there, and the out-of-memory fallback handles the rest.
    """
    margin = int(limit * SAFETY_FRACTION)
    out = []
    for i, access in enumerate(accesses):
        ahead = nonmodel[i + 1] if i + 1 < len(nonmodel) else 0
        need = sum(sizes[c] for c in set(access.chunks))
        out.append(max(need, limit - max(nonmodel[i], ahead) - margin))
    return out


class Follower:
    """Walks a plan access by access; says what to do and notices when the step leaves the path."""

    def __init__(self, plan: Plan, accesses: Sequence[Access], nonmodel: Sequence[int]) -> None:
        self.plan = plan
        self.accesses = list(accesses)
        self.nonmodel = list(nonmodel)  # recorded non-model bytes at each access
        self.nexts = next_uses(accesses)
        self.by_index: dict[int, list] = {}
        for action in plan.actions:
            self.by_index.setdefault(action.at, []).append(action)
        self.cursor = 0

    def matches(self, chunks: tuple[str, ...]) -> bool:
        return self.cursor < len(self.accesses) and self.accesses[self.cursor].chunks == chunks

    def next_use(self, name: str) -> int:
        """When the chunk is needed next, counted from the current access (INFINITY: not this step)."""
        if self.cursor == 0:
            return INFINITY
        return self.nexts[self.cursor - 1].get(name, INFINITY)

    def finished(self) -> bool:
        return self.cursor == len(self.accesses)


def plan_step(events: Sequence[Event], groups: Sequence[GroupChunks], sizes: dict[str, int],
              limit: int) -> tuple[set[int], Follower]:
    """Everything decided at the end of warm-up: homes, the steady sequence and its Belady plan."""
    homes = decide_homes(events, groups, sizes, limit)
    accesses, nonmodel = steady_sequence(events, {g.index: g for g in groups}, homes)
    budgets = chunk_budgets(accesses, nonmodel, sizes, limit)
    return homes, Follower(build_plan(accesses, sizes, budgets), accesses, nonmodel)


class Placer:
    """Drives a Residency through warm-up and the plan; also its eviction policy.

    The runtime reports every access here. While recording, eviction is least-recently-used under
    the conservative budget; while following, Belady over the recorded future under the per-access
    budget, with the plan's evictions and prefetches applied around each access.
    """

    def __init__(self, residency: Residency, store: ParamStore, limit: int, working_set: int,
                 nonmodel: Callable[[], int]) -> None:
        self.residency = residency
        self.store = store
        self.limit = limit
        self.nonmodel = nonmodel
        self.chunks = {c.name: c for c in store.chunks()}
        self.param_chunks = [g.param for g in store.owned_groups()]  # what modules pin while they run
        self.sizes = {name: c.nbytes for name, c in self.chunks.items()}
        self.groups = [GroupChunks(g.index, g.param.name, g.chunks["grad"].name,
                                   tuple(dict.fromkeys([g.master.name, *_state_names(g)])),  # master is param in fp32
                                   sum(c.nbytes for c in g.chunks.values())) for g in store.trainable_groups()]
        everything_fits = store.model_data_bytes() <= limit
        self.homes = {g.index for g in self.groups} if everything_fits else set()
        self.conservative = limit if everything_fits else max(working_set, int(limit * WARMUP_FRACTION))
        self.working_set = working_set
        self.lru = LeastRecentlyUsed()
        self.phase = Phase.RECORD
        self.events: list[Event] = []
        self.follower: Follower | None = None
        self.start: set[str] = set()
        self.off_path = False  # a forward without gradients (evaluation): served, not recorded or followed
        residency.policy = self
        residency.limit = self.conservative

    @property
    def _following(self) -> Follower:
        assert self.follower is not None, "the placer follows a plan only after warm-up"
        return self.follower

    # -- EvictionPolicy -----------------------------------------------------------------------------
    def accessed(self, chunk: Chunk) -> None:
        self.lru.accessed(chunk)

    def victim(self, candidates: list[Chunk]) -> Chunk:
        if self.phase is Phase.FOLLOW:
            return max(candidates, key=lambda c: (self._following.next_use(c.name), c.name))
        return self.lru.victim(candidates)

    # -- accesses ---------------------------------------------------------------------------------
    def homed(self, group: int) -> bool:
        return group in self.homes

    def access(self, chunks: Sequence[Chunk], kind: str = "use", group: int = -1) -> None:
        """Chunks needed on the device together now (kind "use"), or a group's gradient write or
        optimizer update (device accesses only when the group is homed on the device)."""
        names = tuple(c.name for c in chunks)
        held = self._held(names)
        if self.off_path:
            self._fetch(chunks)
            return
        nonmodel = self.nonmodel() if self.phase is not Phase.FOLLOW else 0
        if self.phase is Phase.RECORD:
            self.events.append(Event(kind, names, group, nonmodel, held))
        if kind != "use" and group not in self.homes:
            return
        if self.phase is Phase.FOLLOW:
            self._check_path(names + held)
        else:
            self._conservative_now(nonmodel, sum(self.sizes[n] for n in {*names, *held}))
        self._fetch(chunks)
        if self.phase is Phase.FOLLOW:
            self._following.cursor += 1
            self._prefetch(self._following.cursor)

    def updated_on_host(self, chunk: Chunk) -> None:
        """A streamed group's parameter chunk was just rewritten by the host optimizer. If the next step's
        plan will want it on the device from the start (it fits under the first access's budget beside
        what is resident), upload it now: on CUDA the copy then overlaps the next group's update rather
        than the next forward. The plan is rebuilt from what is resident when the step ends, as always."""
        if self.phase is not Phase.FOLLOW or self.off_path or chunk.state.on_device:
            return
        budgets = self._following.plan.budgets
        room = min(self.residency.limit, budgets[0]) if budgets else 0
        if self.residency.stats.device_chunk_bytes + chunk.nbytes <= room:
            self.residency.to_device(chunk, "prefetch")

    def moment(self) -> None:
        """Between accesses activations grow too: without a plan, re-fit the chunks at every moment."""
        if self.phase is not Phase.FOLLOW and not self.off_path:
            self._conservative_now(self.nonmodel())

    def _held(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Chunks pinned on the device besides `names`: those of the modules this access runs inside."""
        return tuple(sorted(c.name for c in self.param_chunks if c.pins and c.name not in names))

    def _conservative_now(self, nonmodel: int, need: int = 0) -> None:
        """Without a plan (warm-up, a diverged step) the chunk budget is the conservative one, lowered to
        what the non-model data on the device now leaves, less the margin, but never below the working
        set nor what the access now (`need`: its chunks and those held around it) needs: chunks give way
        to activations as they grow, as the plan's budgets do later."""
        left = self.limit - nonmodel - int(self.limit * SAFETY_FRACTION)
        self.residency.limit = max(self.working_set, min(need, self.limit), min(self.conservative, left))
        self.residency.shrink()

    def _fetch(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            chunk.pins += 1
        try:
            for chunk in chunks:
                self.residency.to_device(chunk)
        finally:
            for chunk in chunks:
                chunk.pins -= 1

    def _before(self, index: int) -> None:
        self.residency.limit = self._following.plan.budgets[index]
        for action in self._following.by_index.get(index, []):
            chunk = self.chunks[action.chunk]
            if action.verb == "evict" and chunk.state.on_device and not chunk.pins:
                self.residency.evict(chunk)

    def _prefetch(self, index: int) -> None:
        follower = self._following
        if index >= len(follower.accesses):
            return
        room = min(follower.plan.budgets[index - 1], follower.plan.budgets[index])
        for action in follower.by_index.get(index, []):
            chunk = self.chunks[action.chunk]
            if action.verb == "prefetch" and not chunk.state.on_device and \
                    self.residency.stats.device_chunk_bytes + chunk.nbytes <= room:
                self.residency.to_device(chunk, "prefetch")

    def _check_path(self, names: tuple[str, ...]) -> None:
        """Follow the plan if this access is the recorded one and non-model data is as recorded."""
        follower = self._following
        if not follower.matches(names):
            expected = follower.accesses[follower.cursor].chunks \
                if follower.cursor < len(follower.accesses) else "the end of the step"
            self._diverge(f"chunk access {follower.cursor} of this step was {names}, the warm-up "
                          f"recorded {expected} (another branch?)")
            return
        now, then = self.nonmodel(), follower.nonmodel[follower.cursor]
        if now > then + int(self.limit * SAFETY_FRACTION):
            self._diverge(f"non-model data at chunk access {follower.cursor} is {now} bytes, the warm-up "
                          f"recorded {then} (a larger input?)")
            return
        self._before(follower.cursor)

    def _diverge(self, why: str) -> None:
        log.warning("%s: placing by least-recently-used under the conservative budget for the rest of "
                    "this step, and recording the next one", why)
        self.phase = Phase.DIVERGED
        self.residency.limit = self.conservative

    def out_of_memory(self, error: Exception) -> None:
        """A compute op ran out of device memory: free every chunk not in use, stay conservative for the
        rest of this step and record the next (its non-model data outgrew what the plan assumed)."""
        self._diverge(f"device out of memory in a forward op ({error}); evicted every chunk not in use")
        self.residency.evict_unpinned()

    # -- steps ------------------------------------------------------------------------------------
    def step_done(self) -> None:
        """At the end of an optimizer step: plan after warm-up, re-plan or re-record after that."""
        if self.phase is Phase.FOLLOW and not self._following.finished():
            self._diverge(f"the step ended after {self._following.cursor} chunk accesses, the warm-up "
                          f"recorded {len(self._following.accesses)}")
        if self.phase is Phase.DIVERGED:
            self.phase, self.events = Phase.RECORD, []
            return
        if self.phase is Phase.RECORD:
            self.homes, self.follower = plan_step(self.events, self.groups, self.sizes, self.limit)
            self._send_home_others()
            self.phase, self.events, self.start = Phase.FOLLOW, [], set()
        # The plan starts from what is resident now, less the gradients zero_grad will free; the steady
        # state repeats, so re-plan only when that changes.
        resident = set(self.residency.resident) - {g.grad for g in self.groups}
        follower = self._following
        if resident != self.start:
            self.start = resident
            plan = build_plan(follower.accesses, self.sizes, follower.plan.budgets, resident)
            follower = self.follower = Follower(plan, follower.accesses, follower.nonmodel)
        follower.cursor = 0

    def _send_home_others(self) -> None:
        """Groups that lost their device home leave the device but for their parameter chunk."""
        for group in self.store.trainable_groups():
            if group.index not in self.homes:
                for kind, chunk in group.chunks.items():
                    if kind != "param":
                        self.residency.evict(chunk)


def _state_names(group: ChunkGroup) -> list[str]:
    return [c.name for k, c in group.chunks.items() if k not in ("param", "grad", "master")]
