"""Chunk families, declared once: what each family holds, its dtype, its tier, and how its chunks are named.

[Note: families]
Chunk group `i` of a store is chunk `i` of every family (store.py). Which families there are is decided
before the store is built, in one `Families` declaration: the parameters' values, their gradients, the fp32
master copy (when the parameters are not fp32), the optimizer's states, and any other version of the
parameters (PipeDream-2BW's older weights). The store makes every chunk from it, the placer reads the roles
from it, the budget checks count bytes from it, and a move names its chunk's family from the chunk itself.
So a new family (low-precision optimizer states, say) is one more entry here: nothing parses a chunk's name
and nothing is rebuilt after the store exists. Several models prepared under one Manager share one store,
so one declaration and one numbering: two models' chunks never share a name.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import torch

from chunkmem.memory.disk import aligned


class Role(enum.Enum):
    PARAM = "param"  # the values compute reads (the only family of frozen groups)
    GRAD = "grad"  # the parameters' gradients, in the parameters' dtype
    MASTER = "master"  # the fp32 copy the optimizer updates (none when the parameters are fp32)
    STATE = "state"  # an optimizer state, fp32, read and written by every update
    VERSION = "version"  # another version of the parameters: same layout and dtype, saved, never stepped


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # the chunk names' stem ("exp_avg" -> "exp_avg.3") and the checkpoint's key
    role: Role
    dtype: torch.dtype
    disk_backed: bool = False  # on the disk tier when there is one: chunks only the optimizer touches
    lends: bool = False  # may take autograd's tensors by reference (chunk's Note on lent ranges)

    def chunk_name(self, index: int, trainable: bool = True) -> str:
        return f"{self.name}.{index}" if trainable else f"frozen_{self.name}.{index}"


@dataclasses.dataclass(frozen=True)
class Families:
    """Every family of one store, in the order a group's chunks are made."""

    trained: tuple[Family, ...]  # the chunks of a trainable group
    frozen: tuple[Family, ...]  # the chunks of a frozen group

    @classmethod
    def declare(cls, dtype: torch.dtype, states: Iterable[str] = (), versions: Iterable[str] = ()) -> Families:
        """The families of parameters in `dtype` trained by an optimizer keeping `states`, plus other versions of
        the parameters named `versions`."""
        param = Family("param", Role.PARAM, dtype)
        trained = [param, Family("grad", Role.GRAD, dtype, lends=True)]
        if dtype != torch.float32:
            trained.append(Family("master", Role.MASTER, torch.float32, disk_backed=True))
        trained += [Family(name, Role.STATE, torch.float32, disk_backed=True) for name in states]
        trained += [Family(name, Role.VERSION, dtype) for name in versions]
        names = [f.name for f in trained]
        if len(set(names)) != len(names):
            raise ValueError(f"chunk families {names}: each name must be declared once")
        return cls(tuple(trained), (param,))

    def named(self, *roles: Role) -> tuple[str, ...]:
        """The names of the trained families of `roles`, in declaration order."""
        return tuple(f.name for f in self.trained if f.role in roles)

    @property
    def saved(self) -> tuple[str, ...]:
        """The families a checkpoint saves beside the parameters' values: optimizer states and other versions."""
        return self.named(Role.STATE, Role.VERSION)

    @property
    def dtype(self) -> torch.dtype:
        return self.frozen[0].dtype

    def group_bytes(self, numel: int, trainable: bool = True, disk_backed: bool | None = None) -> int:
        """The bytes of one group's chunks of `numel` elements each (only the disk-backed ones, or only the others,
        when `disk_backed` says)."""
        return numel * sum(f.dtype.itemsize for f in (self.trained if trainable else self.frozen)
                           if disk_backed is None or f.disk_backed == disk_backed)

    def disk_group_bytes(self, numel: int) -> int:
        """The bytes of a trainable group's disk-backed chunks, each rounded up to the disk's alignment."""
        return sum(aligned(numel * f.dtype.itemsize) for f in self.trained if f.disk_backed)
