"""What the ranks of a process group must have in common at prepare, as numbers one collective compares.

Ranks that prepare different models (4 layers on one, 5 on another), dtypes or chunk sizes lay out
different chunks, and their first mismatched collective hangs until the timeout or aborts in the
backend. So each rank hashes what must match into a few numbers; the runtime's first collective
(`collectives.agree`, which also agrees on the device budget) takes the least and the greatest of
each over the ranks, and where they differ every rank raises the same error before any chunk moves.
Then every rank takes the first rank's values, as DDP does (`take_first_ranks_values`).
"""

from __future__ import annotations

import hashlib
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
        "the model (parameter names, shapes, dtypes, requires_grad)":
            [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters(
                remove_duplicate=False)],
        "the model's buffers (names, shapes, dtypes)":
            [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers(remove_duplicate=False)],
        "the Config (dtype, chunk_size, device kind, gather_units)":
            (config.dtype, config.chunk_size, config.device.split(":")[0], config.gather_units),
        "the optimizer (class, param groups and their options)":
            [(type(optimizer).__qualname__, [(sorted((k, repr(v)) for k, v in g.items() if k != "params"),
                                               [names.get(id(p)) for p in g["params"]])
                                              for g in optimizer.param_groups]) for optimizer in optimizers],
    }
    return {what: _hash(value) for what, value in parts.items()}


BROADCAST_BUCKET = 32 * 2**20  # bytes per broadcast of the initial values: few collectives, a small device buffer


def take_first_ranks_values(module: nn.Module, group: Any, device: torch.device) -> None:
    """Give every rank of `group` its first rank's parameter and buffer values, as DDP does at construction: each
    rank's chunks take the values of the groups it owns from its own model, so ranks that built different ones (seeded
    apart, or weights loaded on one rank alone) would otherwise train a mix of them. Meta tensors (weights loaded after
    prepare) and tensors without strided storage are left as they are. Runs after the fingerprints agree, so every rank
    broadcasts the same tensors in the same order."""
    source = dist.get_global_rank(group, 0)
    bucket: list[torch.Tensor] = []  # bytes of the values (uint8 views): one dtype for all, whatever the backend takes
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta or tensor.layout is not torch.strided:
            continue
        if not tensor.is_contiguous():  # rare: broadcast a copy on its own, and put it back
            copy = tensor.detach().contiguous()
            _broadcast([copy.view(-1).view(torch.uint8)], source, group, device)
            with torch.no_grad():
                tensor.copy_(copy)
            continue
        for piece in tensor.detach().view(-1).view(torch.uint8).split(BROADCAST_BUCKET):
            if bucket and sum(t.numel() for t in bucket) + piece.numel() > BROADCAST_BUCKET:
                _broadcast(bucket, source, group, device)
                bucket = []
            bucket.append(piece)
    if bucket:
        _broadcast(bucket, source, group, device)


def _broadcast(pieces: list[torch.Tensor], source: int, group: Any, device: torch.device) -> None:
    """Broadcast byte views from `source` into place, through one buffer on the collective's device."""
    flat = torch.cat([piece.to(device) for piece in pieces])
    dist.broadcast(flat, source, group=group)
    if dist.get_rank() != source:
        for piece, value in zip(pieces, flat.split([piece.numel() for piece in pieces])):
            piece.copy_(value)


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
