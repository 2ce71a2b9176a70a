"""Placement while training runs: recording the warm-up step, then following the plan it gives.

[Note: warm-up]
The first step runs under a conservative chunk budget and records, at every access of chunks, the
non-model bytes on the device and which chunks were needed ("use"), which gradient chunk was written
("grad") and which chunk group the optimizer updated ("optim"). The conservative budget also gives
way at every moment to the non-model bytes measured then (less the margin, never below one module's
working set while they leave that much, else down to the chunks pinned then, those the access needs and one
chunk); growth inside one module between two moments cannot be foreseen without a record, and on CUDA the
out-of-memory fallback catches it. At the end of that step chunks/planning.py decides the
homes, the steady accesses and their budgets, and the plan (its Note on homes).

[Note: following]
Every later step follows the plan access by access. A step whose modules depend on the data
(mixture-of-experts routing, layers dropped at random, another branch) skips recorded accesses or
makes ones the record lacks: the follower finds an access further on in the record and skips to it,
and serves one the record lacks off the plan, evicting by the plan's rule with the budget where it
is; at the step's end the step's own accesses, always recorded, become the plan for the next (the
homes stay). A step that holds more non-model data than its record (a larger input, experts given
more tokens) keeps following, its budget lowered at every access and moment to what the non-model
data leaves, and it too becomes the next plan. Only an out-of-memory error makes a step fall back to
least-recently-used under the conservative budget and the next one record anew.

[Note: resident steps]
When every group is homed and every chunk is on the device (or FREE: a gradient chunk zeroed since, which
materializes where its gradient arrives), nothing can move: no access needs room, so following the plan
decides nothing. The runtime then serves the step "resident" (runtime's Note on resident steps): accesses
come here only to be served, no moment is measured, and the step's end keeps the plan. A resident step that
outgrew its plan's non-model data is followed by a recorded one.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.plan import INFINITY, Action, Plan, next_uses, victim
from chunkmem.chunks.planning import SAFETY_FRACTION, Event, GroupChunks, Step, decide_homes, steady_sequence
from chunkmem.chunks.residency import LeastRecentlyUsed, Residency
from chunkmem.chunks.state import ChunkState
from chunkmem.chunks.store import ChunkGroup, ParamStore
from chunkmem.errors import ACTIVATION_FIXES, MemoryBudgetError

log = logging.getLogger("chunkmem")
T = TypeVar("T")

WARMUP_FRACTION = 0.5  # of the device budget, for chunks, while nothing is known of non-model data


class Phase(enum.Enum):
    RECORD = "record"  # warm-up: conservative budget, LRU, record
    FOLLOW = "follow"  # steady state: follow the plan
    DIVERGED = "diverged"  # this step left the recorded path: conservative until it ends, then record


class Follower:
    """Walks a plan access by access (the Note on following): finds each access of the step in the record,
    at the cursor or further on, and counts what the step skipped or did off the record."""

    def __init__(self, step: Step, plan: Plan, sizes: dict[str, int], limit: int, start: Collection[str] = ()) -> None:
        self.step = step
        self.plan = plan
        self.accesses = step.accesses
        self.needs = [_bytes(a.chunks, sizes) for a in step.accesses]  # what each access needs on the device
        # Each access's chunk budget while not giving way (Placer._budget's, for the fast path `_steady`), and the
        # non-model bytes beyond which a step gives way there (`_locate`, `_steady`).
        self.limits = [max(budget, min(need, limit)) for budget, need in zip(plan.budgets, self.needs)]
        self.outgrown = [nonmodel + int(limit * SAFETY_FRACTION) for nonmodel in step.nonmodel]
        self.nexts = next_uses(step.accesses, step.carried)
        self.evicts: dict[int, list[str]] = {}  # access index -> what the plan evicts (prefetches) before it
        self.prefetches: dict[int, list[str]] = {}
        self.last_evicted: dict[str, int] = {}  # chunk -> the last access the plan evicts it before
        for action in plan.actions:
            if action.verb != "fetch":
                verb = self.evicts if action.verb == "evict" else self.prefetches
                verb.setdefault(action.at, []).append(action.chunk)
            if action.verb == "evict":
                self.last_evicted[action.chunk] = action.at
        self.peak_nonmodel = max(step.nonmodel, default=0)
        self.spare_after, self.spare_before, self.first_brought, self.held_at_end = _spare_room(step, plan, sizes, start)
        self.positions: dict[tuple[str, ...], list[int]] = {}
        for i, access in enumerate(step.accesses):
            self.positions.setdefault(access.chunks, []).append(i)
        self.cursor = 0

    def locate(self, chunks: tuple[str, ...]) -> int | None:
        """Where this access comes in the record, at the cursor or later; None when the rest lacks it."""
        if self.cursor < len(self.accesses) and self.accesses[self.cursor].chunks == chunks:  # on the record
            return self.cursor
        positions = self.positions.get(chunks, [])
        at = bisect.bisect_left(positions, self.cursor)
        return positions[at] if at < len(positions) else None

    def next_uses_now(self) -> dict[str, int]:
        """When each chunk is needed next, counted from the cursor (INFINITY: not this step or the next)."""
        return self.nexts[self.cursor - 1] if self.cursor > 0 else {}


class Placer:
    """Drives a Residency through warm-up and the plan; also its eviction policy.

    The runtime reports every access here. While recording, eviction is least-recently-used under
    the conservative budget; while following, the plan's rule (chunks/plan.py `victim`) over the
    recorded future under the per-access budget, with the plan's evictions and prefetches applied
    around each access.
    """

    def __init__(self, residency: Residency, store: ParamStore, limit: int, working_set: int,
                 nonmodel: Callable[[], int], headroom: Callable[[], int] = lambda: 0,
                 rise: Callable[[], int] = lambda: 0) -> None:
        self.residency = residency
        self.store = store
        self.limit = limit
        # What non-model data may take beyond what it holds before chunks give way: the margin, and at least
        # two of the allocator's segments, which one allocation may reserve anew (a small budget's 5% is less).
        self.margin = max(int(limit * SAFETY_FRACTION), 2 * residency.device.segment_bytes)
        self.nonmodel = nonmodel
        self.headroom = headroom  # non-model bytes a plan leaves room for beyond its record (BackwardRoom.largest_block)
        self.rise = rise  # the most non-model data grew between two readings (runtime.largest_rise)
        self.chunks = {c.name: c for c in store.chunks()}
        self.pinned: set[str] = set()  # parameter chunks the running modules pin (`pin`)
        self.sizes = {name: c.nbytes for name, c in self.chunks.items()}
        self.groups = [GroupChunks(g.index, g.param.name, g.grad.name,
                                   tuple(dict.fromkeys([g.master.name, *(c.name for c in store.states(g))])),
                                   sum(c.nbytes for c in g.chunks.values()),
                                   sum(r.slot.numel for r in g.members) * g.grad.dtype.itemsize,
                                   _update_scratch(g))
                       for g in store.trainable_groups()]
        self.by_index = {g.index: g for g in self.groups}
        # Disk-backed groups stream through the host optimizer (hostcache's Note on three tiers).
        self.streamed = {g.index for g in store.trainable_groups() if any(c.tier for c in g.chunks.values())}
        # What the device holds already counts: on CUDA, what the process holds outside the allocator (the context,
        # libraries) and what the allocator holds for others (a plain twin, another model).
        everything_fits = not self.streamed and store.model_data_bytes() <= limit - nonmodel()
        self.homes = {g.index for g in self.groups} if everything_fits else set()
        self.conservative = limit if everything_fits else max(working_set, int(limit * WARMUP_FRACTION))
        self.working_set = working_set
        # The largest chunk of any kind (a bf16 model's master chunk: twice a parameter chunk's bytes), what `_floor`
        # keeps below the working set; a parameter chunk's bytes gave the budget sweep the same outcomes (guide).
        self.one_chunk = min(working_set, max(self.sizes.values(), default=0))
        self.lru = LeastRecentlyUsed()
        self.phase = Phase.RECORD
        self.events: list[Event] = []  # this step's, kept in every phase: a step off the record re-plans from them
        self.last_events: list[Event] = []  # the last step's (trace/timing.py replays them)
        self.backwards = 0  # this step's backward passes: each streams the streamed groups' gradients
        self.follower: Follower | None = None
        self.start: set[str] = set()
        self.off_path = False  # a forward without gradients (evaluation): served, not recorded or followed
        self.sent_early = 0  # bytes of parameter chunks sent up this step for the next (`updated_on_host`)
        self.replans = 0  # steps whose accesses differed from the plan's and became the next plan
        self.giving_way = False  # this step held more non-model data than its plan recorded
        self.resident = False  # serving a resident step now (the Note on resident steps)
        self.served_resident = False  # some of this step was served resident: its record is partial
        self.host_weight = 0.0  # decide_homes': what a host update costs in bytes of copying (planning's Note)
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
        if self.phase is not Phase.FOLLOW:
            return self.lru.victim(candidates)
        follower = self._following
        names = {c.name: c for c in candidates}
        dirty = {name for name, c in names.items() if c.state is ChunkState.DEVICE_DIRTY}
        return names[victim(follower.cursor, names, follower.next_uses_now(), dirty, follower.step.write_back)]

    # -- accesses ---------------------------------------------------------------------------------
    def homed(self, group: int) -> bool:
        return group in self.homes

    @property
    def all_homed(self) -> bool:
        return len(self.homes) == len(self.groups)

    @property
    def steady(self) -> bool:
        """Following a plan, with no more non-model data than it recorded so far this step."""
        return self.phase is Phase.FOLLOW and not self.giving_way

    @property
    def can_stay(self) -> bool:
        """Whether a resident step can start now: steady under a plan that homes every group, with every chunk
        on the device or FREE (the Note on resident steps)."""
        return self.steady and self.all_homed and \
            all(c.state.on_device or c.state is ChunkState.FREE for c in self.chunks.values())

    def serve_resident(self) -> None:
        """From now until the step ends, serve accesses without following the plan: nothing moves. Chunks
        take the whole budget, so a FREE chunk materializing never evicts one; compute waits once for every
        upload still landing, so no access needs a fence (parameters are read without one)."""
        self.resident = self.served_resident = True
        self.residency.limit = self.limit
        for chunk in self.residency.resident.values():
            chunk.fence()

    def outgrown(self, nonmodel: int) -> bool:
        """Whether `nonmodel` bytes are more than the plan recorded at any access, beyond the margin: a resident
        step that sees that stops being one and gives way (the Note on following)."""
        if nonmodel <= self._following.peak_nonmodel + int(self.limit * SAFETY_FRACTION):
            return False
        self.resident = False
        self.giving_way = True
        self.moment(nonmodel)
        return True

    def access(self, chunks: Sequence[Chunk], kind: str = "use", group: int = -1, nonmodel: int | None = None) -> None:
        """Chunks needed on the device together now (kind "use"), or a group's gradient write or
        optimizer update (device accesses only when the group is homed on the device). `nonmodel`: the non-model
        bytes read just before (Runtime.emit), else read here."""
        # The hot path: every module call, saved tensor unpacked, gradient written and group updated comes here.
        if self.resident:  # nothing moves: only a FREE gradient chunk materializes (the Note on resident steps)
            for chunk in chunks:
                if not chunk.state.on_device:
                    self.residency.bring(chunk)
            return
        names = (chunks[0].name,) if len(chunks) == 1 else tuple([c.name for c in chunks])
        held = self._held(names) if self.pinned else ()
        if nonmodel is None:
            nonmodel = self.nonmodel()
        elif kind != "use" and group not in self.homes and not self.off_path:  # a streamed group's: recorded only
            self.events.append(Event(kind, names, group, nonmodel, held))
            return
        elif self._steady(chunks, names + held if held else names, kind, group, nonmodel):
            self.events.append(Event(kind, names, group, nonmodel, held))
            return
        if self.off_path:  # evaluation or generation between steps: no plan for it, the warm-up's rule
            self._conservative_now(nonmodel, sum(self.sizes[n] for n in {*names, *held}))
            self._fetch(chunks)
            return
        self.events.append(Event(kind, names, group, nonmodel, held))
        if kind != "use" and group not in self.homes:
            return
        if self.phase is not Phase.FOLLOW:
            self._conservative_now(nonmodel, sum(self.sizes[n] for n in {*names, *held}))
            self._fetch(chunks)
            return
        follower = self._following
        index = self._locate(follower, names + held if held else names, nonmodel)
        self._fetch(chunks)
        if index is not None:
            follower.cursor = index + 1
            if index + 1 in follower.prefetches:
                self._prefetch(follower, index + 1)

    def _steady(self, chunks: Sequence[Chunk], key: tuple[str, ...], kind: str, group: int, nonmodel: int) -> bool:
        """Serve an access the plan has nothing to do at, as the rest of `access` would, in fewer steps (the hot path of
        a steady step): following the plan without giving way, the access on the record at the cursor (`key`: its chunks
        and those held around it) within its non-model bytes, no eviction before it nor prefetch after it, and its
        chunks on the device with no upload landing: the cursor moves on and the access's budget is set. False: not
        such an access."""
        follower = self.follower
        if follower is None or self.phase is not Phase.FOLLOW or self.giving_way or self.off_path or \
                (kind != "use" and group not in self.homes):
            return False
        at = follower.cursor
        if at >= len(follower.accesses) or follower.accesses[at].chunks != key or nonmodel > follower.outgrown[at] or \
                at in follower.evicts or at + 1 in follower.prefetches:
            return False
        for chunk in chunks:
            if chunk.pending is not None or not chunk.state.on_device:
                return False
        follower.cursor = at  # the plan's rule picks what a shrink evicts from here, as `_locate`'s does
        self.residency.limit = limit = follower.limits[at]
        if self.residency.stats.device_chunk_bytes > limit:  # more left resident than the plan's start (an evaluation)
            self.residency.shrink()
            self._fetch(chunks)  # unpinned, they may have been among its victims
        else:
            for chunk in chunks:
                self.lru.accessed(chunk)
        follower.cursor = at + 1
        return True

    def updated_on_host(self, chunk: Chunk) -> None:
        """A streamed group's parameter chunk was just rewritten by the host optimizer. If it fits, beside what
        the plan holds, at every access from now until the plan brings it next step (and beside the chunks sent up
        early before it), upload it now: on CUDA the copy then overlaps the next group's update rather than the
        next forward. A chunk first used after other accesses (a frozen model's forward that comes first, under a
        manager) would otherwise push out chunks the plan keeps, and they would move twice. Not if the plan evicts
        it later in this step (to make room for a homed group's update): it would come up twice. The plan is
        rebuilt from what is resident when the step ends, as always."""
        if self.phase is not Phase.FOLLOW or self.off_path or chunk.state.on_device:
            return
        follower = self._following
        first = follower.first_brought.get(chunk.name)
        if first is None or follower.last_evicted.get(chunk.name, -1) >= follower.cursor:
            return
        # It stays from now until the plan brings it next step: room the plan leaves free at every access in between
        # (for the rest of this step none if the plan holds it to the end, not knowing the host rewrote it).
        after = INFINITY if chunk.name in follower.held_at_end else follower.spare_after[follower.cursor]
        room = min(after, follower.spare_before[first]) - self.sent_early
        if chunk.nbytes <= room and self.residency.stats.device_chunk_bytes + chunk.nbytes <= self.residency.limit:
            self.residency.bring(chunk, "prefetch")
            self.sent_early += chunk.nbytes

    def moment(self, nonmodel: int) -> None:
        """Between accesses activations grow too (`nonmodel` bytes now): without a plan, or once a step outgrew
        its plan's record, re-fit the chunks at every moment."""
        if self.off_path:
            return
        if self.phase is not Phase.FOLLOW:
            self._conservative_now(nonmodel)
        elif self.giving_way:
            self._budget(self.residency.limit, nonmodel, 0)

    def pin(self, chunk: Chunk) -> None:
        """A running module uses parameters of `chunk`: it stays on the device, held around the accesses inside."""
        chunk.pins += 1
        self.pinned.add(chunk.name)

    def unpin(self, chunk: Chunk) -> None:
        chunk.pins -= 1
        if not chunk.pins:
            self.pinned.discard(chunk.name)

    def _held(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """Chunks pinned on the device besides `names`: those of the modules this access runs inside."""
        return tuple(sorted([n for n in self.pinned if n not in names]))

    def _conservative_now(self, nonmodel: int, need: int = 0) -> None:
        """Without a plan (warm-up, a diverged step) the chunk budget is the conservative one, lowered to
        what the non-model data on the device now leaves, less the margin, but never below the working set
        (unless that leaves less: `_floor`) nor what the access now (`need`: its chunks and those held around it)
        needs: chunks give way to activations as they grow, as the plan's budgets do later. Chunks give way at
        accesses, but non-model data also grows between them (the loss's logits, a gradient of backward, the
        optimizer's temporaries). A forward op that finds no room is retried once chunks made room
        (`out_of_memory`), a backward op cannot be: in backward the margin is at least the most non-model data
        grew between two readings so far. Once an allocation has failed, also the room a plan leaves (`headroom`),
        so a step recorded again leaves room for that allocation (before, each fell back again)."""
        margin = self.margin
        if self.residency.stats.oom_fallbacks:
            margin = max(margin, self.headroom(), self.rise())
        elif torch._C._current_graph_task_id() != -1:  # in backward
            margin = max(margin, self.rise())
        left = self.limit - nonmodel - margin
        self.residency.limit = max(self._floor(left, need), min(need, self.limit), min(self.conservative, left))
        self.residency.shrink()

    def _floor(self, left: int, need: int) -> int:
        """The least chunks give way to when non-model data leaves `left` bytes: one module's working set while it
        fits there, else the chunks pinned now, those the access needs (`need` bytes) and one chunk: a budget that holds
        the working set only beside smaller activations trains (more moves). One chunk stays, as the next op of the
        module reads it again: evicted, its slot would go back to the allocator, activations would split it, and it
        could not come back. Never above the budget: pinned chunks beyond it (a segment's, held through its backward
        under non-reentrant checkpointing) are refused by name, not kept over it (FocalNet and Zamba2 trained at a
        tenth of their model data with their chunks alone at 3-5 times the budget, and were refused at more)."""
        if left >= self.working_set:
            return self.working_set
        return min(self.limit, max(need, sum(self.sizes[n] for n in self.pinned), self.one_chunk))

    def _fetch(self, chunks: Sequence[Chunk]) -> None:
        if len(chunks) == 1:  # nothing else to keep while it comes (it cannot evict itself)
            self.residency.bring(chunks[0])
            return
        for chunk in chunks:
            chunk.pins += 1
        try:
            for chunk in chunks:
                self.residency.bring(chunk)
        finally:
            for chunk in chunks:
                chunk.pins -= 1

    def _locate(self, follower: Follower, names: tuple[str, ...], nonmodel: int) -> int | None:
        """Where the plan has this access (the Note on following), its evictions applied and its budget set;
        None when this step makes it off the record."""
        index = follower.locate(names)
        if index is None:  # off the record: the plan's rule and the budget where the step is
            self._budget(follower.plan.budgets[min(follower.cursor, len(follower.accesses) - 1)], nonmodel,
                         _bytes(names, self.sizes))
            return None
        if nonmodel > follower.outgrown[index]:
            self.giving_way = True  # more non-model data than recorded (a larger input, other experts)
        follower.cursor = index
        if index in follower.evicts:
            for name in follower.evicts[index]:
                chunk = self.chunks[name]
                if chunk.state.on_device and not chunk.pins:
                    self.residency.evict(chunk)
        self._budget(follower.plan.budgets[index], nonmodel, follower.needs[index])
        return index

    def _budget(self, planned: int, nonmodel: int, need: int) -> None:
        """The plan's budget for an access needing `need` bytes of chunks (an access off the record may need more
        than the budget there); once this step has held more non-model data than its record, lowered further at
        every access and moment to what the non-model data leaves (as in warm-up, down to `_floor`), but never raised
        above the plan's beyond one chunk: the plan knows the non-model data to come, and a slot held beyond it is
        room activations cannot use (ConvNeXt, fp32, a quarter of its model data: CUDA's error in backward)."""
        if self.giving_way:
            left = self.limit - nonmodel - self.margin
            planned = min(max(planned, self.one_chunk), max(self._floor(left, need), left))
        self.residency.limit = limit = max(planned, min(need, self.limit))
        if self.residency.stats.device_chunk_bytes > limit:
            self.residency.shrink()

    def _prefetch(self, follower: Follower, index: int) -> None:
        """The plan's prefetches before access `index`."""
        # Into free room only: a prefetch never evicts (the limit may sit below the plan's, giving way).
        room = min(follower.plan.budgets[index - 1], follower.plan.budgets[index], self.residency.limit)
        for name in follower.prefetches[index]:
            chunk = self.chunks[name]
            if not chunk.state.on_device and self.residency.stats.device_chunk_bytes + chunk.nbytes <= room:
                self.residency.bring(chunk, "prefetch")

    def diverge(self, why: str) -> None:
        """Leave the plan for the rest of this step (`why` it no longer holds), and record the next step."""
        log.warning("%s: placing by least-recently-used under the conservative budget for the rest of "
                    "this step, and recording the next one", why)
        self.phase = Phase.DIVERGED
        self.residency.limit = self.conservative

    def out_of_memory(self, error: torch.OutOfMemoryError, retry: Callable[[], T]) -> T:
        """A compute op ran out of device memory: free chunks not in use until `retry()` succeeds, stay
        conservative (at the chunk bytes left) for the rest of this step and record the next (its non-model data
        outgrew what the plan assumed). When no chunk is left to free, activations alone do not fit: a
        MemoryBudgetError that says so."""
        self.diverge(f"device out of memory in a forward op ({error}); evicting chunks not in use until it fits")
        self.resident = False
        try:
            return self.residency.retry_out_of_memory(error, retry)
        except torch.OutOfMemoryError as failed:
            pinned = self.residency.stats.device_chunk_bytes
            chunks = f"only the {pinned} bytes of chunks the running modules need ({_mib(pinned)})" if pinned else \
                "no chunk"
            raise MemoryBudgetError(
                f"activations and temporaries do not fit the device budget: with {chunks} left on the device, the "
                f"other {_mib(self.nonmodel())} it holds and the next allocation exceed Config.device_memory="
                f"{self.limit} bytes ({_mib(self.limit)}): {ACTIVATION_FIXES}. The allocator said: {failed}"
            ) from failed
        finally:
            self.residency.limit = max(self.working_set, self.residency.stats.device_chunk_bytes)
            del error  # its traceback holds the frames calling this one: a cycle (Residency.retry_out_of_memory)

    # -- steps ------------------------------------------------------------------------------------
    def step_done(self) -> None:
        """At the end of an optimizer step: plan after warm-up; after that, re-plan when this step's accesses
        differ from the plan's (they are the next step's best guess) or the next step starts from other
        resident chunks; re-record after a step that fell back."""
        events, self.events = self.events, []
        self.last_events = events
        passes, self.backwards = max(1, self.backwards), 0
        outgrown, self.giving_way = self.giving_way, False
        partial, self.served_resident, self.resident = self.served_resident, False, False
        if self.phase is Phase.DIVERGED or (partial and outgrown):
            self.phase = Phase.RECORD
            return
        # Nothing moved, and its accesses were not all recorded; or it made none a forward makes (a step() with no
        # gradient to apply, a penalty on parameters alone): the plan stays, or the warm-up goes on.
        if partial or not any(e.kind == "use" for e in events):
            if self.follower is not None:
                self.follower.cursor = 0
            return
        held = max([e.nonmodel for e in events], default=0) + self.headroom()
        if self.phase is Phase.RECORD:
            step = decide_homes(events, self.groups, self.sizes, self.limit, self.streamed, held, passes,
                                self.host_weight)
            self.homes = set(step.homes)
            self._send_home_others()
            self.phase = Phase.FOLLOW
        else:
            # Most steps make the plan's accesses: compare them before working out budgets for a new plan. Non-model
            # memory that grew within the margin (the allocator's holes move from step to step) lowers the budget
            # of the steps after, so that the margin is for one step's growth (planning's Note on one budget a step).
            planned = self._following.step
            if not outgrown and self._same(events, planned):
                step = planned if held <= planned.room_for else planned.leaving_room_for(held, self.sizes, self.limit)
            else:
                step = Step.of(events, self.by_index, self.homes, self.sizes, self.limit, held, planned.write_back)
                if not self.replans:
                    log.info("this step's chunk accesses or non-model data differ from its plan's (modules chosen by "
                             "the data, another input size?): each step follows a plan made from the one before")
                self.replans += 1
        # The plan starts from what is resident now and stays valid into the next step; the steady state
        # repeats, so the plan is rebuilt only when the step or that start changes.
        resident = set(self.residency.resident) & step.carried
        if self.follower is None or step is not self.follower.step or resident != self.start:
            self.start = resident
            dirty = {n for n in resident if self.chunks[n].state is ChunkState.DEVICE_DIRTY}
            plan = step.plan(self.sizes, resident, dirty, [n for n, c in self.chunks.items() if c.lends])
            if self.follower is None or plan.slots != self.follower.plan.slots:
                self.residency.device.arena.reserve(dict(plan.slots))  # planning's Note on one budget a step
            self.follower = Follower(step, plan, self.sizes, self.limit, resident)
        self._following.cursor = 0
        self.sent_early = 0

    def _same(self, events: list[Event], planned: Step) -> bool:
        """Whether a step's `events` made the plan's accesses with non-model data within the margin of the plan's,
        both as the plan counts them: a homed low-precision group's update with its scratch (planning's Note on
        update scratch). Compared raw, every such update differed by its scratch, and each step planned anew."""
        margin = int(self.limit * SAFETY_FRACTION)
        accesses, nonmodel = steady_sequence(events, self.by_index, self.homes)
        return accesses == planned.accesses and \
            all([abs(now - then) <= margin for now, then in zip(nonmodel, planned.nonmodel)])

    def _send_home_others(self) -> None:
        """Groups that lost their device home leave the device but for their parameter chunk."""
        for group in self.store.trainable_groups():
            if group.index not in self.homes:
                for kind, chunk in group.chunks.items():
                    if kind != "param":
                        self.residency.evict(chunk)


def _spare_room(step: Step, plan: Plan, sizes: dict[str, int], start: Collection[str]
                ) -> tuple[list[int], list[int], dict[str, int], set[str]]:
    """What the plan leaves free of each access's budget, from `start`: the least from access i to the step's end
    (`after[i]`) and before access i (`before[i]`; none before the first); the access before which each chunk is
    first brought (a prefetch goes up after the access before its own); and what is held when the step ends."""
    held, spare = set(start), []
    first: dict[str, int] = {}
    by_access: dict[int, list[Action]] = {}
    for action in plan.actions:
        by_access.setdefault(action.at, []).append(action)
        if action.verb != "evict":
            first.setdefault(action.chunk, action.at - (action.verb == "prefetch"))
    held_bytes = _bytes(tuple(held), sizes)
    for i, budget in enumerate(step.budgets):
        for action in by_access.get(i, ()):
            if (action.chunk in held) == (action.verb == "evict"):
                (held.discard if action.verb == "evict" else held.add)(action.chunk)
                held_bytes += sizes[action.chunk] * (-1 if action.verb == "evict" else 1)
        ahead = sum(sizes[a.chunk] for a in by_access.get(i + 1, ()) if a.verb == "prefetch")  # sent up after i
        spare.append(budget - held_bytes - ahead)
    after, before = spare + [INFINITY], [INFINITY]
    for i in range(len(spare) - 1, -1, -1):
        after[i] = min(spare[i], after[i + 1])
    for value in spare:
        before.append(min(before[-1], value))
    return after, before, first, held


def update_scratch(numel: int) -> list[int]:
    """The blocks a low-precision group's update of `numel` elements allocates on the device beside its chunks
    (planning's Note on update scratch): fp32 copies of its gradients and two fp32 temporaries of as many elements."""
    return [numel * 4] * 3


def _update_scratch(group: ChunkGroup) -> int:
    return sum(update_scratch(sum(r.slot.numel for r in group.members))) if "master" in group.chunks else 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _bytes(names: Sequence[str], sizes: dict[str, int]) -> int:
    """Bytes of the distinct chunks among `names`."""
    return sum(sizes[n] for n in set(names))
