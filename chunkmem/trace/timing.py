"""A time model of a chunkmem step on a GPU: a recorded step replayed on a compute stream, two copy streams and
the host, at measured speeds.

[Note: the time model]
On a CPU every kernel takes milliseconds and hides the host's bookkeeping; on a GPU the step is a race between
four timelines, and this model runs them over the step chunkmem recorded (its events, in order, each tagged with
the stage it ran in) and the plan it follows:
- the host issues every event, paying chunkmem's host cost of its stage (measured in the launch-bound regime:
  benchmarks/overhead.py), and runs the host optimizer of streamed groups (bytes at the host update's speed),
  waiting for their gradients to land first;
- compute runs each access once the host issued it and its chunks have landed: a share of the plain step's
  forward or backward time in proportion to the parameter bytes it computes with, or a homed group's update;
- uploads (fetches, prefetches, parameters sent up after a host update) queue on the host-to-device stream,
  downloads (dirty evictions, streamed gradients) on the device-to-host one, at the self-test's bandwidths. A
  fetch waits for the evictions that make its room; an eviction, for the compute that last used the chunk.
Prefetches are issued one access ahead, as the placer does. The model knows nothing of the caching allocator's
out-of-memory fallbacks: a step that needs them is slower than it says.

With updates made ahead (`overlap`), the host update runs on a team of OpenMP threads while the host launches
backward's kernels, and they share the cores: the lent H200's backward took 139-199 ms beside a team of 15 of its
16 threads, against 83 ms without (runtime/ahead.py's Note on the worker's threads). Given `Speeds.cores`, the host
also issues plain PyTorch's own launches (its launch-bound step), an update runs at its team's measured speed, and
a host event issued while a team runs takes 1 / (the share of its rate a launching thread kept beside a team that
size) as long: measured by benchmarks/host_threads.py. The team's busy times depend on when backward's gradients
land, which the slower host delays, so the replay runs again over the last pass's busy times until they settle.

`record` runs a step of a prepared model under its plan and keeps what the replay needs; a model recorded narrower
than the one predicted (the same layers, hidden sizes divided by n: chunks n**2 smaller) replays at the full
model's bytes with `scale` n**2 (benchmarks/time_model.py, `chunkmem plan --simulate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from chunkmem.chunks.observe import Moment, Move
from chunkmem.chunks.placement import Placer
from chunkmem.chunks.plan import Plan
from chunkmem.chunks.planning import Event, GroupChunks, Step, steady_chunks, update_bytes

if TYPE_CHECKING:
    from chunkmem.runtime.runtime import Runtime

STAGES = ("fwd", "bwd", "optim")


@dataclasses.dataclass(frozen=True)
class Speeds:
    """A machine's measured speeds. Bytes per second; seconds per step and stage."""

    h2d: float  # pinned host to device (the self-test's copy bandwidth)
    d2h: float
    host_update: float  # chunk bytes the host optimizer reads and writes per second
    device_update: float  # the same on the device, for homed groups
    compute: dict[str, float]  # seconds of kernels per stage in the plain step ("fwd", "bwd")
    host: dict[str, float]  # seconds of host work chunkmem adds per stage and step
    cores: Cores | None = None  # how the host's cores are shared with updates made ahead; None: not at all


@dataclasses.dataclass(frozen=True)
class Cores:
    """The host's cores as a step with updates made ahead shares them (the Note above): measured speeds by team
    size (threads of the host update's OpenMP team)."""

    plain_host: dict[str, float]  # seconds of plain PyTorch's own host work per stage, launch-bound
    update: dict[int, float]  # team size -> the host update's bytes per second
    kept: dict[int, float]  # team size -> share of its rate a thread launching small ops keeps beside it
    backward_team: int  # threads updating while backward runs
    team: int  # threads updating once it has ended

    @staticmethod
    def at(measured: dict[int, float], team: int) -> float:
        """The figure measured at the team size nearest `team`."""
        return measured[min(measured, key=lambda n: (abs(n - team), n))]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One step as chunkmem ran it: its events with the stage of each, its groups and their homes, and the plan."""

    events: Sequence[Event]
    stages: Sequence[str]  # per event
    groups: Sequence[GroupChunks]
    homes: frozenset[int]
    sizes: dict[str, int]
    step: Step
    plan: Plan
    scale: float = 1.0  # multiplies every byte count (a step recorded on a narrower model of the same shape)


@dataclasses.dataclass(frozen=True)
class Predicted:
    step_s: float
    stage_s: dict[str, float]  # time from the end of the stage before to the end of this one
    h2d_bytes: float
    d2h_bytes: float
    copy_s: float  # time the copy streams were busy, both together
    overlap: float  # share of copy time during which compute ran
    host_update_s: float  # the host optimizer's time alone

    def bound(self, plain_s: float, speeds: Speeds) -> float:
        """The step's lower bound (issue 36): the plain step, the host update alone, or the bytes moved at the
        copy bandwidth, whichever is longest."""
        return max(plain_s, self.host_update_s, self.h2d_bytes / speeds.h2d, self.d2h_bytes / speeds.d2h)


class _Stages:
    """An observer tagging each placer event with the stage of the moment before it (the runtime emits a moment,
    then accesses)."""

    def __init__(self, placer: Placer) -> None:
        self.placer = placer
        self.marks: list[tuple[int, str]] = []

    def moment(self, moment: Moment) -> None:
        self.marks.append((len(self.placer.events), moment.stage))

    def moved(self, move: Move) -> None:
        pass

    def of(self, count: int) -> list[str]:
        out, stage, marks = [], "fwd", iter(self.marks + [(count + 1, "")])
        at, next_stage = next(marks)
        for i in range(count):
            while i >= at:
                stage = next_stage
                at, next_stage = next(marks)
            out.append(stage)
        return out


def record(runtime: Runtime, train_step: Callable[[], None], scale: float = 1.0) -> Recorded:
    """Run `train_step` (a forward, its backward and the optimizer's step) on the model `runtime` serves, under the
    plan it follows, and keep the step for the replay. The step takes the full path (an observer is on)."""
    placer = runtime.placer
    follower = placer.follower
    if follower is None:
        raise ValueError("a step is recorded under a plan: train at least one step (the warm-up) first")
    stages = _Stages(placer)
    runtime.observers.append(stages)
    try:
        train_step()
    finally:
        runtime.observers.remove(stages)
    events = placer.last_events
    return Recorded(events, stages.of(len(events)), placer.groups, frozenset(placer.homes), dict(placer.sizes),
                    follower.step, follower.plan, scale)


class _Replay:
    """The four timelines of the Note, their busy intervals, and what the chunks are doing."""

    def __init__(self, recorded: Recorded, speeds: Speeds) -> None:
        self.speeds = speeds
        self.sizes = {name: nbytes * recorded.scale for name, nbytes in recorded.sizes.items()}
        self.groups = {g.index: g for g in recorded.groups}
        self.free = {"host": 0.0, "update": 0.0, "compute": 0.0, "h2d": 0.0, "d2h": 0.0}
        self.busy: dict[str, list[tuple[float, float]]] = {name: [] for name in self.free}
        self.moved = {"h2d": 0.0, "d2h": 0.0}
        self.ready: dict[str, float] = {}  # chunk -> when its last upload lands
        self.last_use: dict[str, float] = {}  # chunk -> when compute last finished with it
        self.dirty: set[str] = set()  # changed on the device since it came up
        self.unborn = {g.grad for g in recorded.groups}  # gradient chunks not written yet: they come up as zeros
        self.landed = 0.0  # when the last streamed gradient reached the host
        self.group_landed: dict[int, float] = {}  # the same per streamed group
        self.host_update_s = 0.0
        self.computed = {stage: sum(self._own(e) for e, x in zip(recorded.events, recorded.stages)
                                    if x == stage and e.kind == "use") for stage in STAGES}

    def run(self, stream: str, after: float, seconds: float) -> float:
        start = max(self.free[stream], after)
        self.free[stream] = end = start + seconds
        if seconds > 0:
            self.busy[stream].append((start, end))
        return end

    def copy(self, direction: str, name: str, after: float, nbytes: float | None = None) -> float:
        nbytes = self.sizes[name] if nbytes is None else nbytes
        self.moved[direction] += nbytes
        return self.run(direction, after, nbytes / (self.speeds.h2d if direction == "h2d" else self.speeds.d2h))

    def access(self, here: dict[str, list[str]], prefetch: list[str], chunks: tuple[str, ...],
               writes: frozenset[str], event: Event, stage: str, issued: float) -> float:
        """One device access: the plan's evictions and fetches before it, the prefetches for the next, its
        compute. Returns when its compute ends."""
        room = issued
        for name in here.get("evict", []):
            if name in self.dirty:
                self.dirty.discard(name)
                room = max(room, self.copy("d2h", name, self.last_use.get(name, 0.0)))
        for name in here.get("fetch", []):
            self._bring(name, room)
        for name in prefetch:
            self._bring(name, issued)
        start = max([issued, *(self.ready.get(c, 0.0) for c in chunks)])
        end = self.run("compute", start, self._seconds(event, stage))
        self.dirty |= writes
        for name in chunks:
            self.last_use[name] = end
        return end

    def _bring(self, name: str, after: float) -> None:
        """Upload `name` once `after` has passed; a gradient chunk not written yet comes up as zeros, copying nothing."""
        self.ready[name] = after if name in self.unborn else self.copy("h2d", name, after)
        self.unborn.discard(name)

    def _seconds(self, event: Event, stage: str) -> float:
        if event.kind == "use":
            total = self.computed[stage]
            return self.speeds.compute.get(stage, 0.0) * self._own(event) / total if total else 0.0
        if event.kind == "optim":
            return self.update_bytes(event.group) / self.speeds.device_update
        return 0.0  # a gradient lands in its chunk: autograd's kernels are the backward's

    def update_bytes(self, index: int) -> float:
        return update_bytes(self.groups[index], self.sizes)

    def _own(self, event: Event) -> float:
        return sum(self.sizes[c] for c in event.chunks)


CONTENTION_PASSES = 4  # most replays over the last pass's team busy times (the Note), until the step stays


def predict(recorded: Recorded, speeds: Speeds, overlap: bool = False, copy_grads: bool = False) -> Predicted:
    """Replay `recorded` at `speeds` (the Note above). `overlap`: a streamed group's host update runs on a thread of
    its own as soon as its gradients have landed, while backward goes on, into spare buffers that the optimizer's
    step adopts (Config.overlap_update, runtime/ahead.py, when nothing makes step() redo it: no clipping that scales,
    no overflow); its parameters go up once the step has adopted it, after backward. `copy_grads`: it first keeps a copy
    of the gradients (ahead.py does in a loop that writes them between backward and step(): torch's clip_grad_norm_)."""
    got, teams = _replayed(recorded, speeds, overlap, copy_grads, [])
    for _ in range(CONTENTION_PASSES if overlap and speeds.cores is not None else 0):
        before = got.step_s
        got, teams = _replayed(recorded, speeds, overlap, copy_grads, teams)
        if got.step_s == before:
            break
    return got


def _replayed(recorded: Recorded, speeds: Speeds, overlap: bool, copy_grads: bool,
              teams: list[tuple[float, float, int]]) -> tuple[Predicted, list[tuple[float, float, int]]]:
    """One replay (`predict`), its host slowed where `teams` (start, end, threads) ran updates in the pass before;
    with the teams this one ran."""
    replay, cores = _Replay(recorded, speeds), speeds.cores
    deferred: list[int] = []  # streamed groups updating on their own thread (`overlap`)
    steady = {id(event): chunks for event, chunks in steady_chunks(recorded.events, replay.groups, recorded.homes)}
    per_stage = {stage: sum(1 for x in recorded.stages if x == stage) for stage in STAGES}
    grad_events = {i: sum(1 for e in recorded.events if e.kind == "grad" and e.group == i) for i in replay.groups}
    actions: dict[int, dict[str, list[str]]] = {}
    for action in recorded.plan.actions:
        actions.setdefault(action.at, {}).setdefault(action.verb, []).append(action.chunk)
    index, ends = 0, dict.fromkeys(STAGES, 0.0)
    for event, stage in zip(recorded.events, recorded.stages):
        cost = speeds.host.get(stage, 0.0) + (cores.plain_host.get(stage, 0.0) if cores is not None else 0.0)
        beside = [n for a, b, n in teams if a <= replay.free["host"] < b]
        slowed = Cores.at(cores.kept, beside[0]) if cores is not None and beside else 1.0
        issued = replay.run("host", 0.0, cost / max(1, per_stage[stage]) / slowed)
        chunks = steady.get(id(event))
        if chunks is not None:  # on the device, as the plan places it
            prefetch = actions.get(index + 1, {}).get("prefetch", [])
            writes = recorded.step.accesses[index].writes
            done = replay.access(actions.get(index, {}), prefetch, chunks, writes, event, stage, issued)
            ends[stage] = max(ends[stage], done)
            index += 1
        elif event.kind == "grad":  # a streamed group's gradient goes down as backward runs
            nbytes = replay.groups[event.group].streamed * recorded.scale / max(1, grad_events[event.group])
            replay.landed = replay.copy("d2h", "", max(issued, replay.free["compute"]), nbytes)
            replay.group_landed[event.group] = replay.landed
        elif event.kind == "optim" and overlap:
            deferred.append(event.group)
        elif event.kind == "optim":  # a streamed group updates on the host, then its parameters go up
            group = replay.groups[event.group]
            seconds = replay.update_bytes(group.index) / speeds.host_update
            replay.host_update_s += seconds
            end = replay.run("host", replay.landed, seconds)
            replay.ready[group.param] = replay.copy("h2d", group.param, end)
            ends[stage] = max(ends[stage], replay.ready[group.param])
    backward_end, ran = ends["bwd"], list[tuple[float, float, int]]()
    for index in sorted(deferred, key=lambda i: replay.group_landed.get(i, replay.landed)):
        group = replay.groups[index]
        nbytes = replay.update_bytes(index)
        replay.host_update_s += nbytes / speeds.host_update
        copied = 2 * replay.sizes[group.grad] if copy_grads else 0.0  # read and written
        start = max(replay.free["update"], replay.group_landed.get(index, replay.landed))
        end = replay.run("update", start, _team_seconds(nbytes + copied, start, backward_end, speeds, ran))
        replay.ready[group.param] = replay.copy("h2d", group.param, max(end, backward_end))
        ends["optim"] = max(ends["optim"], replay.ready[group.param])
    step = max(replay.free.values())
    stage_s, before = {}, 0.0
    for stage in STAGES:
        end = max(ends[stage], before)
        stage_s[stage], before = end - before, end
    stage_s["optim"] += step - before
    copies = replay.busy["h2d"] + replay.busy["d2h"]
    copy_s = sum(b - a for a, b in copies)
    hidden = sum(_overlap(interval, replay.busy["compute"]) for interval in copies)
    return Predicted(step, stage_s, replay.moved["h2d"], replay.moved["d2h"], copy_s,
                     hidden / copy_s if copy_s else 1.0, replay.host_update_s), ran


def _team_seconds(nbytes: float, start: float, backward_end: float, speeds: Speeds,
                  ran: list[tuple[float, float, int]]) -> float:
    """How long an update of `nbytes` made ahead from `start` takes: without `speeds.cores`, at the host update's
    speed; with them, at the backward team's until backward ends, then at the whole team's; each team's time is
    added to `ran`."""
    cores = speeds.cores
    if cores is None:
        return nbytes / speeds.host_update
    slow, fast = Cores.at(cores.update, cores.backward_team), Cores.at(cores.update, cores.team)
    early = min(nbytes, max(0.0, backward_end - start) * slow)
    late_start = start + early / slow
    ran.append((start, late_start, cores.backward_team))
    ran.append((late_start, late_start + (nbytes - early) / fast, cores.team))
    return early / slow + (nbytes - early) / fast


def _overlap(interval: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    a, b = interval
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)
