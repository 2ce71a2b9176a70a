"""PipeDream-2BW's two weight versions of a stage, kept as two chunk families of the prepared stage.

[Note: two versions in chunks]
Mini-batch u computes (forward and backward) with weights version u-1; the update after its last
backward makes version u+1 from version u and u's coalesced gradient: W(u+1) = W(u) - lr * grad(W(u-1)).
Each trainable chunk group gets a "stale" chunk beside its "param" chunk: "param" holds the newest
version (what the optimizer updates, as without versions), "stale" the one before. The stale family is
declared with the stage's families when it is prepared (chunks/family.py, role VERSION: saved and restored
with the optimizer's state, never stepped, so an update does not move it); the runtime places it by the same
plan as the others (on the device for groups homed there, streamed from the host otherwise), and the budget
checks and `memory_stats()["model_data_bytes"]` count it.
An update first copies "param" into "stale" where "stale" is (on the device when it is resident, else
on the host, from the freshest copy of "param"), then steps the optimizer.
A micro-batch of the older version computes with the groups' "param" and "stale" chunks exchanged
(`ParamStore.swap_param_chunk`), so modules acquire, and parameters view, the older chunk. Tensors
saved for backward that are views of either chunk are kept by version, not by chunk: a micro-batch
that forwarded before an update and runs its backward after finds its weights in "stale" by then.
"""

from __future__ import annotations

import dataclasses

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.family import Role
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.runtime.runtime import ChunkRef, Kept
from chunkmem.wrapper import ChunkedModel

STALE = "stale"


@dataclasses.dataclass(frozen=True)
class _Versioned:
    """A saved tensor that is a view of a weight chunk, by the version it viewed."""

    version: int
    ref: ChunkRef


class WeightVersions:
    """The two versions of one prepared stage (see the Note). `newest` counts the updates made."""

    def __init__(self, model: ChunkedModel, optimizer: ChunkOptimizer) -> None:
        runtime = self.runtime = model.runtime
        if runtime.shards is not None:
            raise ValueError("weight versions (schedule='2bw') are not supported with ZeRO sharding: use "
                             "data_parallel=1")
        if STALE not in runtime.store.families.named(Role.VERSION):
            raise ValueError(f"weight versions need the {STALE!r} chunk family: prepare the stage with "
                             f"versions=({STALE!r},)")
        self.pairs = [(g, g.param, g.chunks[STALE]) for g in runtime.store.trainable_groups()]
        self._role = {id(c): (i, newest) for i, (_, p, s) in enumerate(self.pairs) for c, newest in ((p, True),
                                                                                                   (s, False))}
        self.optimizer = optimizer
        self.newest = 0
        self.swapped = False  # whether compute uses the older version now

    @property
    def stale_bytes(self) -> int:
        return sum(s.nbytes for _, _, s in self.pairs)

    def use(self, version: int) -> None:
        """Make compute use weights `version` (the newest or the one before) until told otherwise."""
        if version not in (self.newest, self.newest - 1):
            raise RuntimeError(f"a micro-batch needs weights version {version}, but this stage holds versions "
                               f"{self.newest - 1} and {self.newest}: the 2BW order was not followed")
        older = version != self.newest
        if older != self.swapped:
            for group, _, _ in self.pairs:
                self.runtime.store.swap_param_chunk(group, STALE)
            self.swapped = older

    def update(self) -> None:
        """Keep the newest version as the older one, then step the optimizer on the coalesced gradient."""
        self.use(self.newest)
        # The host is about to write payloads (the older version's, the optimizer's) that an upload for the
        # backward just run, or a prefetch that compute has waited for since, may still be reading: mid-flow,
        # no later copy tells the host they landed, so it waits for everything once per update.
        self.runtime.device.synchronize()
        for _, newest, stale in self.pairs:
            self._keep(newest, stale)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.newest += 1

    def _keep(self, newest: Chunk, stale: Chunk) -> None:
        """Copy `newest` into `stale` where `stale` lives (see the Note)."""
        if stale.state.on_device:
            self.runtime.data.writable(stale, True).copy_(newest.payload())
        else:
            self.runtime.residency.copy_on_host(stale, newest)

    # -- saved tensors, by version ------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Kept | _Versioned:
        saved = self.runtime.pack(tensor)
        if isinstance(saved, ChunkRef) and id(saved.source) in self._role:
            _, newest = self._role[id(saved.source)]
            return _Versioned(self.newest if newest else self.newest - 1, saved)
        return saved

    def unpack(self, saved: Kept | _Versioned) -> torch.Tensor:
        if not isinstance(saved, _Versioned):
            return self.runtime.unpack(saved)
        index, _ = self._role[id(saved.ref.source)]
        _, newest, stale = self.pairs[index]
        if saved.version not in (self.newest, self.newest - 1):
            raise RuntimeError(f"a backward needs weights version {saved.version}, but this stage holds versions "
                               f"{self.newest - 1} and {self.newest}: the 2BW order was not followed")
        chunk = newest if saved.version == self.newest else stale
        # The update between its forward and this backward moved the parameters' version counters (Runtime.rewrote):
        # the weights it needs are the version it viewed, kept in the chunk found here.
        return self.runtime.unpack(saved.ref._replace(source=chunk, param=None))
