"""The process group chunkmem shards over, and what every rank must decide alike before using it.

`default_group` finds (or, under torchrun, creates) the group; `agree` makes a number the same on
every rank; `single_tensor_collectives` probes the backend once; `Order` keeps the order gathers
follow (shards' Note on overlap). The collectives themselves are the single-tensor all-gather and
reduce-scatter, under their current names.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("chunkmem")

# torch >= 2.8 names the single-tensor collectives *_single and deprecates *_into_tensor / *_tensor.
ALL_GATHER: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
Key = tuple[bool, int]  # a communication group of chunks: (trainable, group index)


@dataclasses.dataclass
class Flight:
    """A collective issued async: its token, and the tensor that holds the result once waited for."""

    work: object  # the device's token (device.py's Note on tokens)
    result: torch.Tensor
    ahead: bool = False  # a gather issued ahead of need (the placer has not seen its chunk's access yet)


def backend_for(device: str) -> str:
    """The process-group backend for a Config.device: NCCL for CUDA, gloo for the CPU simulation (whose
    tensors NCCL cannot carry, even on a machine that has GPUs)."""
    return "nccl" if device.startswith("cuda") else "gloo"


def default_group(group: object, device: str) -> object | None:
    """The process group to shard over: the given one, the default one, or one torchrun's env describes,
    with the backend `device` needs."""
    if group is not None:
        return group
    if not dist.is_available():
        return None
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
        backend = backend_for(device)
        timeout = datetime.timedelta(seconds=float(os.environ.get("CHUNKMEM_TIMEOUT", "600")))
        dist.init_process_group(backend, timeout=timeout)
        # The group is chunkmem's to end: left to interpreter teardown, gloo is destroyed after the objects
        # that still refer to it and aborts the process ("terminate called without an active exception").
        atexit.register(_destroy_at_exit)
        log.info("initialised a %s process group of %d ranks from the environment", backend, dist.get_world_size())
    return dist.group.WORLD if dist.is_initialized() else None


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(values: list[int], group: Any, device: torch.device) -> list[int]:
    """The least of each value over the ranks of `group`: what every rank then decides from."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in tensor.tolist()]


def single_tensor_collectives(group: Any, device: torch.device) -> bool:
    """Whether the backend has the single-tensor all-gather and reduce-scatter (older gloo lacks them).

    Decided once, before training, the same on every rank: switching mid-run on the rank that saw
    an error would leave the ranks' collectives out of step.
    """
    if dist.get_backend(group) == "nccl":
        return True
    world = dist.get_world_size(group)
    try:
        ALL_GATHER(torch.zeros(world, device=device), torch.zeros(1, device=device), group=group)
        REDUCE_SCATTER(torch.zeros(1, device=device), torch.zeros(world, device=device), group=group)
        supported = 1
    except (RuntimeError, NotImplementedError, ValueError):
        supported = 0
    return bool(agree([supported], group, device)[0])


class Order:
    """The order in which a step gathers groups: recorded in one step, followed in the next.

    A group gathered again right after itself counts once. Once a step leaves the recorded order it
    is followed no further; each step's order is what the next one follows.
    """

    def __init__(self) -> None:
        self.recorded: list[Key] = []
        self.now: list[Key] = []
        self.on_path = False  # the first step has nothing to follow

    def seen(self, key: Key) -> Key | None:
        """Note a gather; the group expected next, while this step follows the recorded order."""
        if not self.now or self.now[-1] != key:
            at = len(self.now)
            self.now.append(key)
            self.on_path = self.on_path and at < len(self.recorded) and self.recorded[at] == key
        at = len(self.now)
        return self.recorded[at] if self.on_path and at < len(self.recorded) else None

    def step_done(self) -> None:
        self.recorded, self.now, self.on_path = self.now, [], True
