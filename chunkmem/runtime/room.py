"""Room on the device for what backward allocates where nothing can be retried.

A forward op that runs out of memory is retried (the torch-function mode evicts chunks and runs it again), but an
allocation autograd makes for a gradient fails inside the engine, and the backward with it. So before the backward
ops that allocate most (those of a saved parameter, a re-computed module, the loss's first ones), chunks nothing uses
leave until the allocator is certain to have the blocks, and where even with every one gone it cannot have them, a
MemoryBudgetError names the bytes rather than the allocator's error from inside autograd.
"""

from __future__ import annotations

import math

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.residency import Residency
from chunkmem.chunks.store import ParamStore
from chunkmem.errors import ACTIVATION_FIXES, MemoryBudgetError
from chunkmem.memory.allocator import Room
from chunkmem.memory.device import Device

MAX_SEGMENT_SIZES = 1024  # byte sizes whose segments are remembered (of many input lengths: the latest)


def grad_sizes() -> list[int]:
    """The bytes of each gradient the running backward node makes (those its next nodes take in, as autograd
    recorded them); none outside a node."""
    node = torch._C._current_autograd_node()
    if node is None:
        return []
    sizes = []
    for function, index in node.next_functions:
        if function is not None:
            meta = function._input_metadata[index]
            sizes.append(math.prod(meta.shape) * meta.dtype.itemsize)
    return sizes


class BackwardRoom:
    """Makes room for backward's allocations under the budget `limit` (bytes) of `device`, by evicting chunks of
    `residency` nothing uses (of `store`'s groups). `largest_block`: the largest block non-model data took so far (the runtime's memory
    readings raise it): a hole it filled in one step may be taken in the next."""

    def __init__(self, device: Device, residency: Residency, store: ParamStore, limit: int) -> None:
        self.device = device
        self.residency = residency
        self.store = store
        self.limit = limit
        self.largest_block = 0
        self._segment_sizes: dict[int, int] = {}  # bytes -> Device.segment_for's (`_segments`)

    def saw(self, largest: int) -> None:
        """A memory reading found non-model data's largest block of `largest` bytes."""
        self.largest_block = max(self.largest_block, largest)

    def for_grad(self, chunk: Chunk, numel: int, nonmodel: int) -> None:
        """Backward of an op that saved `numel` elements of a trainable parameter chunk allocates the gradients of
        its inputs next (that parameter's and an activation's, as autograd's node says: `grad_sizes`), and an
        allocation of autograd's cannot be retried once it fails. So where the allocator may lack room for them, chunks
        nothing uses leave (`_make`). With none left to leave, where no hole holds them either (the cap less the live
        tensors is smaller, or blocks of their sizes are refused), the op is certain to fail, and a MemoryBudgetError
        names the bytes rather than the allocator's error from inside autograd; else the op goes on. Cheap unless the
        allocator may hold that much: `nonmodel` (the reading just made) and the arena bound what it holds, and the
        largest block non-model data took bounds the activation's gradient. Blocks are taken for the gradients only
        as that last resort: reserved and given back before every such op (Residency.reserve), they drew the op's
        other blocks into their holes, and Phi, which trained, failed. Room for a block of `largest_block` beside the
        parameter's gradient, rather than the node's own sizes, made chunks leave that then found no room to come
        back (Phi at 10% of its model data, with coarse chunks); room for the parameter's alone left LLaMA and
        Mistral in fp32 at 2% of their model data to die of the allocator's error on the activation's gradient."""
        group = self.store.group_of(chunk)
        sizes = [numel * chunk.dtype.itemsize, self.largest_block]
        if group is None or not group.trainable or \
                nonmodel + self.device.arena.footprint + self._segments(sizes) <= self.limit:
            return
        sizes = grad_sizes() or sizes[:1]
        if nonmodel + self.device.arena.footprint + self._segments(sizes) <= self.limit:
            return
        room = self.lacking(sizes, chunk)
        if room is not None:
            raise MemoryBudgetError(
                f"backward needs {sum(sizes)} bytes on the device for the gradients of an op on parameters in "
                f"{chunk.name} (blocks of {', '.join(map(str, sizes))} bytes), but with {chunk.name} itself "
                f"({chunk.nbytes} bytes) the only chunk left there, the allocator has no blocks for them under "
                f"Config.device_memory={self.limit} bytes ({self.limit / 2**20:.1f} MiB): the tensors there leave "
                f"{room.most} bytes of what it may take, {room.sure} of them beyond the holes between them: "
                f"{ACTIVATION_FIXES}, or lower Config.chunk_size")

    def for_recomputed(self, name: str) -> None:
        """Backward re-computed module `name` for the node running now, whose gradients come next (Runtime.recomputed):
        chunks nothing holds leave for them, or a MemoryBudgetError names the bytes."""
        sizes = grad_sizes()
        if sum(sizes) < 2 * self.largest_block:  # the module's other backward ops: as `for_activations`
            sizes = [self.largest_block] * 2
        room = self.lacking(sizes)
        if room is not None:
            raise MemoryBudgetError(
                f"backward needs {sum(sizes)} bytes on the device for the gradients of {name}, re-computed under "
                f"activation checkpointing (blocks of {', '.join(map(str, sizes))} bytes), but with every chunk "
                f"that may leave gone (those {name} re-computed stay until its backward ends: what it saved views "
                f"them), the tensors there leave {room.most} bytes of Config.device_memory={self.limit} bytes "
                f"({self.limit / 2**20:.1f} MiB), or no blocks of those sizes: {ACTIVATION_FIXES}, or lower "
                "Config.chunk_size")

    def for_activations(self) -> Room | None:
        """Before a backward op no chunk access precedes: room for two blocks of the largest size non-model data
        took (the gradient of its input and a temporary), where chunks can leave (`_make`: None when made, or
        nothing to make it for; else the room there is, with no chunk left to leave)."""
        return self._make([self.largest_block] * 2) if self.largest_block else None

    def for_output(self, room: Room | None, chunks: int, nbytes: int) -> None:
        """A loss's first backward ops make two gradients the size of the output it is computed from (the
        log-softmax's and the logits', or the squared difference's and the difference's: `nbytes` each, the fp32 copy's
        where the forward computed the loss from low-precision logits) while every activation is alive. With too little
        `room` for two, even once the `chunks` bytes of chunks that may leave have left (or no blocks of that size,
        with none left), backward is certain to fail where nothing can be retried: a MemoryBudgetError names the bytes,
        as `for_grad`'s does, rather than the allocator's error from inside autograd (activations that took all
        but a few bytes of the budget, their forward's ops kept going by evicting every chunk)."""
        sizes = [nbytes] * 2
        if room is None or (room.most + chunks >= sum(sizes) and (chunks > 0 or self._allocates(sizes))):
            return
        raise MemoryBudgetError(
            f"backward needs two blocks of {nbytes} bytes on the device for the first gradients of the "
            f"model's output, but the activations leave the allocator {room.most} bytes of Config.device_memory="
            f"{self.limit} bytes ({self.limit / 2**20:.1f} MiB) beside {chunks} bytes of chunks that could leave, or "
            f"no blocks of that size: {ACTIVATION_FIXES}")

    def lacking(self, sizes: list[int], keep: Chunk | None = None) -> Room | None:
        """Gradients of these byte sizes that backward makes next: chunks nothing uses (but `keep`) leave for them
        (`_make`), and where none is left to and no blocks of theirs are free, the room there is, for the
        caller's MemoryBudgetError; None where they fit."""
        room = self._make(sizes, keep)
        return None if room is None or (room.most >= sum(sizes) and self._allocates(sizes)) else room

    def _segments(self, sizes: list[int]) -> int:
        """What blocks of these sizes reserve at most (Device.segment_for, remembered: backward's hot path asks for
        the same few sizes at every op that saved a parameter)."""
        known, total = self._segment_sizes, 0
        for nbytes in sizes:
            segment = known.get(nbytes)
            if segment is None:
                if len(known) > MAX_SEGMENT_SIZES:
                    known.clear()
                segment = known[nbytes] = self.device.segment_for(nbytes)
            total += max(nbytes, segment)
        return total

    def _make(self, sizes: list[int], keep: Chunk | None = None) -> Room | None:
        """Chunks nothing uses (but `keep`) leave until new segments for blocks of these byte sizes are certain, or
        a slot that left holds them all (its block goes back to the allocator's pool for their sizes): None. Else,
        with none left to leave, the room there is (Device.allocation_room). Nothing is allocated: blocks taken and
        given back draw an op's other blocks into their holes, and split the segments chunks come back to."""
        need = self._segments(sizes)
        room = self.device.allocation_room()
        if room is None or self._certain(room, need, len(sizes) > 1):
            return None
        small = self.device.segment_for(1)  # the small pool's segment
        pools = {self.device.segment_for(n) == small for n in sizes}
        self.device.synchronize()  # copies in flight hold blocks freed meanwhile (CUDA's allocator waits for them too)
        if keep is not None:
            keep.pins += 1
        try:
            while (room := self.device.allocation_room()) is not None and not self._certain(room, need, len(sizes) > 1):
                candidates = [c for c in self.residency.resident.values() if not c.pins]
                if candidates:
                    self.residency.evict(self.residency.policy.victim(candidates))
                    self.residency.stats.evictions += 1
                    self.device.synchronize()  # its slot is free once its copy landed
                slot = self.device.arena.release()
                if slot >= sum(sizes) and pools == {self.device.segment_for(slot) == small}:
                    return None
                if not candidates and not slot:
                    return room
            return None
        finally:
            if keep is not None:
                keep.pins -= 1

    def _certain(self, room: Room, need: int, several: bool) -> bool:
        """Whether new segments of `need` bytes in all are certain: for one allocation, within what the allocator
        holds; for `several`, within what it reserves, or made so by releasing its wholly free segments now (Room)."""
        if room.sure < need:
            return False
        if several and room.fresh < need:
            self.device.empty_cache()
        return True

    def _allocates(self, sizes: list[int]) -> bool:
        """Whether the allocator has blocks of these byte sizes now, all at once (they are taken and given back: the
        last resort of `for_grad`, where only the holes between live blocks are left, and only it knows them)."""
        try:
            blocks = [self.device.alloc(-(-nbytes // 4), torch.float32) for nbytes in sizes]
        except torch.OutOfMemoryError:
            return False
        del blocks  # given back together
        return True
