"""A prepared model's data as the code outside the hooks sees it: chunk payloads to read or change in place
(the optimizer, clipping), and parameter values and optimizer states by parameter, gathered from every
rank under ZeRO (state dicts, checkpoints). Each payload is read fenced, wherever its chunk is.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.residency import Residency
from chunkmem.chunks.state import ChunkState, TensorState
from chunkmem.chunks.store import ChunkGroup, ParamRecord, ParamStore
from chunkmem.zero.shards import Shards


class ModelData:
    """Reads and writes of one model's chunks; `shards` when its data is sharded over ranks."""

    def __init__(self, store: ParamStore, residency: Residency, shards: Shards | None) -> None:
        self.store = store
        self.residency = residency
        self.shards = shards

    def read(self, chunk: Chunk) -> torch.Tensor:
        """The freshest payload of a chunk, for reading."""
        return chunk.payload()

    def writable(self, chunk: Chunk, on_device: bool) -> torch.Tensor:
        """A payload to change in place: on the device (marked dirty) or on the host (the only copy)."""
        if on_device:
            flat = self.residency.to_device(chunk)
            chunk.write_device()
            return flat
        return self.residency.host_for_write(chunk)

    def grads(self, records: list[ParamRecord], on_device: bool, write: bool = False) -> list[torch.Tensor]:
        """The gradients of `records`, all of one chunk group, on the device or the host (to change in place
        if `write`): the tensors lent to their chunk where it lends them all (chunk's Note on lent ranges),
        else views of its payload."""
        chunk = records[0].group.grad
        if not on_device:
            flat = self.residency.host_for_write(chunk) if write else self.residency.to_host(chunk)
            return [r.view(flat) for r in records]
        self.residency.bring(chunk)
        if write:
            chunk.write_device()
        lent = [chunk.lent_part(r.slot.offset) for r in records]
        if all(g is not None for g in lent):
            return lent  # type: ignore[return-value]
        flat = chunk.device  # type: ignore[assignment]
        return [r.view(flat) for r in records]

    def grad_views(self, only: Container[ParamRecord] | None = None) -> list[torch.Tensor]:
        """Gradients of this rank's parameters (or of those in `only`) that have one, chunk group by chunk group
        (norms, clipping)."""
        out = []
        for group in self.store.trainable_groups():
            held = [r for r in group.members if r.grad_state is TensorState.HOLD and (only is None or r in only)]
            if held:
                out += self.grads(held, group.grad.state.on_device, write=True)
        return out

    def values(self, kind: str = "master", root: int | None = None) -> dict[ParamRecord, torch.Tensor]:
        """Every parameter's fp32 value (or optimizer state `kind`) on CPU, gathered from all ranks: on every rank, or
        under ZeRO on rank `root` alone (the others get none)."""
        def pick(group: ChunkGroup) -> Chunk | None:
            return group.master if kind == "master" else group.chunks[kind] if group.trainable else None

        out = {}
        for group in self.store.groups if self.receives(root) else ():
            chunk = pick(group) if group.owned else None
            if chunk is not None:
                flat = self.read(chunk).detach().to("cpu", torch.float32, copy=True)  # (on the host in the simulation)
                out.update({r: r.view(flat).clone() for r in group.members})
        if self.shards is not None:
            for group, part in self._wholes(pick, torch.float32, root):
                out.update({r: r.view(part).clone() for r in group.members})
        return out

    def gathered(self, only: Container[ParamRecord] | None = None) -> dict[ParamRecord, torch.Tensor]:
        """Under ZeRO, the value of every parameter (or of those in `only`) in its own dtype on CPU, gathered from all
        ranks: a collective (gathered_parameters)."""
        return {r: r.view(part) for group, part in self._wholes(lambda owned: owned.param)
                for r in group.members if only is None or r in only}

    def _wholes(self, pick: Callable[[ChunkGroup], Chunk | None], dtype: torch.dtype | None = None,
                root: int | None = None) -> Iterator[tuple[ChunkGroup, torch.Tensor]]:
        """Under ZeRO, of each communication group the chunk `pick` takes of this rank's group (None: none), gathered
        from all ranks on CPU in `dtype` (on rank `root` alone, if given): each chunk group with its part of it."""
        assert self.shards is not None
        size = self.store.chunk_size
        for key, groups in sorted(self.shards.members.items()):
            chunk = pick(self.shards.owned(key))
            if chunk is None:
                continue
            local = self.read(chunk).detach().to("cpu", dtype=dtype)
            full = self.shards.all_gather_flat(local) if root is None else self.shards.gather_flat(local, root)
            if full is not None:
                yield from ((group, full[i * size:(i + 1) * size]) for i, group in enumerate(groups))

    def receives(self, root: int | None) -> bool:
        """Whether this rank gets what `values(..., root)` gathers."""
        return root is None or self.shards is None or self.shards.rank == root

    def fp32_value(self, record: ParamRecord) -> torch.Tensor:
        return record.view(self.read(record.group.master)).detach().to("cpu", torch.float32, copy=True)

    def set_value(self, record: ParamRecord, value: torch.Tensor) -> None:
        if value.shape != record.shape:
            raise ValueError(f"value for {record.name} has shape {tuple(value.shape)}, "
                             f"expected {tuple(record.shape)}")
        for kind in ("master", "param"):  # another rank's parameter has no chunk here: nothing to do
            chunk = record.group.chunks.get(kind)
            if chunk is not None:
                record.view(self.writable(chunk, chunk.state.on_device)).copy_(value)

    def model_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes of model data by kind ("param", "grad", "master", "exp_avg", ...) on device, host and disk.

        Every chunk keeps a host payload (the device copy is a cache), but a disk-backed chunk on disk.
        """
        out: dict[str, dict[str, int]] = {"device": {}, "host": {}, "disk": {}}
        for chunk in self.store.chunks():
            kind = chunk.family
            side = "disk" if chunk.state is ChunkState.DISK else "host"
            out[side][kind] = out[side].get(kind, 0) + chunk.nbytes
            if chunk.state.on_device:
                out["device"][kind] = out["device"].get(kind, 0) + chunk.nbytes
        return out

