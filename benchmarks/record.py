"""A real training step recorded for the optimum: chunkmem's warm-up record, and what its plan moved.

chunkmem records a warm-up step (chunkmem/chunks/placement.py's Note on warm-up) and hands the record to
`decide_homes` (chunkmem/chunks/planning.py); `recording()` wraps that function for as long as it is open and keeps a copy
of what it is given, without changing chunkmem. `record()` trains a prepared model for a few steps and
returns the recorded instance with chunkmem's choice of homes and its bytes per steady step, measured
from `memory_stats()`: h2d + d2h, where d2h includes the streamed gradients.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator

import torch

import chunkmem
import chunkmem.chunks.placement
from benchmarks.placement_problem import Instance


@dataclasses.dataclass(frozen=True)
class Recorded:
    instance: Instance
    homes: frozenset[int]  # the groups chunkmem homed
    measured: tuple[int, ...]  # chunkmem's bytes in each steady step measured
    uploaded: int  # bytes the last steady step sent up
    prefetched: int  # of those, the bytes sent ahead of the access that needs them (the rest compute waits for)
    streamed: int  # of which streamed gradients, per step
    model_data: int
    activation_peak: int


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
    """While open, every (events, groups, sizes, limit) chunkmem plans from is appended to the list."""
    seen: list[tuple] = []
    original = chunkmem.chunks.placement.decide_homes

    def decide_homes(events, groups, sizes, limit, *rest):  # type: ignore[no-untyped-def]
        seen.append((list(events), list(groups), dict(sizes), limit))
        return original(events, groups, sizes, limit, *rest)

    chunkmem.chunks.placement.decide_homes = decide_homes  # type: ignore[assignment]
    try:
        yield seen
    finally:
        chunkmem.chunks.placement.decide_homes = original


def record(model: torch.nn.Module, step: Callable[[torch.nn.Module], torch.Tensor], config: chunkmem.Config,
           steady_steps: int = 3, accumulate: int = 1) -> Recorded:
    """Prepare a copy of `model` (AdamW), train 2 + `steady_steps` steps of `step(model) -> loss`, each step
    the sum of `accumulate` backward passes (gradient accumulation)."""
    module = copy.deepcopy(model)
    cm, opt = chunkmem.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-4), config)

    def train() -> None:
        for _ in range(accumulate):
            step(cm).backward()
        opt.step()
        opt.zero_grad()

    with recording() as seen:
        train()  # warm-up: recorded, then planned
        train()  # the first steps on the plan settle what is resident at a step's start (and what the
        train()  # plan leaves room to send up early for the next step: Placer.updated_on_host)
        measured, streamed, uploaded, prefetched = [], 0, 0, 0
        for _ in range(steady_steps):
            before = cm.memory_stats()
            train()
            after = cm.memory_stats()
            measured.append(after["h2d_bytes"] + after["d2h_bytes"] - before["h2d_bytes"] - before["d2h_bytes"])
            uploaded = after["h2d_bytes"] - before["h2d_bytes"]
            prefetched = after["prefetch_bytes"] - before["prefetch_bytes"]
            streamed = after["grad_stream_bytes"] - before["grad_stream_bytes"]
    placer = cm.runtime.placer
    if len(seen) != 1 or placer.phase is not chunkmem.chunks.placement.Phase.FOLLOW:
        raise RuntimeError(f"chunkmem planned {len(seen)} times (re-recorded a step?): the steps measured "
                           "are not steady ones")
    events, groups, sizes, limit = seen[0]
    store = cm.runtime.store
    per_group = {g.index: accumulate * sum(r.param.numel() for r in g.members) * store.dtype.itemsize
                 for g in store.trainable_groups()}
    instance = Instance.from_events(events, sizes, groups, limit, streamed=per_group)
    return Recorded(instance, frozenset(placer.homes), tuple(measured), uploaded, prefetched, streamed,
                    cm.memory_stats()["model_data_bytes"], cm.runtime.activations.peak)
