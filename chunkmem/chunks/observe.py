"""What the runtime tells observers (the tracer, warm-up statistics): moments and chunk moves.

Observers watch; they never change placement. The runtime calls them at every moment of a step and
for every copy between host and device.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Moment:
    """A point in a training step where memory is read and chunks are accessed.

    name: "pre_forward" | "post_forward" (per module), "backward" (a chunk is needed by backward),
          "grad" (a gradient lands in its chunk), "pre_optimizer" | "post_optimizer" (per chunk group).
    stage: "fwd" | "bwd" | "optim".
    where: the module's qualified name for forward moments, else the chunk's name.
    """

    step: int
    index: int
    name: str
    stage: str
    where: str
    warmup: bool


@dataclasses.dataclass(frozen=True)
class Move:
    """One copy (or drop) of a chunk. reason: "on-demand" | "prefetch" | "evict" | "optimizer"."""

    chunk: str
    kind: str
    src: str
    dst: str
    nbytes: int
    seconds: float
    reason: str


class Observer(Protocol):
    """Told of every moment and every move. One that only counts moves sets `wants_moments = False`: steps may
    then run resident or lean, which mark fewer moments or none (runtime's Notes on them); without the attribute,
    an observer is told of every moment, and every step takes the full path."""

    def moment(self, moment: Moment) -> None: ...
    def moved(self, move: Move) -> None: ...


def wants_moments(observer: Observer) -> bool:
    return getattr(observer, "wants_moments", True)

