"""What the ranks of a process group must have in common at prepare, as numbers one collective compares.

Ranks that prepare different models (4 layers on one, 5 on another), dtypes or chunk sizes lay out
different chunks, and their first mismatched collective hangs until the timeout or aborts in the
backend. So each rank hashes what must match into a few numbers; the runtime's first collective
(`collectives.agree`, which also agrees on the device budget) takes the least and the greatest of
each over the ranks, and where they differ every rank raises the same error before any chunk moves.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
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
        "the Config (dtype, chunk_size, device kind, gather_units)":
            (config.dtype, config.chunk_size, config.device.split(":")[0], config.gather_units),
        "the optimizer (class, param groups and their options)":
            [(type(optimizer).__qualname__, [(sorted((k, repr(v)) for k, v in g.items() if k != "params"),
                                               [names.get(id(p)) for p in g["params"]])
                                              for g in optimizer.param_groups]) for optimizer in optimizers],
    }
    return {what: _hash(value) for what, value in parts.items()}


VALUE_SAMPLES = 64  # values of each parameter compared between ranks: enough to tell models seeded apart, and cheap


def initial_values(module: nn.Module) -> dict[str, int]:
    """What of the parameters' values must match on every rank (under ZeRO; not worth its reads otherwise): each rank's
    chunks take the values of the groups it owns from its own model, so ranks that built different ones (seeded apart,
    or weights loaded on one rank alone, as for FSDP's sync_module_states) would train a mix of them, where DDP takes
    rank 0's. Buffers are not sharded: each rank keeps its own."""
    samples = [(name, _sample(p)) for name, p in module.named_parameters() if not p.is_meta and p.layout is torch.strided]
    return {"the initial values of the parameters (every rank must build the same weights: seed every rank alike before "
            "building the model, or load the same weights on each before prepare; chunkmem does not broadcast rank "
            "0's as DDP does)": _hash(samples)}


def _sample(tensor: torch.Tensor) -> bytes:
    """The bytes of up to VALUE_SAMPLES values of `tensor`, spread over it (read in place: no copy of it)."""
    count = tensor.numel()
    picks = torch.arange(min(count, VALUE_SAMPLES)) * (count - 1) // max(1, VALUE_SAMPLES - 1) \
        if count > VALUE_SAMPLES else torch.arange(count)
    index = torch.unravel_index(picks.to(tensor.device), tensor.shape) if tensor.dim() else ()
    return tensor.detach()[index].reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes()


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
