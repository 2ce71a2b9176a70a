"""What prepare checks before it allocates a chunk: that the sizes asked for exist and the budgets hold.

The checks work on numbers and layouts, not on chunks, so a prepare that fails has allocated
nothing; each error names the field, the bytes needed and the limit, and what to change.
"""

from __future__ import annotations

import psutil
import torch
from torch import nn

from chunkmem.chunks.family import Families
from chunkmem.chunks.layout import chunk_size_candidates
from chunkmem.chunks.store import (checkpointed, layouts, pinned_chunks, planned_model_data_bytes, recomputed_whole,
                                   trained_modules)
from chunkmem.config import Config
from chunkmem.errors import MemoryBudgetError
from chunkmem.memory.hostpool import reserve_bytes


def check_sizes(config: Config, device: torch.device) -> None:
    """Config.device_memory is at most what the device has (in the simulation: this machine's RAM), and
    Config.host_memory at most the machine's RAM."""
    asked, host = config.device_memory, config.host_memory
    total, what = device_total_bytes(device)
    if asked is not None and int(asked) > total:
        raise ValueError(f"Config.device_memory={asked} bytes ({gib(int(asked))}) is more than the device has: "
                         f"{what} has {total} bytes ({gib(total)}): lower device_memory to at most that, or "
                         "leave it None to use what is free")
    ram = psutil.virtual_memory().total
    if host is not None and int(host) > ram:
        raise ValueError(f"Config.host_memory={host} bytes ({gib(int(host))}) is more than this machine's RAM, "
                         f"{ram} bytes ({gib(ram)}): lower host_memory to at most that, or leave it None for "
                         "what the machine can spare")


def check_budgets(module: nn.Module, config: Config, size: int, world: int, families: Families, limit: int) -> int:
    """One chunk of `size` elements, the chunks pinned at once and the model data (chunks of `families`) fit
    their budgets, `limit` bytes on the device. Returns the working set: the most parameter chunk bytes pinned
    on the device at once."""
    chunk_bytes = size * config.torch_dtype.itemsize
    if config.chunk_size is not None and chunk_bytes > limit:
        largest = max((p.numel() for p in module.parameters()), default=0)
        raise MemoryBudgetError(
            f"Config.chunk_size={size} elements makes chunks of {chunk_bytes} bytes ({gib(chunk_bytes)} of "
            f"{config.torch_dtype}), more than the device budget holds: {limit} bytes ({_limit_source(config)}): "
            f"lower chunk_size (the largest parameter has {largest} elements), or leave it None to search")
    working_set = _check_working_set(module, config, size, world, limit)
    if config.disk is None:
        _check_host(config, planned_model_data_bytes(module, size, families, world), size)
    return working_set


MIN_DISK_GROUPS = 2  # optimizer groups the disk tier's host room holds at least: one updating, one read ahead


def tier_bytes(module: nn.Module, size: int, families: Families, world: int) -> tuple[int, int, int]:
    """(bytes that stay in host memory: the chunks that are not disk-backed; bytes a disk tier may hold: master
    and optimizer-state chunks, each rounded up to the disk's alignment; one trainable group's share of these)."""
    trainable, frozen = layouts(module, size, world)
    own_trainable, own_frozen = trainable.num_chunks // world, frozen.num_chunks // world
    fixed = own_trainable * families.group_bytes(size, disk_backed=False) + \
        own_frozen * families.group_bytes(size, trainable=False)
    group = families.disk_group_bytes(size)
    return fixed, own_trainable * group, group


def disk_room(module: nn.Module, config: Config, size: int, world: int, families: Families) -> int | None:
    """With Config.disk: the host bytes disk-backed chunks may hold (chunks/hostcache.py's Note on three tiers),
    or None when all model data fits host memory and no disk tier is needed."""
    if config.disk is None:
        return None
    fixed, spilled, group = tier_bytes(module, size, families, world)
    allowed, what = _host_allowed(config)
    if fixed + spilled <= allowed:
        return None
    least = fixed + MIN_DISK_GROUPS * group
    if not spilled or least > allowed:
        fixes = ["raise host_memory", "lower Config.chunk_size" if config.chunk_size else "shard over more ranks"]
        if config.dtype == "fp32":
            fixes.insert(1, "use dtype='bf16' (parameters and gradients take half, master weights go to disk)")
        raise MemoryBudgetError(
            f"with a disk tier, host memory still holds the parameter and gradient chunks ({fixed} bytes, "
            f"{gib(fixed)}) and the master and optimizer-state chunks of {MIN_DISK_GROUPS} groups at once "
            f"({MIN_DISK_GROUPS * group} bytes): {least} bytes ({gib(least)}), but {what}: {', '.join(fixes)}")
    return allowed - fixed


def _host_allowed(config: Config) -> tuple[int, str]:
    if config.host_memory is not None:
        return int(config.host_memory), f"Config.host_memory allows {config.host_memory}"
    memory = psutil.virtual_memory()
    spare = max(0, memory.available - reserve_bytes(memory.total))
    return spare, f"this machine can spare {spare} ({gib(spare)}; host_memory=None)"


def _check_working_set(module: nn.Module, config: Config, size: int, world: int, limit: int) -> int:
    """The most parameter chunk bytes pinned on the device at once; an error if `limit` cannot hold them.

    A module's chunks are pinned while it runs, and so are those of every module it runs inside
    (store.pinned_at_once). Under ZeRO a module computes on gathered copies: one own chunk at a time.
    """
    def pinned(elements: int) -> tuple[int, list[tuple[str, nn.Module]]]:  # chunks of `elements`, and where
        chunks, chain = pinned_chunks(module, elements)
        return (min(len(chunks), 1) if world > 1 else len(chunks)), chain
    chunk_bytes = size * config.torch_dtype.itemsize
    count, chain = pinned(size)
    need = count * chunk_bytes
    if need > limit:
        where = " inside ".join(name or "the model" for name, _ in reversed(chain))
        fix = f"raise device_memory above {need} (activations and temporaries need room beside them)"
        itemsize = config.torch_dtype.itemsize
        if config.chunk_size is None and world == 1:  # searched: the least budget over the sizes the search tries
            least, at = min((pinned(s)[0] * s * itemsize, s)
                            for s in chunk_size_candidates([(n, p.numel()) for n, p in module.named_parameters()]))
            if limit < least < need:
                fix = (f"raise device_memory to at least {least}, where chunks of {at} elements fit (activations and "
                       "temporaries need room beside them)")
        elif world == 1:  # the user's size: the smallest chunks may pin fewer bytes (or more: parameters may span two)
            smallest = max((p.numel() for p in module.parameters()), default=size)  # the smallest chunks can be
            least = pinned(smallest)[0] * smallest * itemsize if smallest < size else need
            if least < need:
                fix += (f", or set Config.chunk_size={smallest} (the largest parameter's elements), whose chunks take "
                        f"{least}") if least <= limit else (f" (above {least} with Config.chunk_size={smallest}, the "
                                                             "largest parameter's elements: chunks can be no smaller)")
        raise MemoryBudgetError(
            f"module {type(chain[-1][1]).__name__} ({where}) needs its parameter chunks and those of the modules "
            f"it runs inside on the device at once{_recomputed(chain, trained_modules(module))}: {count} chunks of "
            f"{chunk_bytes} bytes, {need} "
            f"bytes, but {_limit_source(config)} allows {limit}: {fix}")
    return need


def read_elsewhere(params: list[str], running: list[str], read: list[str], held: list[str], need: int, limit: int,
                   searched: int | None) -> str:
    """The MemoryBudgetError of a forward op that reads `params` outside their module, inside the modules `running`:
    their chunks (`read`) and those the running modules hold (`held`) need `need` bytes at once, more than the budget
    `limit`. prepare counts the chunks of a module and of the modules it runs inside, not those of parameters its
    forward reads elsewhere (Perceiver's and DeBERTa-v2's output layers read the word embeddings' weight beside their
    own bias), so it accepted that budget. `searched`: the chunk size prepare searched (None: the user's), which a
    larger budget may choose larger."""
    fix = f"raise Config.device_memory above {need}"
    if searched is not None:
        fix += f" with Config.chunk_size={searched}"
    return (f"{', '.join(params)}, read outside {'their modules' if len(params) > 1 else 'its module'} inside "
            f"{', '.join(running)}: chunks {', '.join(read)} and {', '.join(held)} are needed on the device at once, "
            f"{need} bytes, more than the budget of {limit}. prepare counts the chunks of a module and of the modules "
            f"it runs inside, not those of parameters its forward reads elsewhere: {fix} (activations need room beside "
            "them)")


def _recomputed(chain: list[tuple[str, nn.Module]], trained_ones: set[nn.Module]) -> str:
    """What activation checkpointing adds to the chunks pinned at once by the modules of `chain` (outermost first), of a
    model whose modules that train something (a frozen layer's too) are `trained_ones`."""
    trained = chain[-1][1] in trained_ones
    if recomputed_whole(chain[-1][1], trained):
        return (", its own modules' too: it is re-computed whole by non-reentrant activation checkpointing, whose "
                "backward holds them all (checkpointing with use_reentrant=True streams them)")
    if any(checkpointed(module, trained) for _, module in chain):
        return (", and those of the modules that call others in the layer around it: backward re-computes that layer "
                "under activation checkpointing, holding them meanwhile")
    return ""


def _check_host(config: Config, need: int, size: int) -> None:
    """The model data fits Config.host_memory and what the machine has available now."""
    allowed, available = config.host_memory, psutil.virtual_memory().available
    if allowed is not None and need > int(allowed):
        has, fixes = f"Config.host_memory allows {allowed}", ["raise host_memory"]
    elif need > available:
        has, fixes = f"this machine has {available} ({gib(available)}) available", []
    else:
        return
    fixes += ["use a lower-precision dtype", "shard it over more ranks"]
    if config.chunk_size is not None:
        fixes.append("lower Config.chunk_size (chunks are allocated whole)")
    raise MemoryBudgetError(f"model data needs {need} bytes ({gib(need)}) of host memory in chunks of {size} "
                            f"elements, {has}: {', '.join(fixes[:-1])}, or {fixes[-1]}")


def _limit_source(config: Config) -> str:
    return "Config.device_memory" if config.device_memory is not None else \
        "Config.device_memory=None: what is free on the device"


def device_total_bytes(device: torch.device) -> tuple[int, str]:
    """All the memory of the compute device, and what it is."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{torch.cuda.get_device_name(device)} ({device})"
    return psutil.virtual_memory().total, "the CPU simulation's device (this machine's RAM)"


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
