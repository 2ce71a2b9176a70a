"""The chunk runtime of one model: parameters in chunks, the budget, and what hooks call into.

[Note: how parameters reach the device]
Forward: a module's pre-hook acquires its parameters (their chunks come to the device and are
pinned) and its post-hook releases them: a unit's, those of its whole subtree (units.py's Note). A
parameter used outside its module (tied weights, `F.linear(x, other.weight)`) is caught by `FetchMode`
and held for the one op that receives it.
Backward: autograd's saved tensors that are views into a device chunk are packed as (chunk,
offset, shape, stride) rather than as the tensor, and unpacking fetches the chunk again, so a
chunk may leave the device between forward and backward. An unpacked view keeps the old device
buffer alive until the op that asked for it finishes: at most the few chunks one op reads.

[Note: resident steps]
When the whole model fits, every chunk stays on the device and nothing of the above has anything to decide;
what it costs (Python at every module, op and moment) is all the overhead there is. So once a plan homes every
group and every chunk is on the device (placement's Note on resident steps), a training forward whose inputs
have the shapes of one that already ran under that plan without outgrowing it runs resident: no torch-function
mode, no module hooks (taken off, so that each module takes PyTorch's short call path: Hooks._module_hooks),
no gradient hooks (autograd leaves each gradient in `p.grad`, and the backward's end lends them all to their
chunks at once: adopt_grads), moments that read nothing. What stays: gradients lent to their chunks, the
optimizer's updates, and the device peak, read when the forward ends (checked against the plan) and when the
backward ends: a reading of the allocator gives the most it held since the last one (on CUDA, the copy
engine's tracker), so two readings see the step's peak. The saved-tensor hooks stay only where the device
reads no allocator (the simulation without its memory model: CHUNKMEM_SIM_MEMORY=0), whose non-model bytes are
the activations they meter, and whose moments read them. Elsewhere autograd keeps the parameters it saves as
they are: nothing moves before backward reads them, and a chunk that did leave would keep its slot, and its
values, while a saved view refers to it (the arena's Note on chunk memory). The hooks cost a Python call per
saved tensor and per use of it: a third of the host time a resident step added in benchmarks/overhead.py's
launch-bound LLaMA. What the mode did is not needed: every parameter is on the device, and the models whose
BatchNorm needed its cast in the warm-up never run resident. An out-of-memory error in a resident forward
makes the wrapper run the forward again under the mode, with the random state it started from
(ChunkedModel.forward).

[Note: lean forwards]
When chunks move, the module hooks and moments have work to do, but the torch-function mode mostly does not:
it exists for parameters used outside their module, for BatchNorm's cast, and to retry an op out of memory,
and it costs a Python call on every op (up to 3% of a step in benchmarks/overhead.py's bf16 rows). So a
training forward, while a plan is followed, whose inputs have the shapes of one that already ran a step under
a plan runs lean: without the mode, everything else as on the full path (moments follow the plan and make room
as ever, so the plan that inputs ran under does not matter). Unless the mode was ever needed: a model whose
forward used a parameter outside its module (`lean_allowed`, cleared by FetchMode) or needed BatchNorm's cast
or changed a parameter in place through `p.data` (`resident_allowed`) never runs lean. An out-of-memory error
in a lean forward is retried as in a resident one: the plan is dropped, chunks not in use leave, and the
forward runs again under the mode from the same random state. Where the device reads its allocator, a lean
forward also keeps the activations autograd saves as they are, unmetered: its non-model bytes are the
allocator's, so the meter (a Python object and its books per saved tensor) served nothing, and cost the
launch-bound LLaMA of benchmarks/overhead.py about a third of the host time a streaming forward adds (the
saved parameters are still packed by address, so that their chunks may leave before backward). The limit: a
parameter used outside its module for the first time in a lean forward (a branch that only some batches of the
same shapes take) is neither fetched nor waited for. Where its chunk is on the host, its op fails on two
devices, and the forward runs again under the mode (ChunkedModel.forward), as every later one; where its chunk
is on the device with its upload still landing, the op may read it early (the simulation's checker reports
it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.family import Families
from chunkmem.chunks.hostcache import HostCache
from chunkmem.chunks.layout import search_chunk_size
from chunkmem.chunks.observe import Moment, Observer, wants_moments
from chunkmem.chunks.placement import Phase, Placer
from chunkmem.chunks.residency import LeastRecentlyUsed, Residency
from chunkmem.chunks.state import ChunkState, TensorState
from chunkmem.chunks.store import ChunkGroup, ParamRecord, ParamStore
from chunkmem.config import Config
from chunkmem.errors import MemoryBudgetError
from chunkmem.memory.allocator import Room
from chunkmem.memory.device import make_device
from chunkmem.memory.disk import DiskTier
from chunkmem.memory.gpu_memory import DeviceMemory, load_nvml
from chunkmem.runtime.activations import ActivationMeter, Saved, unchanged
from chunkmem.runtime.ahead import Ahead
from chunkmem.runtime.grads import ShownGrads
from chunkmem.runtime.limits import check_budgets, check_sizes, disk_room, read_elsewhere
from chunkmem.runtime.room import BackwardRoom
from chunkmem.runtime.scaler import LossScaler
from chunkmem.runtime.speeds import host_weight
from chunkmem.runtime.units import UNIT_CHUNK_SHARE, access_units
from chunkmem.runtime.values import ModelData
from chunkmem.zero.agreement import as_agreed, check_agreed, first_ranks_values
from chunkmem.zero.collectives import agree
from chunkmem.zero.shards import Key, Shards, least_device_bytes

log = logging.getLogger("chunkmem")

MAX_INPUT_SIGNATURES = 1024  # input signatures kept for resident and lean forwards (of many lengths: the latest)


class ChunkRef(NamedTuple):  # a tuple: one is made for every parameter a forward saves
    """A saved tensor that is a view into a chunk (or a gathered group), kept by address, not buffer."""

    source: Chunk | Key
    offset: int
    size: torch.Size
    stride: tuple[int, ...]
    # The parameter it views and that parameter's version when saved: changed in place before backward reads it, it
    # is an error, as autograd's own check of a saved tensor makes it (the tensor itself is not kept to check).
    param: nn.Parameter | None = None
    version: int = 0


# What autograd keeps of a saved tensor (Runtime.pack): an activation metered (or offloaded), a chunk view by address,
# an activation with its version counter then, or one without storage as it is.
Kept = Saved | ChunkRef | tuple[torch.Tensor, int] | torch.Tensor

LAZY_ROOM, LAZY_ROOM_MAX = 0.02, 256 << 20  # Runtime.outside's room for what loads lazily: a share, at most


class Runtime:
    def __init__(self, module: nn.Module, config: Config, families: Families, group: Any = None,
                 fingerprints: dict[str, int] | None = None) -> None:
        self.config = config
        self.device = make_device(config.device, config.host_memory, budgeted=config.device_memory is not None)
        self.gpu_memory = DeviceMemory(self.device.torch_device, load_nvml()) \
            if self.device.torch_device.type == "cuda" else None
        self.first_outside: int | None = None  # the first reading of what it holds outside the allocator
        check_sizes(config, self.device.torch_device)
        self.device.empty_cache()  # blocks cached by earlier work would count as this model's non-model data
        self.limit = own_limit = int(config.device_memory or self.device.free_bytes())
        world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
        if world > 1:  # every rank decides from the same budget (zero's Note on one order), with the same setup
            own = fingerprints or {}
            agreed = agree([self.limit, *as_agreed(own)], group, self.device.torch_device)
            self.limit = agreed[0]
            check_agreed(own, agreed[1:])
        size = self._chunk_size(module, world)
        try:
            working_set = check_budgets(module, config, size, world, families, self.limit)
        except MemoryBudgetError as error:
            if self.limit == own_limit:
                raise
            raise MemoryBudgetError(f"{error}. This rank's budget is {own_limit} bytes, but the ranks plan alike, "
                                    f"with the least of theirs, {self.limit}: give every rank the same device_memory"
                                    ) from None
        self.observers: list[Observer] = []
        self.host_cache = self._disk_tier(module, size, world, families)
        self.store = ParamStore(module, families, self.device, size, world, rank, self.host_cache)
        self.step_count = 0  # steps taken (optimizer steps, for one trained model)
        self.optimizers = 1  # optimizers whose steps end a step together (a Manager's trained models)
        self._stepped: set[int] = set()  # those that stepped since the last step ended, by id
        self.moment_index = 0  # moments since the last step
        self.device_bytes_peak = 0  # most chunk + non-model bytes on the device at any moment
        # The most non-model data grew from one reading to the next (the loss's logits and their gradient, the
        # optimizer's temporaries): a step recorded after an allocation failed leaves room for that, and for one
        # largest block more, as the rise may not fit the holes there are (placement's _conservative_now).
        self.largest_rise = 0
        self._last_nonmodel: int | None = None  # the last reading (none yet: the first is no rise)
        self._slots_seen = 0  # the arena's slot allocations at the last memory reading
        self.warmup = True
        # Off: every step takes the full path (the torch-function mode changed an op's arguments in a step, or a
        # benchmark times that path).
        self.resident_allowed = True
        self.resident_steps = 0  # steps served resident, wholly or in part
        self.lean_allowed = True  # off once FetchMode caught a parameter used outside its module (lean forwards)
        self.lean_forwards = 0  # training forwards run lean, not resident
        self.fitted_inputs: set[Any] = set()  # input signatures of forwards that fit a plan homing everything
        self.ran_inputs: set[Any] = set()  # input signatures of forwards in steps that kept a plan
        self.step_inputs: set[Any] = set()  # this step's, from forwards not run resident
        self.shards: Shards | None = None
        self.residency = Residency(self.device, self.limit, LeastRecentlyUsed(), self._chunk_moved,
                                   self.observers)
        self.residency.note_writes = self.store.note_writes
        # Its largest block, the largest non-model data took: a hole it filled in one step may be taken in the next, so
        # the plan leaves room for one more of it (placement's Note on warm-up).
        self.room = BackwardRoom(self.device, self.residency, self.store, self.limit)
        self.grads = ShownGrads(self.store, self.residency)
        self.store.load_initial_values()
        if world > 1:
            self._take_first_ranks_values(module, group)
        for chunk_group in self.store.owned_groups():
            self.store.point_views(chunk_group.param)
        self.shards = Shards(group, self.store, module, self.device, self._bring_param, self._add_share,
                             config.gather_units) if world > 1 else None
        self.data = ModelData(self.store, self.residency, self.shards)
        self.backward_task = -1  # the autograd graph task whose end calls `_backward_done` (-1: none queued)
        self.queued: set[int] = set()  # the tasks whose end calls it (a nested one's asks its outer's: _backward_done)
        self.room_task = -1  # the graph task `backward_begins` made room for
        # Modules whose parameters re-computations in backward hold until one for another node or the backward's end,
        # and whether modules leaving now join them (hooks' Note on re-computation)
        self.held_back: list[nn.Module] = []
        self.holding = False
        self.held_for: object = None  # the autograd node whose re-computations those modules ran for
        self.held_task = -1  # the graph task whose end releases them
        # Parameters of the modules around a re-computed one, whose forward runs without their hooks (`hold_enclosing`).
        self.held_params: list[ParamRecord] = []
        self.output_bytes = 0  # the largest output of the model's last forward (`mark_outputs`)
        self.upcast_bytes = 0  # its fp32 copy's, where it is of lower precision
        self.largest_output = -1  # which of those outputs it is
        self.unhooked: set[int] = set()  # id() of the models' Hooks whose gradient hooks are off (adopt_grads)
        self.hooks_last: list[weakref.WeakMethod] = []  # each model's Hooks._grad_hooks_last (`backward_begins`)
        self.strays = False  # gradients may wait in `p.grad` since those hooks went off (adopt_grads)
        self.warned_graph = False  # a gradient with a graph was taken into its chunk (`_warn_graph`)
        self.summed: set[ParamRecord] = set()  # `p.grad` made the whole gradient for a user's hook (`sum_for_users`)
        self.ahead: Ahead | None = None  # host updates made ahead of step() (ahead.py), set by the optimizer
        records = self.store.records
        chunk_bytes = size * config.torch_dtype.itemsize
        if self.shards is None and chunk_bytes <= self.limit * UNIT_CHUNK_SHARE:  # units' Note
            span = 2 if 2 * chunk_bytes <= self.limit * UNIT_CHUNK_SHARE else 1
            acquires, self.idle_modules = access_units(module, lambda p: records[p].group.param.name, span)
        else:
            acquires, self.idle_modules = {m: list(m.parameters(recurse=False)) for m in module.modules()}, set()
        self.module_records = {m: [records[p] for p in params] for m, params in acquires.items()}
        self.observed = False  # an observer wants every moment (a trace); set when a forward begins
        # ZeRO's transient buffers are reserved out of the budget; chunks get the rest (zero's Note on them).
        self.chunk_limit = self.limit - (self.shards.reserve(self.limit, working_set) if self.shards else 0)
        self.activations = ActivationMeter(config.offload_activations, self._host_like,
                                           lambda t, _: self.device.alloc(t.numel(), t.dtype).view(t.shape))
        self.metering = True  # saved activations pass through the meter (off in a lean forward: its Note)
        self.placer = Placer(self.residency, self.store, self.chunk_limit, working_set, self.nonmodel_bytes,
                             self._headroom, lambda: self.largest_rise + self.room.largest_block)
        self.capped_outside = 0  # what the process held outside the allocator when the cap was last applied
        self.step_failed: str | None = None  # why the disk tier failed a step midway (ChunkedModel.consolidated)
        # The budget holds for what the process takes (gpu_memory's Note); this model's counts before its chunks come:
        # they came under the cap of the models prepared before it alone, and a model of a larger budget was refused.
        if config.device_memory is not None:
            self._cap(self.outside())
        if self.placer.all_homed:  # everything fits: all of it stays on the device
            for chunk in self.store.chunks():
                self.residency.bring(chunk)
        else:  # homes are chosen by time (planning's Note on homes by time)
            self.placer.host_weight = host_weight(config, self.device)
        self.dtype = config.torch_dtype  # the compute dtype, that of every chunk's parameters
        self.scaler = LossScaler() if config.torch_dtype == torch.float16 else None
        self.grads_scaled = self.scaler is not None  # gradients in chunks still carry the loss scale

    # -- set-up ------------------------------------------------------------------------------
    def _take_first_ranks_values(self, module: nn.Module, group: Any) -> None:
        """Under ZeRO every rank trains the first rank's values, as under DDP (agreement.first_ranks_values): its
        owned chunks take them, and its buffers become new tensors of them (the model's own are put back if prepare
        fails). Meta tensors are loaded later, and tensors without strided storage are each rank's own."""
        def kept(tensor: torch.Tensor) -> bool:
            return not tensor.is_meta and tensor.layout is torch.strided
        params = [p for p in module.parameters() if kept(p)]
        places = [(sub, name, b) for sub in module.modules() for name, b in sub._buffers.items()
                  if b is not None and kept(b)]
        buffers = list({id(b): b for _, _, b in places}.values())  # a buffer two modules hold: once
        received: dict[int, torch.Tensor] = {}

        def deliver(index: int, value: torch.Tensor) -> None:
            if index >= len(params):
                buffer = buffers[index - len(params)]
                received[id(buffer)] = value.to(buffer.device)
                return
            record = self.store.records.get(params[index])
            if record is None:
                return
            for kind in ("param", "master"):
                chunk = record.group.chunks.get(kind)  # none in a group another rank owns
                if chunk is not None:
                    record.view(self.residency.host_for_write(chunk)).copy_(value)  # a disk tier's too: written back
        first_ranks_values([*params, *buffers], deliver, group, self.device.torch_device)
        for sub, name, buffer in places:
            if id(buffer) in received:
                sub._buffers[name] = received[id(buffer)]
        self.device.empty_cache()  # the broadcast's buffer

    def _chunk_size(self, module: nn.Module, world: int) -> int:
        """The configured size, or the least wasteful one whose per-module working set (and, under ZeRO,
        the fewest transient buffers) fits the budget."""
        if self.config.chunk_size is not None:
            return self.config.chunk_size
        itemsize = self.config.torch_dtype.itemsize
        return search_chunk_size([(n, p.numel()) for n, p in module.named_parameters()], multiple_of=world,
                                 fits=lambda size: least_device_bytes(module, size, itemsize, world) <= self.limit)

    def _disk_tier(self, module: nn.Module, size: int, world: int, families: Families) -> HostCache | None:
        """The disk tier when Config.disk is set and host memory cannot hold all model data (hostcache's Note)."""
        room = disk_room(module, self.config, size, world, families)
        if room is None:
            return None
        pool = self.device.host_pool
        return HostCache(DiskTier(self.config.disk, self.config.disk_memory), room,  # type: ignore[arg-type]
                         lambda nbytes: pool.tensor(nbytes, torch.uint8, tag="disk"), self.observers)

    def _host_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer for a copy of `tensor` that is not model data (offloaded activations, staged gradients):
        tagged apart from chunk payloads in the pool (HostPool.tensor says why)."""
        return self.device.host_pool.tensor(tensor.numel(), tensor.dtype, tag="transient").view(tensor.shape)

    def nonmodel_bytes(self) -> int:
        """Device bytes that are not this model's chunk memory: the most the caching allocator held besides the
        arena's slots since the last reading (activations, temporaries, and the holes between them: room chunks
        cannot use), plus what the process holds outside the allocator (gpu_memory.py). In a simulation without
        its memory model (CHUNKMEM_SIM_MEMORY=0), the saved activations."""
        reading = self.device.memory_reading()
        if reading is None:
            return self.activations.live
        held, largest = reading
        arena = self.device.arena
        if arena.allocations == self._slots_seen:  # no slot among the blocks: the largest is non-model data's
            self.room.saw(largest)
        self._slots_seen = arena.allocations
        own = arena.footprint + (self.shards.live if self.shards is not None else 0)  # ZeRO's: apart
        nonmodel = max(0, held - own) + self.outside()
        if self._last_nonmodel is not None:
            self.largest_rise = max(self.largest_rise, nonmodel - self._last_nonmodel)
        self._last_nonmodel = nonmodel
        return nonmodel

    def _headroom(self) -> int:
        """Non-model bytes a plan leaves room for beyond its record: two of the largest block non-model data took,
        each as the segment it reserves when no cached block holds it (a block of 1-10 MiB takes a 20 MiB one on
        CUDA): a step whose blocks fall into other holes than its record's may need that much more."""
        largest = self.room.largest_block
        return 2 * max(largest, self.device.segment_for(largest)) if largest else 0

    def outside(self, fresh: bool = False) -> int:
        """What the process holds on the device outside the allocator (gpu_memory.py), or will hold: kernels and
        library buffers load lazily, and the lent H200 held 54 to 117 MB more there after the warm-up than at
        prepare. So a budgeted model counts more than the first reading, until the reading itself is higher:
        LAZY_ROOM of what the budget left the allocator (at most LAZY_ROOM_MAX)."""
        if self.gpu_memory is None:
            return 0
        reading = self.gpu_memory.outside_allocator(fresh)
        if self.first_outside is None:
            self.first_outside = reading
        left = max(0, self.limit - self.first_outside) if self.config.device_memory is not None else 0
        return max(reading, self.first_outside + min(LAZY_ROOM_MAX, int(left * LAZY_ROOM)))

    # -- forward -------------------------------------------------------------------------------
    def enter(self, module: nn.Module, nonmodel: int | None = None) -> None:
        """A module's forward starts: its parameters (under ZeRO, the groups it pins) come to the device;
        `nonmodel` as in Placer.access."""
        self.acquire(self.module_records[module], self.shards.pin_keys[module] if self.shards else None, nonmodel)

    def leave(self, module: nn.Module) -> None:
        if self.holding:
            self.held_back.append(module)
            return
        self.release(self.module_records[module], self.shards.pin_keys[module] if self.shards else None)

    def recomputing(self, node: object) -> None:
        """A re-computation in backward begins, for autograd node `node`: the modules held back for another node's are
        released, their backward done, and those held from now on at the end of this backward, whether or not a
        parameter's gradient comes (torch.autograd.grad of the inputs: hooks' Note on re-computation)."""
        if node is not self.held_for:
            self.release_held_back()
            self.held_for = node
        task = torch._C._current_graph_task_id()
        if task != self.held_task:
            self.held_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.release_held_back)

    def hold_enclosing(self, records: list[ParamRecord]) -> None:
        """A re-computation in backward begins inside modules whose own hooks do not run, `records` their parameters
        (hooks' Note on re-computation): they come to the device and stay until the modules held back are released."""
        fresh = [record for record in records if record not in self.held_params]
        if fresh:
            self.held_params.extend(fresh)  # before acquiring: one that raised is released all the same
            self.acquire(fresh)

    def release_held_back(self) -> None:
        """Release the modules re-computations held back, and the parameters around them (hooks' Note on
        re-computation)."""
        modules, self.held_back, self.holding, self.held_for = self.held_back, [], False, None
        for module in modules:
            self.leave(module)
        records, self.held_params = self.held_params, []
        if records:
            self.release(records)

    def acquire(self, records: Sequence[ParamRecord], keys: Iterable[Key] | None = None,
                nonmodel: int | None = None) -> None:
        # The hot path: every module call of a forward not run resident (a lean one too) comes here and to `release`.
        if self.grads.host_viewed:  # parameters of streamed groups view the host since a backward (grads' Note)
            self.grads.restore()
        for record in records:
            record.move("acquire")
            if record.uses == 0 and record.group.owned and self.shards is None:  # ZeRO computes on gathered copies
                self.placer.pin(record.group.param)
            record.uses += 1
        if self.shards is not None:
            for key in keys if keys is not None else dict.fromkeys(self.shards.key(r.group) for r in records):
                self.shards.pin(key)
        else:
            self.placer.access(list({r.group.param: None for r in records}), nonmodel=nonmodel)

    def release(self, records: Sequence[ParamRecord], keys: Iterable[Key] | None = None) -> None:
        for record in records:
            record.uses -= 1
            if record.uses == 0:
                record.move("release")
                if record.group.owned and self.shards is None:
                    self.placer.unpin(record.group.param)
        if self.shards is not None:
            for key in keys if keys is not None else dict.fromkeys(self.shards.key(r.group) for r in records):
                self.shards.unpin(key)

    def _chunk_moved(self, chunk: Chunk) -> None:
        """Parameters follow their chunk's payload; under ZeRO, not while they view a gathered copy."""
        if self.shards is not None:
            self.shards.chunk_moved(chunk)
        else:
            self.store.point_views(chunk)
            if self.grads.shown_on_device and not chunk.state.on_device:
                self.grads.left_device(chunk)

    def _bring_param(self, chunk_group: ChunkGroup, ahead: bool) -> torch.Tensor:
        """This rank's parameter chunk of a group on the device, for a gather. A gather ahead of need is not
        in the placer's record (zero's Note on overlap): its chunk goes to the residency directly."""
        chunk = chunk_group.param
        if ahead:
            self.residency.bring(chunk, "prefetch")
        else:
            self.placer.access([chunk])
        return chunk.device  # type: ignore[return-value]  # the collective reads it: fenced

    def unannounced(self, params: Iterable[nn.Parameter]) -> list[ParamRecord]:
        """The managed parameters among `params` that no running module has acquired."""
        records = (self.store.records.get(p) for p in params)
        return [r for r in records if r is not None and r.state is TensorState.HOLD]

    def acquire_elsewhere(self, records: list[ParamRecord]) -> None:
        """Acquire parameters an op reads outside their module (hooks.FetchMode). Where their chunks find no room beside
        those the modules running now hold, and the budget is less than both, the MemoryBudgetError says so
        (limits.read_elsewhere)."""
        try:
            self.acquire(records)
        except MemoryBudgetError:
            read = {r.group.param.name: r.group.param.nbytes for r in records}
            held = {name: self.placer.sizes[name] for name in sorted(self.placer.pinned) if name not in read}
            need = sum(read.values()) + sum(held.values())
            if not held or need <= self.limit:  # not chunks at once beyond the budget: what prepare could not see
                raise
            running = {r.name.rpartition(".")[0] or "the model" for r in self.store.records.values()
                       if r.uses and r not in records}
            raise MemoryBudgetError(read_elsewhere(
                [r.name for r in records], sorted(running), list(read), list(held), need, self.limit,
                self.store.chunk_size if self.config.chunk_size is None else None)) from None

    def release_all(self) -> None:
        """After a forward, or a forward that raised: nothing stays in COMPUTE."""
        # a backward that raised left them
        self.held_back, self.held_params, self.holding, self.held_for = [], [], False, None
        for record in self.store.records.values():
            if record.uses:
                record.uses = 1
                self.release([record])

    def pack(self, tensor: torch.Tensor, metered: bool = True) -> Kept:
        """What autograd keeps of a saved tensor: a reference into its chunk, or the tensor detached (and metered,
        while the forward meters them and `metered`). Never the tensor itself: an op's output, saved by that op,
        holds its grad_fn, which holds what the hook returned, a cycle through autograd's C++ side that Python's
        collector cannot see. A graph backward did not consume (an output dropped, backward failing halfway) then
        kept its activations on the device for good. One that requires no gradient has no grad_fn to hold (a mask, a
        rotary table): kept as it is, a copy less (a microsecond; a sixth of a LLaMA's saved tensors)."""
        metered = metered and self.metering
        if not metered and tensor.dtype != self.dtype:  # chunks hold the compute dtype: an activation (the hot path)
            return tensor.detach() if tensor.requires_grad else tensor, tensor._version
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
            return self.activations.wrap(tensor) if metered else tensor.detach()
        ptr = storage.data_ptr()
        source: Chunk | Key | None = self.residency.by_storage.get(ptr)
        if source is None and self.shards is not None:
            source = self.shards.by_storage.get(ptr)
        if source is None or tensor.dtype != self.dtype:
            # with its version counter then, which backward checks (`unchanged`)
            return self.activations.wrap(tensor, storage) if metered else \
                (tensor.detach() if tensor.requires_grad else tensor, tensor._version)
        param = tensor if tensor._base is None else tensor._base  # views of a parameter share its version counter
        if not isinstance(param, nn.Parameter):
            return ChunkRef(source, int(tensor.storage_offset()), tensor.size(), tensor.stride())
        return ChunkRef(source, int(tensor.storage_offset()), tensor.size(), tensor.stride(), param, param._version)

    def unpack(self, saved: Kept) -> torch.Tensor:
        if self.held_back or self.held_params:
            self._left_recomputed(saved)
        if type(saved) is tuple:  # kept as it is, unmetered (the Note on lean forwards)
            tensor, version = saved  # type: ignore[misc]  # the pair: a ChunkRef is a tuple of its own type
            return tensor if tensor._version == version else unchanged(tensor, version)  # (inline: the hot path)
        if isinstance(saved, torch.Tensor):  # one without storage
            return saved
        if not isinstance(saved, ChunkRef):
            if self.placer.phase is Phase.DIVERGED:
                # A step whose forward ran out of memory is tight, and no chunk access precedes a backward op that
                # reads activations only (GELU's: GPT-2 at 5%, coarse chunks, died there). Not in every step: chunks
                # that left then found no room to come back (BERT and Falcon at 10%, coarse, were refused).
                self._room_for_activations()
            return saved.get(self.activations)  # type: ignore[union-attr]  # a Saved: the pair returned above
        if saved.param is not None and saved.param._version != saved.version:
            name = self.store.records[saved.param].name if saved.param in self.store.records else "a parameter"
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"parameter {name} is at version {saved.param._version}; expected version {saved.version} instead "
                "(changed in place between forward and backward, as an optimizer step, a load_state_dict, a weight "
                "constraint or an EMA swap there would: make that change after backward, or before the forward)")
        if isinstance(saved.source, Chunk):
            nonmodel = self.emit("backward", "bwd", saved.source.name)
            self.placer.access([saved.source], nonmodel=nonmodel)
            if nonmodel is not None and self.shards is None:
                self.room.for_grad(saved.source, saved.size.numel(), nonmodel)
            flat = saved.source.device
        else:
            self.emit("backward", "bwd", f"gathered.{saved.source[1]}")
            flat = self.shards.unpacked(saved.source)  # type: ignore[union-attr]
        return flat.as_strided(saved.size, saved.stride, saved.offset)  # type: ignore[union-attr]

    def _left_recomputed(self, saved: Kept) -> None:
        """What chunkmem's own hooks saved is read in the backward that re-computed modules, by a node of the device's
        ready queue: that backward has left them (hooks' Note on re-computation). Not in the backward the reentrant kind
        runs inside a node of it, nor by a node on the host, which CUDA's backward runs on another thread."""
        tensor: torch.Tensor | None = None  # None: on the device
        if type(saved) is tuple:  # an activation kept as it is
            tensor = saved[0]  # type: ignore[assignment]
        elif isinstance(saved, torch.Tensor) or (isinstance(saved, Saved) and saved.device is None):
            tensor = saved if isinstance(saved, torch.Tensor) else saved.tensor
        if not self.holding and torch._C._current_graph_task_id() == self.held_task and \
                torch._C._current_autograd_node() is not self.held_for and \
                (tensor is None or tensor.device == self.device.torch_device):
            self.release_held_back()

    # -- resident steps and lean forwards (the Notes on them) ------------------------------------------------------
    def begin_forward(self, inputs: Any, training: bool) -> bool:
        """Whether this forward runs without the torch-function mode, resident or lean (the Notes on them);
        `inputs` is its signature (shapes, dtypes and plain values), None for a forward that never does (a
        pipeline stage's: its schedule interleaves micro-batches)."""
        placer = self.placer
        fitted = inputs is not None and (not training or inputs in self.fitted_inputs)
        self.observed = any(wants_moments(o) for o in self.observers)
        simple = self.resident_allowed and self.shards is None and self.host_cache is None and not self.observed \
            and not self.activations.offload
        if placer.resident and not fitted:  # the rest of this step takes the full path
            placer.resident = False
        elif not placer.resident and fitted and simple and placer.can_stay:
            placer.serve_resident()
        if placer.resident:
            return True
        if training and inputs is not None:
            self.step_inputs.add(inputs)
        lean = training and inputs in self.ran_inputs and simple and self.lean_allowed and placer.steady
        self.lean_forwards += lean
        return lean

    def end_resident_forward(self, inputs: Any) -> None:
        """A resident forward ended: its activations are at their peak. If they outgrew the plan's record, the
        rest of the step gives way and these inputs no longer run resident."""
        nonmodel = self.nonmodel_bytes()
        self._note_peak(nonmodel)
        if self.placer.outgrown(nonmodel):
            log.info("a forward's activations outgrew the plan's record for inputs of the same shapes: "
                     "recording the next step")
            self.fitted_inputs.discard(inputs)

    def _note_peak(self, nonmodel: int) -> None:
        device_bytes = self.residency.stats.device_chunk_bytes + nonmodel
        if device_bytes > self.device_bytes_peak:
            self.device_bytes_peak = device_bytes

    # -- moments ----------------------------------------------------------------------------------
    def emit(self, name: str, stage: str, where: str) -> int | None:
        """Tell observers a moment has come (see observe.Moment); without a plan yet, chunks give way to
        the non-model data measured now (placement.Placer.moment). In a resident step only the peak is kept, and
        where the allocator is read, only at the forward's and the backward's end: a reading gives the most held
        since the last one (the Note on resident steps). Returns the non-model bytes read last (None: not read), for
        an access that follows at once (a second reading would see the same bytes)."""
        if self.placer.resident:
            if not self.device.reads_memory:
                self._note_peak(self.nonmodel_bytes())
            return None
        nonmodel = self.nonmodel_bytes()
        if self.placer.steady and not self.observers and self.host_cache is None and not self.placer.off_path:
            self._note_peak(nonmodel)  # the rest has nothing to do (the hot path of a steady step)
            self.moment_index += 1
            return nonmodel
        chunk_bytes = self.residency.stats.device_chunk_bytes
        self.placer.moment(nonmodel)
        if self.residency.stats.device_chunk_bytes != chunk_bytes:  # chunks left: on CUDA the reading moves with them
            nonmodel = self.nonmodel_bytes()
        if self.host_cache is not None:
            self.host_cache.tick()
        self._note_peak(nonmodel)
        if self.observers:
            moment = Moment(self.step_count, self.moment_index, name, stage, where, self.warmup)
            for observer in self.observers:
                observer.moment(moment)
        self.moment_index += 1
        return nonmodel

    def optimizer_done(self, optimizer: object) -> None:
        """`optimizer` stepped: the step ends once every optimizer training here has stepped since the last end,
        or before one steps again (manager's Note on one runtime for several models)."""
        if id(optimizer) in self._stepped:
            self.step_done()
        self._stepped.add(id(optimizer))
        if len(self._stepped) >= self.optimizers:
            self.step_done()

    def _cap(self, outside: int) -> None:
        self.capped_outside = outside
        self.device.limit_memory(self, self.limit, outside)

    def step_done(self) -> None:
        if self.gpu_memory is not None and self.config.device_memory is not None:
            # Libraries and kernels load lazily (cuBLAS handles, NCCL buffers, the kernels of the plan's first
            # steps): what the process holds outside the allocator grows, and the cap counts it (gpu_memory's Note
            # on the budget). Read fresh after the first step, then at most every REFRESH_S.
            outside = self.outside(fresh=self.step_count == 0)
            if outside != self.capped_outside:
                self._cap(outside)
        if self.shards is not None:
            self.shards.step_done()
        placer = self.placer
        kept = placer.phase is not Phase.DIVERGED and not placer.giving_way
        self.resident_steps += placer.served_resident
        placer.step_done()
        if kept and placer.phase is Phase.FOLLOW:  # these inputs ran a step under a plan
            _remember(self.ran_inputs, self.step_inputs)
            if placer.all_homed:  # one homing everything
                _remember(self.fitted_inputs, self.step_inputs)
        self.step_inputs.clear()
        if self.ahead is not None:
            self.ahead.step_done()
        if self.host_cache is not None:
            self.host_cache.step_done()
        self.warmup = self.placer.phase is not Phase.FOLLOW
        self.step_count += 1
        self.moment_index = 0
        self._stepped.clear()

    # -- backward ------------------------------------------------------------------------------
    def grad_ready(self, record: ParamRecord) -> None:
        """Move a fresh `param.grad` into the gradient chunk, accumulating as autograd would."""
        grad = record.param.grad
        record.param.grad = None
        if grad is None:
            self._unsummed(record)
            return
        self._end_of_backward_called()
        self._take_grad(record, grad)

    def sum_for_users(self, record: ParamRecord) -> None:
        """A user's post-accumulate-grad hook on `record`'s parameter runs next (Hooks._grad_hooks_last): where its
        chunk holds a gradient already (accumulation; a second backward of a retained graph), `p.grad` is the sum, as
        autograd leaves it, a tensor of its own that `_take_grad` then writes over the chunk's range."""
        grad = record.param.grad
        if grad is None or record.grad_state is TensorState.FREE or self.shards is not None or \
                grad is self.grads.users.get(record) or self.grads.accumulated(record, grad):
            return
        # An earlier gradient of this backward (reentrant checkpointing gives a parameter several) made `p.grad` the sum
        # already: as the tensor kept shown through a resident backward, or as the one a user's hook put there since.
        if record in self.summed or (record in self.grads.shown and record in self.grads.through_forward):
            return
        # copy=True: a streamed group's range is a host payload, which the simulation's `.to(device)` would not copy
        record.param.grad = self.grads.range_now(record).to(grad.device, copy=True) + grad
        self.summed.add(record)

    def _unsummed(self, record: ParamRecord) -> None:
        """`record`'s `p.grad` is None after its hooks ran: where a user's hook was shown the sum (`sum_for_users`) and
        set it to None, the parameter has no gradient, as in PyTorch (the step leaves it)."""
        if self.summed and record in self.summed:
            self.summed.discard(record)
            record.move_grad("free")

    def _end_of_backward_called(self) -> None:
        """`_backward_done` runs when the running backward ends (queued once per backward)."""
        task = torch._C._current_graph_task_id()
        # -1: a pipeline's own call. A backward that raised never called back: the next one queues its end again.
        if task != -1 and task != self.backward_task:
            self.backward_task = task
            if task not in self.queued:
                self.queued.add(task)
                torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._backward_done, task))

    def _after_node(self, node: Any) -> None:
        """`_end_of_backward_called` once autograd node `node`, running now, has run: in its backward's task."""
        def ran(*_: Any) -> None:
            handle.remove()
            self._end_of_backward_called()
        handle = node.register_hook(ran)

    def grads_unhooked(self, hooks: object, off: bool) -> None:
        """A model's gradient hooks went off (Hooks._grad_hooks) or came back."""
        if off:
            self.unhooked.add(id(hooks))
            self.strays = True
        else:
            self.unhooked.discard(id(hooks))

    def rewrote(self, records: Collection[ParamRecord]) -> None:
        """chunkmem wrote these parameters' values in their chunks (a step, a load), not through the parameters: their
        version counters move as an in-place write moves them in PyTorch, so that a backward through a graph that saved
        them before (`backward(retain_graph=True)`, then a step, then the second backward: a GAN's discriminator) raises
        as PyTorch's does, rather than mixing the new values with the old activations. The versions chunkmem keeps to
        find the user's own writes (`_adopt_edits`, ParamStore.note_writes, ShownGrads.restore) move with them."""
        if not records:
            return
        torch.autograd.graph.increment_version([r.param for r in records])
        for record in records:
            record.version = record.param._version
        for group in {r.group for r in records if r.group.owned}:  # under ZeRO, those of this rank's share
            versions = group.versions()
            if group.param in self.store.device_views:
                self.store.device_views[group.param] = versions
            if group in self.grads.host_viewed:
                self.grads.host_viewed[group] = versions

    def written_through_data(self, param: nn.Parameter) -> None:
        """A forward changed `param` in place through `param.data` (FetchMode._through_data), which moves no version
        counter: the change is kept as one through the parameter is (ParamStore.written), and forwards keep the mode
        that sees it, none lean or resident."""
        record = self.store.records.get(param)
        if record is not None:
            self.lean_allowed = self.resident_allowed = False
            self.store.written(record)

    def adopt_data(self) -> None:
        """A parameter given other storage by the user (`p.data = t`, torch.nn.utils.vector_to_parameters) no longer
        views its chunk, which would point it back and lose the value: its value goes into its chunks first (before a
        forward, a step, a state_dict). Not a cast of its value to another dtype (`module.to(torch.float32)`, which
        SwitchTransformers' router does to its classifier in every forward): the master keeps its precision (it took the
        rounding to bf16 before). Not under ZeRO, where parameters view gathered copies."""
        if self.shards is not None:
            return
        self.grads.drop_copies(changed_only=True)
        store = self.store
        for group in store.owned_groups():
            chunk = group.param
            if chunk.state is ChunkState.DISK:
                continue
            flat = chunk.device_unfenced if chunk in store.device_views else chunk.host_unfenced
            if flat is None:  # a lending chunk's payload is not there yet (chunk's Note on lent ranges)
                continue
            viewed = flat.untyped_storage().data_ptr()
            moved = [r for r in group.members if r.param.untyped_storage().data_ptr() != viewed]
            if "master" in group.chunks:
                self._adopt_edits(group, moved)
            for record in moved:
                value = record.param.detach()
                if value.shape != record.shape:
                    raise ValueError(
                        f"parameter {record.name} has shape {tuple(value.shape)}, and had {tuple(record.shape)} when "
                        "chunkmem.prepare laid out its chunk: a prepared model's parameters keep their shapes "
                        "(resize_token_embeddings changes them): change the model first, then prepare it")
                if value.dtype == chunk.dtype or not torch.equal(
                        value.to(chunk.dtype), record.view(self.data.read(chunk)).to(value.device)):
                    self.data.set_value(record, value.to("cpu", copy=True))
            if moved:
                store.point_views(chunk)

    def _adopt_edits(self, group: ChunkGroup, moved: list[ParamRecord]) -> None:
        """In low precision, a parameter changed in place since its master last took its value (`with torch.no_grad():
        p.clamp_(-c, c)`, EMA weights copied in) gives the master its value, as the parameter is the model's value in
        PyTorch: else the step would overwrite the change from the master, and state_dict() would not show it. Found by
        its version counter, which chunkmem's own writes (into the chunk, not through the parameter) leave alone."""
        for record in group.members:
            version = record.param._version
            if version != record.version:
                if record not in moved:  # those are written whole (`p.data =`) below
                    # What the parameter views, once a copy into it has landed (a download into the host payload)
                    chunk = group.param
                    viewed = chunk.device if chunk in self.store.device_views else chunk.landed()
                    master = self.data.writable(group.master, group.master.state.on_device)
                    record.view(master).copy_(record.view(viewed))  # type: ignore[arg-type]  # on the device there
                record.version = version

    def adopt_grads(self, assigned: bool = False) -> None:
        """The gradients autograd left in `p.grad` while gradient hooks were off go to their chunks, as grad_ready
        would have taken them: at the end of a backward that reached the model's outputs, and before gradients are
        read (a step, clipping, zero_grad) for one that did not (a penalty on parameters alone), whose gradients
        wait in `p.grad` meanwhile, where the next backward adds to them as autograd does. In a resident step each is
        lent to its chunk as it is, and `p.grad` keeps it (shown: grads.py's Note). `assigned`: where gradients are
        read, also those the user assigned to `p.grad` with no backward (torch.autograd.grad's, say)."""
        if not (self.strays or assigned):
            return
        shown, resident = self.grads.shown, self.placer.resident
        for group in self.store.trainable_groups():
            chunk = group.grad
            for record in group.members:
                grad = record.param.grad
                if grad is None or record in shown:  # a shown one autograd adds into; replaced, the step takes it
                    if grad is None:
                        self._unsummed(record)
                    continue
                if resident and not chunk.state.on_device:  # its first gradient this step: it materializes
                    self.placer.access([chunk], "grad", group.index)
                if resident and chunk.lending and record.grad_state is TensorState.FREE and grad.is_contiguous():
                    chunk.write_device()
                    chunk.lend(record.slot.offset, grad)
                    record.move_grad("write")
                    self.grads.showing(record, grad)
                else:
                    record.param.grad = None
                    self._take_grad(record, grad)
        self.strays = bool(self.unhooked)

    def _take_grad(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Write `grad`, `record`'s fresh gradient, into its chunk."""
        if grad.requires_grad and not self.warned_graph:
            self._warn_graph()
        if self.grads.accumulated(record, grad):  # autograd added into the shown gradient: the chunk has the sum
            self.grads.hide([record], edits=False)
            return
        if self.shards is not None:
            record.move_grad("write")
            self.shards.reducer.add(record, grad)
            return
        # Autograd added into a tensor of the user's that was `p.grad`: it holds the whole gradient (grads.py's Note).
        accumulate = record.grad_state is not TensorState.FREE and grad is not self.grads.users.get(record)
        if self.summed and record in self.summed:  # `sum_for_users` made it the whole gradient
            self.summed.discard(record)
            accumulate = False
        self._write_grad(record.group, grad, record.view, accumulate=accumulate, start=record.slot.offset)
        record.move_grad("write")
        if self.ahead is not None and not self.placer.homed(record.group.index):
            self.ahead.written(record, accumulate)

    def _warn_graph(self) -> None:
        """A gradient with a graph of its own (`backward(create_graph=True)`) goes into its chunk as values: `p.grad`
        then has no graph, and a term computed from it would get no gradient, silently."""
        self.warned_graph = True
        log.warning("chunkmem: backward(create_graph=True) on a prepared model: its gradients go into chunks as "
                    "values, so p.grad has no graph and a term computed from it (a gradient penalty on p.grad) gets no "
                    "gradient; compute such terms from torch.autograd.grad(loss, params, create_graph=True), as "
                    "PyTorch also recommends over backward(create_graph=True)")

    def _write_grad(self, group: ChunkGroup, grad: torch.Tensor, part: Callable[[torch.Tensor], torch.Tensor],
                    accumulate: bool, start: int | None = None) -> None:
        """Write (or add) `grad` into `part` of the group's gradient chunk: on the device for groups homed
        there, else straight to the host, where the optimizer steps: a download that backward does not
        wait for, fenced like every copy (it lands before the host next reads the chunk). On the device, a
        gradient autograd made for the part from `start` is lent to the chunk rather than copied (chunk's
        Note on lent ranges)."""
        chunk = group.grad
        nonmodel = self.emit("grad", "bwd", chunk.name)
        self.placer.access([chunk], "grad", group.index, nonmodel)  # brings it if homed on the device
        if self.placer.homed(group.index):
            chunk.write_device()
            lent = chunk.lent_part(start) if start is not None else None
            if accumulate:
                (lent if lent is not None else part(chunk.device)).add_(grad)  # type: ignore[arg-type]
            elif start is not None and chunk.lending and grad.is_contiguous():
                chunk.lend(start, grad.detach())
            else:  # overwrites its part: the chunk is not zeroed for it (chunk's Note on unwritten ranges)
                chunk.overwrite(part).copy_(grad)
            return
        # The copy engine moves bytes between flat buffers of one dtype: a gradient of a parameter cast in forward
        # (SwitchTransformers' router casts its weights to fp32) is rounded to the chunk's first, as a copy rounds it.
        source = grad if accumulate or grad.dtype == chunk.dtype else grad.to(chunk.dtype)
        if not source.is_contiguous():
            source = source.contiguous()
        self.residency.stream_down(chunk, source, part, self._host_like(source) if accumulate else None)

    def _add_share(self, key: Key, share: torch.Tensor) -> None:
        """Add this rank's reduce-scattered share of a gradient group to its gradient chunk."""
        owned = self.shards.owned(key)  # type: ignore[union-attr]
        if owned.trainable:
            grad = owned.grad
            self._write_grad(owned, share, lambda flat: flat, accumulate=grad.state is not ChunkState.FREE)

    def mark_outputs(self, output: Any) -> None:
        """A forward of the model's (its own, or a module of it called on its own) gave `output`: the backward through
        any of its tensors begins with `backward_begins`, and the largest of them is the first gradient that backward
        makes."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        for index, tensor in enumerate(tensors):
            reached = functools.partial(self.backward_begins, output=index)
            tensor.grad_fn.register_prehook(reached)  # type: ignore[union-attr]  # (not None: above)
        # Sizes after the hooks: a compiled forward's Dynamo traces up to them, and a tensor of symbolic sizes it traces
        # has no nbytes.
        sizes = [t.nbytes for t in tensors]
        self.output_bytes = max(sizes, default=0)
        self.largest_output = sizes.index(self.output_bytes) if sizes else -1
        # A loss the forward computed from low-precision outputs upcasts them (Hugging Face's, given labels): its first
        # gradients are the fp32 copy's, twice the bf16 logits' bytes (a tiny bf16 LLaMA at a budget prepare accepted
        # met the allocator's error in its first backward where BackwardRoom.for_output counted the logits' own).
        largest = tensors[self.largest_output] if sizes else None
        self.upcast_bytes = self.output_bytes * 4 // largest.element_size() if largest is not None and \
            largest.is_floating_point() and largest.element_size() < 4 else self.output_bytes

    def backward_begins(self, grads: Any, output: int = -1) -> None:
        """A backward reaches the model's outputs (a pre-hook of their grad_fn, before any parameter's gradient), or a
        pipeline's micro-batch backward begins (`grads` None): gradients shown since the last backward are hidden, so
        that this one adds into their chunks rather than into `p.grad` (grads.py's Note). A second backward of a
        retained graph, with no forward between, added a gradient made on the device into a streamed group's, shown on
        the host. `output`: which of the model's outputs it reached (`mark_outputs`); another than the largest first, a
        loss the forward computed from that."""
        if self.grads.shown:
            self.grads.hide_for_backward(self.placer.resident and self.shards is None)
        if self.grads.users:
            self.grads.take_users()
        if self.scaler is not None and not self.grads_scaled:  # clipped, then no zero_grad (`p.grad` zeroed in place)
            self._scale_kept()
        if self.unhooked:  # no gradient hook will: the backward's end takes the gradients (adopt_grads)
            self._end_of_backward_called()
        # A loss's backward, over the logits, comes first, and no chunk access before it makes room. Room is made in
        # the warm-up, which has no record of what backward allocates (LLaMA and Mixtral at 5% of their model data,
        # coarse chunks, died there); in later steps chunks that left it found no room to come back.
        if grads is None:
            if self.warmup:
                self._room_for_activations()
            return
        task = torch._C._current_graph_task_id()
        if task == self.room_task:  # another output of this backward's (a loss, then its logits)
            return
        self.room_task = task
        for method in self.hooks_last:  # a user's gradient hook registered since the forward runs before ours too
            hooks_last = method()
            if hooks_last is not None:
                hooks_last()
        first = self.upcast_bytes if output not in (-1, self.largest_output) else self.output_bytes
        if self.warmup:
            self.room.for_output(self._room_for_activations(), 0, first)  # those that may leave, left
        elif not self.placer.steady and self.shards is None:  # a step that outgrew its plan's record or left it
            room = self.device.allocation_room()
            chunks = sum(c.nbytes for c in self.residency.resident.values() if not c.pins)
            self.room.for_output(room, chunks, first)

    def recomputed(self, name: str) -> None:
        """Backward re-computed module `name` (activation checkpointing) for the node running now, whose gradients
        come next. Under torch's own saved-tensor hooks (its non-reentrant kind) no unpack of ours runs before the
        ops of that module's backward (BackwardRoom.for_grad), so where no plan foresees them (the warm-up, a step that
        left its plan) chunks nothing holds leave for the node's gradients, and where even with none left no blocks
        of theirs are free, a MemoryBudgetError names the bytes rather than the allocator's error from inside
        autograd (a tiny GPT-2 checkpointed per layer at 600 KiB of a scaled H100 allocator)."""
        if not (self.warmup or self.placer.phase is Phase.DIVERGED) or self.config.device_memory is None:
            return
        self.room.for_recomputed(name)

    def _room_for_activations(self) -> Room | None:
        """BackwardRoom.for_activations, under a budget, and not under ZeRO (whose transient buffers are reserved)."""
        if self.config.device_memory is None or self.shards is not None:
            return None
        return self.room.for_activations()

    def _backward_done(self, task: int) -> None:
        """End of backward: under ZeRO every gradient group reduced and added to its owner's chunk; parameters
        readable by what runs next (`fence_params`). A backward nested in a node of another (torch.utils.checkpoint's
        reentrant kind runs one per segment) ends the outer one's part: its end is the outer's, after that node.
        Ending here, it showed the gradients so far in `p.grad`, into which the next segment's backward added
        (streamed groups' on the host: a device mismatch) before the outer backward ended."""
        self.queued.discard(task)
        self.backward_task = -1
        node = torch._C._current_autograd_node()
        if node is not None:
            self._after_node(node)
            return
        self.queued.clear()  # those of backwards that raised: they never end
        self.release_held_back()
        if self.grads.through_forward:  # shown through a resident backward: a user's hook may have cleared one since
            self.grads.take(self.grads.through_forward)
        self.adopt_grads()
        self.placer.backwards += 1
        if self.placer.resident:
            self._note_peak(self.nonmodel_bytes())
        if self.shards is not None:  # reduce-scatters in flight finish now
            self.shards.finish_backward()
        failed = self.ahead.backward_done() if self.ahead is not None else None
        self.grads.hidden_by_forward.clear()
        if self.shards is None:
            self.grads.show()
        else:
            self.grads.show_sharded()
        self.fence_params()  # after show: a parameter chunk changed on the device may have gone back to the host
        if failed is not None:  # an update made ahead (step() makes it again)
            raise failed

    def fence_params(self) -> None:
        """Parameters readable and writable by user code: compute waits for every upload still landing (on CUDA the
        compute stream waits, the host does not), and the host for the copies on a host payload parameters view.

        Called where control goes back to user code (the end of a forward, of a backward, of `step()`, of
        `zero_grad`): a parameter views its chunk's device payload as soon as the upload is issued,
        and its host payload as soon as its chunk left the device, a download of what changed there still landing;
        code outside the hooks (an EMA, a log line, a penalty term) reads it with no hook to wait first (SPEC: every
        read of chunk bytes waits for the copies that write them). Where parameters view their chunk's host payload,
        which that code may write in place (a weight constraint), the host also waits for an upload still reading it."""
        for chunk in self.residency.resident.values():
            if chunk.pending is not None:
                chunk.fence()
        for group in self.store.owned_groups():
            if group.param not in self.store.device_views:
                group.param.settled_copies()
                group.param.host_writable()

    def _scale_kept(self) -> None:
        """Gradients kept across the step were unscaled (by clipping), and the next backward adds scaled ones: they
        carry the loss scale again. The scale as an fp32 tensor: CPU's foreach ops cast a number to the fp16 tensors'
        dtype, and 65536 is inf there (CUDA's lists take it too)."""
        grads = self.data.grad_views()
        scale = torch.tensor(self.scaler.scale, dtype=torch.float32, device="cpu")  # type: ignore[union-attr]
        if grads:  # none held (`p.grad = None` for every parameter since): nothing to scale
            torch._foreach_mul_(grads, scale)
        self.grads_scaled = True

    def zero_grad(self, set_to_none: bool = True, only: Container[ParamRecord] | None = None) -> None:
        """Forget the gradients of every parameter (`model.zero_grad()`), or of those in `only` (the
        optimizer's, as torch.optim's zero_grad does): the others keep theirs."""
        kept, zeroed = False, []
        shown = not set_to_none and self.shards is None  # zeros in `p.grad`, as PyTorch leaves them (grads.py's Note)
        self.adopt_data()  # `p.data = t` since the step (EMA weights swapped in): hiding would point it back
        self.adopt_grads(assigned=True)
        if self.ahead is not None:  # updates made ahead read the gradients cleared now
            self.ahead.drop()
        # Under ZeRO p.grad cannot be set, and this clears it anyway; what the user put in `p.grad` goes into chunks
        # only where they keep their gradients.
        self.grads.hide(only, edits=self.shards is None and not set_to_none, dropped=set_to_none)
        for group in self.store.trainable_groups():
            cleared = [r for r in group.members if only is None or r in only]
            chunk = group.grad
            whole = len(cleared) == len(group.members)
            if whole and (not shown or chunk.state is ChunkState.FREE):
                self.residency.reset(chunk)
                if set_to_none:
                    self.grads.keep_viewed(chunk)
            elif cleared and chunk.state is not ChunkState.FREE:
                held = [r for r in cleared if r.grad_state is TensorState.HOLD]
                if held:
                    torch._foreach_zero_(self.data.grads(held, chunk.state.on_device, write=True))
                if whole:
                    zeroed.append(group)
            if set_to_none:
                for record in cleared:
                    record.move_grad("free")
            kept = kept or not whole
        if set_to_none:  # under ZeRO, other ranks' parameters too: which got a gradient is agreed per step
            for record in (r for g in self.store.groups if g.trainable and not g.owned for r in g.members):
                if only is None or record in only:
                    record.move_grad("free")
        if kept and self.scaler is not None and not self.grads_scaled:
            self._scale_kept()
        self.grads_scaled = self.scaler is not None
        if shown:
            self.grads.show(zeroed)
        # Hiding and showing gradients may have sent a parameter chunk changed on the device back to the host (a weight
        # constraint applied after step(): ShownGrads.restore), and parameters view host payloads uploads may read.
        self.fence_params()

    def memory_stats(self) -> dict[str, int]:
        stats = dataclasses.asdict(self.residency.stats)
        stats["activation_offload_bytes"] = self.activations.offload_bytes
        stats["resident_steps"] = self.resident_steps
        stats["lean_forwards"] = self.lean_forwards
        stats["ahead_adopted"] = self.ahead.adopted if self.ahead is not None else 0
        stats["ahead_redone"] = self.ahead.redone if self.ahead is not None else 0
        stats["ahead_rested"] = self.ahead.rested if self.ahead is not None else 0
        stats["ahead_unkept"] = self.ahead.unkept if self.ahead is not None else 0
        stats.update(self.device.host_pool.stats())
        if self.host_cache is not None:
            stats.update(self.host_cache.stats())
        if self.shards is not None:
            stats.update(gathered_bytes=self.shards.gathered_bytes,
                         reduce_scatter_bytes=self.shards.reducer.reduced_bytes,
                         gathered_bytes_peak=self.shards.gathered_peak, transient_bytes_peak=self.shards.live_peak,
                         transient_reserved_bytes=self.shards.reserved)
        stats.update(device_limit_bytes=self.limit, device_bytes_peak=self.device_bytes_peak,
                     model_data_bytes=self.store.model_data_bytes(),
                     chunk_size=self.store.chunk_size, num_chunks=sum(1 for _ in self.store.chunks()))
        return stats

    def groups(self) -> list[ChunkGroup]:
        return list(self.store.trainable_groups())


def _remember(known: set[Any], inputs: set[Any]) -> None:
    """Add input signatures to `known`, which holds the latest MAX_INPUT_SIGNATURES or so."""
    if len(known) > MAX_INPUT_SIGNATURES:
        known.clear()
    known |= inputs
