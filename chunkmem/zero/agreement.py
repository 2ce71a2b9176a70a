"""What the ranks of a process group must have in common at prepare, as numbers one collective compares.

Ranks that prepare different models (4 layers on one, 5 on another), dtypes or chunk sizes lay out
different chunks, and their first mismatched collective hangs until the timeout or aborts in the
backend. So each rank hashes what must match into a few numbers; the runtime's first collective
(`collectives.agree`, which also agrees on the device budget) takes the least and the greatest of
each over the ranks, and where they differ every rank raises the same error before any chunk moves.
Then every rank takes the first rank's values, as DDP does (`first_ranks_values`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from chunkmem.config import Config


def fingerprints(module: nn.Module, config: Config, *optimizers: Optimizer) -> dict[str, int]:
    """What must match on every rank, by what to tell the user, hashed to non-negative 62-bit ints."""
    names = {id(p): n for n, p in module.named_parameters()}
    parts: dict[str, Any] = {
        "the model (parameter names, shapes, dtypes, requires_grad, which are on the meta device)":
            [(n, tuple(p.shape), str(p.dtype), p.requires_grad, p.is_meta, str(p.layout)) for n, p in
             module.named_parameters(remove_duplicate=False)],
        "the model's buffers (names, shapes, dtypes, which are on the meta device)":
            [(n, tuple(b.shape), str(b.dtype), b.is_meta, str(b.layout)) for n, b in
             module.named_buffers(remove_duplicate=False)],
        "the Config (dtype, chunk_size, device kind, gather_units)":
            (config.dtype, config.chunk_size, config.device.split(":")[0], config.gather_units),
        "the optimizer (class, param groups and their options)":
            [(type(optimizer).__qualname__, [(sorted((k, repr(v)) for k, v in g.items() if k != "params"),
                                               [names.get(id(p)) for p in g["params"]])
                                              for g in optimizer.param_groups]) for optimizer in optimizers],
    }
    return {what: _hash(value) for what, value in parts.items()}


BROADCAST_BUCKET = 32 * 2**20  # bytes per broadcast of the initial values: few collectives, a small device buffer


def first_ranks_values(tensors: list[torch.Tensor], deliver: Callable[[int, torch.Tensor], None], group: Any,
                       device: torch.device) -> None:
    """Broadcast the values of `tensors` (alike on every rank: the fingerprints agreed) from the first rank of `group`,
    as DDP does at construction, in pieces of at most BROADCAST_BUCKET bytes through a buffer on `device` (the
    collective's); on every other rank `deliver(i, value)` gets tensor i's value, contiguous on the host, once all of it
    has come. Nothing is written into `tensors` themselves (a prepare that fails after this changes nothing)."""
    source = dist.get_global_rank(group, 0)
    sending = dist.get_rank() == source
    staged: dict[int, torch.Tensor] = {}  # tensor index -> its value on the host, whole or arriving
    bucket: list[tuple[int, torch.Tensor, bool]] = []  # (tensor index, a byte view of its value, its last piece)
    size = 0
    for index, tensor in enumerate(tensors):
        value = tensor.detach().cpu().contiguous() if sending else \
            torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        staged[index] = value
        pieces = value.view(-1).view(torch.uint8).split(BROADCAST_BUCKET) if value.numel() else ()
        if not pieces and not sending:
            deliver(index, staged.pop(index))
        for number, piece in enumerate(pieces):
            if bucket and size + piece.numel() > BROADCAST_BUCKET:
                _broadcast(bucket, staged, deliver, source, group, device, sending)
                bucket, size = [], 0
            bucket.append((index, piece, number == len(pieces) - 1))
            size += piece.numel()
    if bucket:
        _broadcast(bucket, staged, deliver, source, group, device, sending)


def _broadcast(bucket: list[tuple[int, torch.Tensor, bool]], staged: dict[int, torch.Tensor],
               deliver: Callable[[int, torch.Tensor], None], source: int, group: Any, device: torch.device,
               sending: bool) -> None:
    flat = torch.cat([piece.to(device) for _, piece, _ in bucket])
    dist.broadcast(flat, source, group=group)
    for (index, piece, last), value in zip(bucket, flat.split([piece.numel() for _, piece, _ in bucket])):
        if not sending:
            piece.copy_(value)
        if last:
            value = staged.pop(index)
            if not sending:
                deliver(index, value)


def _hash(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big") >> 2


def as_agreed(own: dict[str, int]) -> list[int]:
    """The numbers to agree on (by the least over the ranks): each fingerprint, and its negation for the greatest."""
    return [*own.values(), *(-v for v in own.values())]


def check_agreed(own: dict[str, int], agreed: list[int]) -> None:
    """Raise, the same on every rank, if the ranks' fingerprints differ; `agreed` is `as_agreed` after agreeing."""
    count = len(own)
    low, high = agreed[:count], [-v for v in agreed[count:2 * count]]
    differ = [what for what, a, b in zip(own, low, high) if a != b]
    if differ:
        raise ValueError(f"the ranks of the process group disagree at chunkmem.prepare on {' and on '.join(differ)}: "
                         "every rank must prepare the same model with the same Config and optimizer (Config's "
                         "device_memory and host_memory may differ). Check what each rank builds")
