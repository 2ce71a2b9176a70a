"""ZeRO data parallel: model data sharded over a process group, gathered for compute.

[Note: sharding]
Chunks come in communication groups of world-size chunks: chunk i belongs to group i // W and is
owned by rank i % W, which alone persists it in every family (param, grad, master, states). Before
a module computes, the groups holding its parameters are all-gathered into a transient buffer of W
chunks and every parameter of the group becomes a view into it; a few unpinned buffers are cached
and dropped oldest first. Backward re-gathers through the saved-tensor hooks. Gradients collect in
a transient full-size buffer per group and are reduce-scattered (then averaged, as DDP does) to
their owners as soon as every trainable parameter of the group has one, or at the end of backward.
Every rank runs the same modules in the same order, so every collective lines up across ranks:
no decision that triggers a collective depends on a rank's own memory readings.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import gc
import logging
import os
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from chunkmem.store import ChunkGroup, ParamRecord, ParamStore

log = logging.getLogger("chunkmem")
CACHED_GROUPS = 2  # gathered buffers kept after use: a module's backward soon needs its group again
Key = tuple[bool, int]  # (trainable, communication group index)


def default_group(group: object) -> object | None:
    """The process group to shard over: the given one, the default one, or one torchrun's env describes."""
    if group is not None:
        return group
    if not dist.is_available():
        return None
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=float(os.environ.get("CHUNKMEM_TIMEOUT", "600")))
        dist.init_process_group(backend, timeout=timeout)
        log.info("initialised a %s process group of %d ranks from the environment", backend, dist.get_world_size())
    return dist.group.WORLD if dist.is_initialized() else None


class Shards:
    """The collectives of one sharded model and the transient buffers they fill."""

    def __init__(self, group: dist.ProcessGroup, store: ParamStore, bring: Callable[[ChunkGroup], torch.Tensor],
                 alloc: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.store = store
        self.bring = bring  # makes this rank's param chunk of a group resident, returns its payload
        self.alloc = alloc
        self.members: dict[Key, list[ChunkGroup]] = collections.defaultdict(list)
        for chunk_group in store.groups:
            self.members[self.key(chunk_group)].append(chunk_group)
        self.gathered: collections.OrderedDict[Key, torch.Tensor] = collections.OrderedDict()
        self.pins: collections.Counter[Key] = collections.Counter()
        self.by_storage: dict[int, Key] = {}
        self.grads: dict[Key, torch.Tensor] = {}
        self.arrived: collections.Counter[Key] = collections.Counter()
        self.expected = {k: sum(len(g.members) for g in groups if g.trainable) for k, groups in self.members.items()}
        self.gathered_bytes = 0
        self.reduced_bytes = 0
        for key in self.members:
            self._point_home(key)
        atexit.register(_close_at_exit, weakref.ref(self))

    def close(self) -> None:
        """Let go of buffers and of the group before the interpreter shuts down.

        Left to interpreter teardown, the cycles between hooks, runtime and model are collected after
        parts of torch.distributed are gone, and gloo aborts the process ("terminate called without
        an active exception") once in a few runs.
        """
        self.gathered.clear()
        self.grads.clear()
        self.by_storage.clear()
        gc.collect()

    def key(self, chunk_group: ChunkGroup) -> Key:
        return chunk_group.trainable, chunk_group.index // self.world

    def owned(self, key: Key) -> ChunkGroup:
        return self.members[key][self.rank]

    # -- parameters ---------------------------------------------------------------------------
    def gather(self, key: Key) -> torch.Tensor:
        """The W chunks of a group side by side, all its parameters viewing them."""
        if key in self.gathered:
            self.gathered.move_to_end(key)
            return self.gathered[key]
        local = self.bring(self.owned(key))
        buffer = self.alloc(self.world * local.numel(), local.dtype)
        dist.all_gather_into_tensor(buffer, local, group=self.group)
        self.gathered_bytes += buffer.nbytes
        self.gathered[key] = buffer
        self.by_storage[buffer.untyped_storage().data_ptr()] = key
        for position, chunk_group in enumerate(self.members[key]):
            flat = buffer[position * local.numel():(position + 1) * local.numel()]
            for record in chunk_group.members:
                record.param.data = record.view(flat)
        self._trim()
        return buffer

    def pin(self, key: Key) -> None:
        self.pins[key] += 1
        self.gather(key)

    def unpin(self, key: Key) -> None:
        self.pins[key] -= 1
        self._trim()

    def _trim(self) -> None:
        idle = [k for k in self.gathered if not self.pins[k]]
        for key in idle[:max(0, len(idle) - CACHED_GROUPS)]:
            self.drop(key)

    def drop(self, key: Key) -> None:
        buffer = self.gathered.pop(key)
        del self.by_storage[buffer.untyped_storage().data_ptr()]
        self._point_home(key)

    def _point_home(self, key: Key) -> None:
        """Parameters of an ungathered group view this rank's own chunk, or a placeholder."""
        for chunk_group in self.members[key]:
            if chunk_group.chunks:
                self.store.point_views(chunk_group.param)
            else:
                for record in chunk_group.members:
                    record.param.data = _placeholder(record)

    def drop_all(self) -> None:
        for key in list(self.gathered):
            self.drop(key)

    # -- gradients ------------------------------------------------------------------------------
    def add_grad(self, record: ParamRecord, grad: torch.Tensor) -> bool:
        """Add a local gradient to its group's buffer; True when the group is complete."""
        key = self.key(record.group)
        numel = self.store.chunk_size
        if key not in self.grads:
            self.grads[key] = self.alloc(self.world * numel, grad.dtype).zero_()
        position = record.group.index % self.world
        record.view(self.grads[key][position * numel:(position + 1) * numel]).add_(grad)
        self.arrived[key] += 1
        return self.arrived[key] == self.expected[key]

    def reduce(self, key: Key) -> torch.Tensor:
        """Sum the group's gradients across ranks into this rank's share, averaged as DDP does."""
        full = self.grads.pop(key)
        del self.arrived[key]
        share = self.alloc(full.numel() // self.world, full.dtype)
        try:
            dist.reduce_scatter_tensor(share, full, group=self.group)
        except (RuntimeError, NotImplementedError):  # a backend without reduce_scatter: all_reduce, keep ours
            dist.all_reduce(full, group=self.group)
            share.copy_(full[self.rank * share.numel():(self.rank + 1) * share.numel()])
        self.reduced_bytes += full.nbytes
        return share.div_(self.world)

    def pending(self) -> list[Key]:
        return sorted(self.grads)

    # -- whole-model values ---------------------------------------------------------------------
    def all_gather_flat(self, local: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local.contiguous(), group=self.group)
        return out

    def all_reduce(self, value: torch.Tensor, op: object = dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(value, op=op, group=self.group)  # type: ignore[arg-type]
        return value


def _close_at_exit(shards: weakref.ref[Shards]) -> None:
    alive = shards()
    if alive is not None:
        alive.close()


_PLACEHOLDERS: dict[torch.dtype, torch.Tensor] = {}


def _placeholder(record: ParamRecord) -> torch.Tensor:
    """A parameter with no data on this rank right now: right shape and dtype, one shared element."""
    dtype = record.param.dtype
    if dtype not in _PLACEHOLDERS:
        _PLACEHOLDERS[dtype] = torch.full((1,), float("nan"), dtype=dtype)
    return _PLACEHOLDERS[dtype].expand(record.shape) if record.shape else _PLACEHOLDERS[dtype][0]
