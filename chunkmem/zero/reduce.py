"""ZeRO's gradient side: local gradients gathered into buffers of W chunks, each reduce-scattered to its owners.

Buffers come from the same pool as gathered groups (shards.py's Notes on overlap and on transient buffers):
a complete group starts its reduce-scatter at once, and its share reaches the owner's gradient chunk when the
next one starts, when the pool needs the buffer, or at the end of backward.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from chunkmem.chunks.state import TensorState
from chunkmem.chunks.store import ParamRecord
from chunkmem.zero.collectives import REDUCE_SCATTER, Flight, Key

if TYPE_CHECKING:
    from chunkmem.zero.shards import Shards


class Reducer:
    """The gradient buffers of one sharded model and their reduce-scatters; `deliver(key, share)` adds a reduced
    share to this rank's gradient chunk of that group."""

    def __init__(self, shards: Shards, deliver: Callable[[Key, torch.Tensor], None]) -> None:
        self.shards = shards
        self.deliver = deliver
        self.grads: dict[Key, torch.Tensor] = {}  # buffers being filled, oldest first: [W * chunk]
        self.unit_grads: dict[Key, torch.Tensor] = {}  # buffers of units' groups: [W * chunk]
        self.arrived: collections.Counter[Key] = collections.Counter()
        self.expected = {k: sum(len(g.members) for g in groups if g.trainable) for k, groups in shards.members.items()}
        self.reducing: tuple[Key, Flight, torch.Tensor] | None = None  # the reduce-scatter in flight, its input
        self.reduced_bytes = 0

    def buffers(self) -> int:
        """Pool buffers held: those being filled and the input of the reduce-scatter in flight."""
        return len(self.grads) + (self.reducing is not None)

    def free_one(self) -> bool:
        """Give a buffer back to the pool: finish the reduce-scatter in flight, else reduce-scatter the oldest
        buffer early (the Note on transient buffers); False when there is none."""
        if self.reducing is not None:
            self._finish()
        elif self.grads:
            key = next(iter(self.grads))
            self._start(key, self.grads.pop(key))
        else:
            return False
        return True

    def add(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Add a local gradient to its group's buffer; a complete group starts its reduce-scatter (a unit's
        groups wait for backward to leave the unit: units' Note)."""
        shards = self.shards
        key = shards.key(record.group)
        numel = shards.store.chunk_size
        buffers = self.unit_grads if key in shards.unit_of else self.grads
        if key not in buffers:
            if buffers is self.grads:
                shards.make_room()
            buffers[key] = self._zeros()
        position = record.group.index % shards.world
        record.view(buffers[key][position * numel:(position + 1) * numel]).add_(grad)
        if buffers is self.unit_grads:
            return
        self.arrived[key] += 1
        if self.arrived[key] == self.expected[key]:
            del self.arrived[key]
            self._start(key, self.grads.pop(key))

    def reduce_unit(self, keys: Sequence[Key]) -> None:
        """Every trainable group of a unit, on every rank: zeros where this rank's gradients skipped it.
        Which parameters got a gradient on some rank is agreed too (`_agree`)."""
        keys = [key for key in keys if key[0]]
        self._agree([r for key in keys for g in self.shards.members[key] for r in g.members])
        for key in keys:
            full = self.unit_grads.pop(key, None)
            self._start(key, full if full is not None else self._zeros())

    def finish_backward(self, shared_unit_keys: Sequence[Key]) -> None:
        """End of backward: reduce the groups some of whose parameters got no gradient (and the unit groups
        shared with modules outside their unit), and finish every reduce-scatter."""
        self.reduce_unit(shared_unit_keys)
        for key in sorted(self.grads):
            self._start(key, self.grads.pop(key))
        if self.reducing is not None:
            self._finish()
        self.arrived.clear()
        # A parameter outside units used by some ranks' data only (a branch some samples take): its owner steps it
        # too. Issued last, after every reduce-scatter, whenever a rank started that group's.
        self._agree([r for key, groups in self.shards.members.items() if key[0] and key not in self.shards.unit_of
                     for g in groups for r in g.members])

    def _agree(self, records: list[ParamRecord]) -> None:
        """Which of `records` got a gradient on some rank, agreed in one collective: their owners step them (and only
        them, as PyTorch leaves a parameter without gradient untouched)."""
        if not records:
            return
        got = torch.tensor([r.grad_state is TensorState.HOLD for r in records], dtype=torch.float32, device="cpu")
        for record, anywhere in zip(records, self.shards.all_reduce(got, dist.ReduceOp.MAX).tolist()):
            if anywhere and record.grad_state is TensorState.FREE:
                record.move_grad("write")

    def clear(self) -> None:
        """Let go of every buffer, waiting for nothing (Shards.close)."""
        self.reducing = None
        self.grads.clear()
        self.unit_grads.clear()

    def _zeros(self) -> torch.Tensor:
        """A gradient buffer: W chunks of zeros."""
        shards = self.shards
        buffer = shards.device.alloc(shards.world * shards.store.chunk_size, shards.store.dtype).zero_()
        shards.count(buffer.nbytes)
        return buffer

    def _start(self, key: Key, full: torch.Tensor) -> None:
        """Reduce-scatter a group's gradient buffer async, after finishing the one in flight."""
        if self.reducing is not None:
            self._finish()
        shards = self.shards
        if shards.single:
            share = shards.device.alloc(full.numel() // shards.world, full.dtype)
            shards.count(share.nbytes)
            work = shards.issue(REDUCE_SCATTER, share, full, f"reduce-scatter of group {key}", share, full)
        else:  # all-reduce the whole buffer and keep this rank's part
            work = shards.issue(dist.all_reduce, full, None, f"all-reduce of group {key}", full)
            share = full[shards.rank * shards.store.chunk_size:(shards.rank + 1) * shards.store.chunk_size]
        shards.note("reduce_scatter", key)
        self.reducing = key, Flight(work, share), full
        self.reduced_bytes += full.nbytes

    def _finish(self) -> None:
        assert self.reducing is not None
        key, flight, full = self.reducing
        self.reducing = None
        self.shards.device.wait(flight.work)
        self.shards.note("reduced", key)
        self.deliver(key, flight.result.div_(self.shards.world))  # averaged, as DDP does
        self.shards.count(-full.nbytes - (flight.result.nbytes if self.shards.single else 0))
