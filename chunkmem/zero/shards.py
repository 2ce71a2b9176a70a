"""ZeRO data parallel: model data sharded over a process group, gathered for compute.

[Note: sharding]
Chunks come in communication groups of world-size chunks: chunk i belongs to group i // W and is
owned by rank i % W, which alone persists it in every family (param, grad, master, states). Before
a module computes, the groups holding its parameters are all-gathered into a transient buffer of W
chunks and every parameter of the group becomes a view into it; a few idle buffers are cached and
dropped oldest first. Backward re-gathers through the saved-tensor hooks. Gradients collect in a
transient full-size buffer per group and are reduce-scattered (then averaged, as DDP does) to
their owners as soon as every trainable parameter of the group has one, or at the end of backward.

[Note: one order on every rank]
Every rank runs the same modules in the same order, and each collective must be issued in the same
order on every rank (with gloo an async one runs in a background thread, matched by that order).
So no decision that issues, skips or reorders a collective may depend on a rank's own memory
readings: they follow from the module order, the layout, and numbers `agree` made equal on every
rank (the device budget, the buffer pool's size). The placer's readings move chunks, never
collectives.

[Note: overlap]
The first step records the order in which groups are gathered (collectives.Order); every later
step follows the order of the step before it. When a group is gathered, the next group of that
order is gathered ahead (async), so its collective runs while the current module computes; it is
waited for when a module needs it. A step that leaves the recorded order gathers nothing ahead for
the rest of it. A complete gradient group starts its reduce-scatter at once (async); its share is added to
the gradient chunk when the next reduce-scatter starts, when the pool needs its buffer, or at the
end of backward, before anything reads gradients. On CUDA collectives are issued on their own
stream after the work compute has queued; waiting makes the compute stream wait, not the host.

[Note: transient buffers]
Gathered groups and gradient buffers are W chunks each and come from a pool of `slots` buffers that
is reserved out of the device budget before training (`reserve`): the groups one module and the
modules around it pin, CACHED_GROUPS idle ones, AHEAD gathered ahead and GRAD_BUFFERS gradient
buffers, fewer if the budget is tight, never fewer than one module's groups and a gradient buffer.
When the pool is full, the oldest idle gathered group goes first, then the reduce-scatter in flight
is finished, then the oldest partial gradient buffer is reduce-scattered early (a parameter's
gradient arrives once per backward, so the shares of the two parts touch disjoint elements and add
up to the same bits). An op that unpacks a view of a dropped buffer keeps it alive until the op
ends, as with chunks (runtime's Note).
"""

from __future__ import annotations

import atexit
import collections
import gc
import logging
import weakref
import zlib
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.store import ChunkGroup, ParamRecord, ParamStore, most_pinned, put_data, working_set_chunks
from chunkmem.errors import MemoryBudgetError
from chunkmem.memory.device import Device
from chunkmem.zero.collectives import ALL_GATHER, Flight, Key, Order, agree, single_tensor_collectives
from chunkmem.zero.reduce import Reducer
from chunkmem.zero.units import gather_units

log = logging.getLogger("chunkmem")
CACHED_GROUPS = 2  # idle gathered buffers kept: a module's backward soon needs its group again
AHEAD = 1  # groups gathered ahead of need
GRAD_BUFFERS = 2  # gradient buffers at once, typically: one filling, one being reduce-scattered

def least_transient_bytes(world: int, chunk_bytes: int, pinned: int) -> int:
    """The fewest device bytes ZeRO's pool can have: `pinned` gathered groups, a gradient buffer, a share."""
    return ((pinned + 1) * world + 1) * chunk_bytes if world > 1 else 0


def least_device_bytes(module: nn.Module, chunk_size: int, itemsize: int, world: int) -> int:
    """Device bytes one step needs at least with chunks of `chunk_size` elements: one module's chunks
    at once, or under ZeRO one own chunk at a time plus the fewest transient buffers (their Note).
    The runtime and the planner (trace/planner.py) choose chunk sizes with it, so they agree."""
    chunks = working_set_chunks(module, chunk_size)
    own = chunks if world == 1 else 1
    return own * chunk_size * itemsize + least_transient_bytes(world, chunk_size * itemsize, chunks)


class Shards:
    """The collectives of one sharded model and the transient buffers they fill."""

    def __init__(self, group: Any, store: ParamStore, module: nn.Module, device: Device,
                 bring: Callable[[ChunkGroup, bool], torch.Tensor],
                 deliver: Callable[[Key, torch.Tensor], None], unit_classes: Collection[str] = ()) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.store = store
        self.device = device
        self.bring = bring  # (group, ahead): this rank's param chunk of a group on the device, its payload
        self.members: dict[Key, list[ChunkGroup]] = collections.defaultdict(list)
        for chunk_group in store.groups:
            self.members[self.key(chunk_group)].append(chunk_group)
        self.single = single_tensor_collectives(group, device.torch_device)
        self.chunk_bytes = store.chunk_size * store.dtype.itemsize
        self.buffer_bytes = self.world * self.chunk_bytes  # one gathered group or gradient buffer
        self._units(module, gather_units(module, unit_classes))
        self.pinned_most = most_pinned(module, lambda m: set(self.pin_keys[m]))
        # Gradient buffers of a unit live beside the pool: which exist depends on the data (units' Note).
        self.unit_most = max((len(keys) for keys in self.unit_of.values()), default=0)
        self.slots = self.pinned_most + CACHED_GROUPS + AHEAD + GRAD_BUFFERS  # `reserve` may lower it
        self.gathered: collections.OrderedDict[Key, torch.Tensor] = collections.OrderedDict()  # [W * chunk]
        self.flights: dict[Key, Flight] = {}  # gathers not waited for yet
        self.ahead: Key | None = None  # the group the recorded order says comes next
        self.pins: collections.Counter[Key] = collections.Counter()
        self.by_storage: dict[int, Key] = {}
        self.held: tuple[Key, ...] | None = None  # the unit backward is in: its groups stay gathered
        self.key_of_chunk = {g.param.name: self.key(g) for g in store.owned_groups()}
        self.order = Order()
        self.off_path = False  # a forward without gradients: not part of the recorded order
        self.summoned = False  # parameters view whole values on the host (gathered_parameters): no forward
        self.log: list[tuple[str, Key]] | None = None  # set to a list to record the collectives issued
        self.issued: list[tuple[str, Key]] = []  # the gathers and reduce-scatters since the last update (check_order)
        self.live = self.live_peak = self.gathered_peak = 0  # transient device bytes
        self.gathered_bytes = 0
        self.reducer = Reducer(self, deliver)
        for key in self.members:
            self._point_home(key)
        atexit.register(_close_at_exit, weakref.ref(self))

    def close(self) -> None:
        """Let go of buffers and of the group before the interpreter shuts down.

        Left to interpreter teardown, the cycles between hooks, runtime and model are collected after
        parts of torch.distributed are gone, and gloo aborts the process ("terminate called without
        an active exception") once in a few runs. Nothing in flight is waited for: a rank on its way out
        after an error must not wait on its peers.
        """
        self.flights.clear()
        self.reducer.clear()
        self.gathered.clear()
        self.by_storage.clear()
        gc.collect()

    def key(self, chunk_group: ChunkGroup) -> Key:
        return chunk_group.trainable, chunk_group.index // self.world

    def _units(self, module: nn.Module, units: list[nn.Module]) -> None:
        """What each module's pre-forward pins: its own groups; a unit's, every group of its subtree (sorted,
        the same on every rank); a module inside a unit, nothing (units' Note)."""
        records = self.store.records

        def own(m: nn.Module) -> tuple[Key, ...]:
            return tuple(dict.fromkeys(self.key(records[p].group) for p in m.parameters(recurse=False) if p in records))

        self.pin_keys: dict[nn.Module, tuple[Key, ...]] = {m: own(m) for m in module.modules()}
        self.unit_of: dict[Key, tuple[Key, ...]] = {}  # a unit's groups, by each of them
        for unit in units:
            keys = tuple(sorted({k for m in unit.modules() for k in own(m)}))
            self.pin_keys.update({m: () for m in unit.modules()} | {unit: keys})
            self.unit_of.update({k: keys for k in keys})
        # Groups a unit shares with modules outside it get gradients after backward left the unit too.
        outside = {k for m, keys in self.pin_keys.items() for k in keys if not any(m is u for u in units)}
        self.shared_unit_keys = sorted(k for k in self.unit_of if k in outside)

    def owned(self, key: Key) -> ChunkGroup:
        return self.members[key][self.rank]

    # -- the pool ------------------------------------------------------------------------------
    def reserve(self, limit: int, chunks: int) -> int:
        """Size the pool out of the device budget `limit`, leaving `chunks` bytes for chunks; the bytes it takes."""
        least = self.pinned_most + 1
        fit = (limit - chunks - self.chunk_bytes) // self.buffer_bytes - self.unit_most
        fit = agree([fit], self.group, self.device.torch_device)[0]  # every rank sizes it alike: see the Note
        if fit < least:
            need = least_transient_bytes(self.world, self.chunk_bytes, self.pinned_most) + self.unit_most * self.buffer_bytes
            raise MemoryBudgetError(
                f"ZeRO over {self.world} ranks needs transient buffers on the device besides the chunks: "
                f"{least} buffers of {self.world} chunks ({self.buffer_bytes} bytes each; one per group a module "
                f"uses at once, {self.pinned_most}, and one for gradients) and a reduce-scatter output, {need} "
                f"bytes, plus {chunks} bytes of chunks, but Config.device_memory allows {limit}: raise "
                f"device_memory to at least {need + chunks}, or lower Config.chunk_size (now "
                f"{self.store.chunk_size} elements)")
        self.slots = min(self.slots, fit)
        return self.reserved

    @property
    def reserved(self) -> int:
        return (self.slots + self.unit_most) * self.buffer_bytes + self.chunk_bytes

    def _buffers(self) -> int:
        return len(self.gathered) + self.reducer.buffers()

    def count(self, nbytes: int) -> None:
        """Transient device bytes taken (or given back, negative)."""
        self.live += nbytes
        self.live_peak = max(self.live_peak, self.live)
        self.gathered_peak = max(self.gathered_peak, len(self.gathered) * self.buffer_bytes)

    def _idle(self) -> list[Key]:
        """Gathered groups no module uses, oldest first; gathers ahead not yet used are not idle."""
        return [k for k in self.gathered if not self.pins[k] and k not in self.flights]

    def make_room(self, wait: bool = True) -> bool:
        """Free a slot of the pool if none is (see the Note); False if that takes waiting and `wait` is False."""
        while self._buffers() >= self.slots:
            idle = self._idle()
            if idle:
                self.drop(idle[0])
            elif not wait:
                return False
            elif self.flights:
                self.drop(next(iter(self.flights)))
            elif not self.reducer.free_one():
                raise MemoryBudgetError(
                    f"ZeRO's {self.slots} transient buffers are all in use by running modules and another group "
                    "is needed (a module uses parameters of modules outside it): raise Config.device_memory")
        return True

    def issue(self, collective: Callable[..., Any], writes: torch.Tensor, reads: torch.Tensor | None,
               label: str, *args: Any) -> object:
        """Start a collective async, after the work compute has queued (on CUDA on the device's comm
        stream); the token waits for it (device.py's Note on tokens)."""
        return self.device.collective(lambda: collective(*args, group=self.group, async_op=True), [writes],
                                      [reads] if reads is not None else [], label)

    def note(self, op: str, key: Key) -> None:
        if op != "reduced" and not self.off_path:  # no collective issued; no update follows an evaluation's gathers
            self.issued.append(("gather" if op == "prefetch" else op, key))
        if self.log is not None:
            self.log.append((op, key))

    # -- parameters ---------------------------------------------------------------------------
    def gather(self, key: Key) -> torch.Tensor:
        """The W chunks of a group side by side, all its parameters viewing them."""
        expected = None if self.off_path else self.order.seen(key)
        if key not in self.gathered:
            self.make_room()
            self._start_gather(key, ahead=False)
        self.gathered.move_to_end(key)
        flight = self.flights.pop(key, None)
        if flight is not None:
            if flight.ahead:  # the placer sees the chunk's access where the recorded step had it
                self.bring(self.owned(key), False)
            self.device.wait(flight.work)
            self._point(key)
        buffer = self.gathered[key]
        self.ahead = expected
        self._trim()
        return buffer

    def _start_gather(self, key: Key, ahead: bool) -> None:
        local = self.bring(self.owned(key), ahead)
        buffer = self.device.alloc(self.world * local.numel(), local.dtype)
        mine = buffer[self.rank * local.numel():(self.rank + 1) * local.numel()]
        mine.copy_(local)  # gathered in place: the chunk itself may leave the device while this runs
        label = f"all-gather of group {key}"
        work = self.issue(ALL_GATHER, buffer, None, label, buffer, mine) if self.single else \
            self.issue(dist.all_gather, buffer, None, label, list(buffer.chunk(self.world)), mine)
        self.note("prefetch" if ahead else "gather", key)
        self.flights[key] = Flight(work, buffer, ahead)
        self.gathered[key] = buffer
        self.by_storage[buffer.untyped_storage().data_ptr()] = key
        self.gathered_bytes += buffer.nbytes
        self.count(buffer.nbytes)

    def _point(self, key: Key) -> None:
        buffer, numel = self.gathered[key], self.store.chunk_size
        for position, chunk_group in enumerate(self.members[key]):
            flat = buffer[position * numel:(position + 1) * numel]
            for record in chunk_group.members:
                record.param.data = record.view(flat)

    def pin(self, key: Key) -> None:
        """Keep a group gathered while a module uses it; pinned already (by a unit, or a module around this
        one), it is gathered and nothing is issued or recorded."""
        self.pins[key] += 1
        if self.pins[key] == 1:
            self.gather(key)

    def unpacked(self, key: Key) -> torch.Tensor:
        """A group a saved tensor views, in backward. The first of a unit's gathers them all and holds them
        until backward leaves the unit (the next group outside it), which reduce-scatters the unit's
        gradients (units' Note)."""
        unit = self.unit_of.get(key)
        if unit is not None and unit == self.held:
            return self.gathered[key]
        self._leave_unit()
        if unit is None:
            return self.gather(key)
        for k in unit:
            self.pin(k)
        self.held = unit
        return self.gathered[key]

    def _leave_unit(self) -> None:
        if self.held is None:
            return
        unit, self.held = self.held, None
        for key in unit:
            self.unpin(key)
        self.reducer.reduce_unit(unit)

    def unpin(self, key: Key) -> None:
        self.pins[key] -= 1
        self._trim()

    def _trim(self) -> None:
        """Keep CACHED_GROUPS idle groups, and the group expected next gathered or on its way.

        Gathers ahead are not idle until used, so while the pool has room the cache evolves as it
        would without them, and the placer sees the chunk accesses of the step it recorded.
        """
        idle = self._idle()
        for key in idle[:max(0, len(idle) - CACHED_GROUPS)]:
            self.drop(key)
        if self.ahead is not None and self.ahead not in self.gathered and self.make_room(wait=False):
            self._start_gather(self.ahead, ahead=True)

    def drop(self, key: Key) -> None:
        flight = self.flights.pop(key, None)
        if flight is not None:
            self.device.wait(flight.work)  # a buffer is never let go while a collective writes into it
        buffer = self.gathered.pop(key)
        del self.by_storage[buffer.untyped_storage().data_ptr()]
        self.count(-buffer.nbytes)
        self._point_home(key)

    def chunk_moved(self, chunk: Chunk) -> None:
        """This rank's chunk moved: its parameters follow it, unless they view a gathered copy (whether they
        do must not depend on where this rank's chunks are: see the Note on one order)."""
        key = self.key_of_chunk.get(chunk.name)
        if key is None or key not in self.gathered or key in self.flights:
            self.store.point_views(chunk)

    def _point_home(self, key: Key) -> None:
        """Parameters of an ungathered group view this rank's own chunk, or a placeholder."""
        for chunk_group in self.members[key]:
            if chunk_group.chunks:
                self.store.point_views(chunk_group.param)
            else:
                for record in chunk_group.members:
                    put_data(record.param, _placeholder(record))  # a meta parameter too (loaded after prepare)

    def drop_all(self) -> None:
        for key in list(self.gathered):
            self.drop(key)

    def point_all_home(self) -> None:
        """Every group ungathered, its parameters viewing this rank's chunk or a placeholder (gathered_parameters
        pointed them elsewhere)."""
        self.drop_all()
        for key in self.members:
            self._point_home(key)

    def check_order(self) -> None:
        """Before an update: every rank gathered the same groups and reduce-scattered the same gradient groups, in
        the same order, since the last one (the Note on one order). Where a module ran on some ranks only, gathers
        of equal size paired different groups; where a parameter got a gradient on some ranks only (a module's
        output reaching the loss on some ranks only), its group was complete, and reduce-scattered, at another
        point of backward on each: gradients were reduced across different groups. Every rank raises the same
        error, nothing updated."""
        issued, self.issued = self.issued, []  # checked: the next step's are checked afresh
        digest = zlib.crc32(repr(issued).encode())
        extremes = self.all_reduce(torch.tensor([digest, -digest], dtype=torch.int64, device="cpu"), dist.ReduceOp.MAX)
        if extremes[0] != -extremes[1]:
            gathers = sum(op == "gather" for op, _ in issued)
            raise RuntimeError(
                f"the ranks gathered different parameter groups or reduce-scattered gradient groups in another order "
                f"in this step (rank {self.rank}: {gathers} gathers, {len(issued) - gathers} reduce-scatters), "
                "so collectives paired different groups: some module ran on some ranks only (a branch or a layer "
                "skip decided by each rank's own data or random draws), or a module's output reached the loss on "
                "some ranks only, so that its parameters got a gradient there only. Draw random choices alike on "
                "every rank (seed them the same), name the module class that chooses among its children in "
                "chunkmem.Config(gather_units=...) so ZeRO gathers it whole, or make every rank's loss depend on "
                "each output it computes (add 0 * output.sum() where a rank leaves it out); no parameter was updated")

    def step_done(self) -> None:
        """After an optimizer step: the owners changed their shares, so gathered copies are stale."""
        self.drop_all()
        self.ahead = None
        self.order.step_done()

    def finish_backward(self) -> None:
        """End of backward: leave the unit backward is in, reduce every gradient group still held, and finish
        every reduce-scatter, before anything reads gradients."""
        self._leave_unit()
        self.reducer.finish_backward(self.shared_unit_keys)

    # -- whole-model values ---------------------------------------------------------------------
    def _on_backend(self, tensor: torch.Tensor) -> torch.Tensor:
        """NCCL talks to device tensors only."""
        return tensor.to(self.device.torch_device) if dist.get_backend(self.group) == "nccl" else tensor

    def all_gather_flat(self, local: torch.Tensor) -> torch.Tensor:
        local = self._on_backend(local.contiguous())
        out = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
        if self.single:
            ALL_GATHER(out, local, group=self.group)
        else:
            dist.all_gather(list(out.chunk(self.world)), local, group=self.group)
        return out.cpu()

    def gather_flat(self, local: torch.Tensor, root: int) -> torch.Tensor | None:
        """Every rank's `local` in rank order, on rank `root` of the group alone (None elsewhere): what one rank writes
        needs no copy of the whole on the others (a checkpoint)."""
        local = self._on_backend(local.contiguous())
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == root else None
        dist.gather(local, parts, dst=dist.get_global_rank(self.group, root), group=self.group)
        return torch.cat(parts).cpu() if parts is not None else None

    def all_reduce(self, value: torch.Tensor, op: object = dist.ReduceOp.SUM) -> torch.Tensor:
        reduced = self._on_backend(value)
        dist.all_reduce(reduced, op=op, group=self.group)  # type: ignore[arg-type]
        return value.copy_(reduced) if reduced is not value else value


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
