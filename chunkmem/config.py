"""User-facing configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch's names: torch loads when first needed
# One default for Config, `chunkmem finetune` and `chunkmem plan`: a plan must describe the run it plans.
DEFAULT_DTYPE = "fp32"
DEVICE_PATTERN = r"cpu|cuda(:\d+)?"


def parse_size(field: str, value: int | str | None) -> int | None:
    """Turn 1024, "512MiB", "20GiB" or "20GB" into bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"Config.{field}={value!r}: expected an int of bytes or a string like '20GiB'")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"Config.{field}={value!r}: expected a size like 1024, '512MiB', '20GiB' or '20GB'")
        given, value = value, int(float(match.group(1)) * _UNITS[unit])
        if value <= 0:
            raise ValueError(f"Config.{field}={given!r}: a size must be at least one byte")
    if value <= 0:
        raise ValueError(f"Config.{field}={value!r}: a size must be positive")
    return value


def default_device() -> str:
    """$CHUNKMEM_DEVICE when set (the test suite sets "cpu", so that its tests judge the simulation on a GPU
    machine too), else "cuda" where CUDA is available, else "cpu"."""
    chosen = os.environ.get("CHUNKMEM_DEVICE")
    if chosen:
        if not re.fullmatch(DEVICE_PATTERN, chosen):
            raise ValueError(f"CHUNKMEM_DEVICE={chosen!r}: expected 'cuda', 'cuda:N' or 'cpu', or unset it")
        return chosen
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Config:
    """How chunkmem places model data. See SPEC section 3.

    device: "cuda", "cuda:N" or "cpu" (the CPU simulation of a device with a budget); default: see
        default_device.
    device_memory: most bytes the process may hold on the device: chunks, activations and the rest of what
        PyTorch allocates, and on CUDA what the process holds outside PyTorch's allocator too (the CUDA
        context and libraries, about 0.6-0.85 GiB on an H100: chunkmem/memory/gpu_memory.py's Note on
        the budget); None means all that is free.
    host_memory: most bytes of chunks in host memory; None means what the machine can spare.
    dtype: "fp32" | "bf16" | "fp16", the dtype of parameters and gradients during compute.
    chunk_size: elements per chunk; None searches the size that wastes least.
    offload_activations: keep tensors autograd saves for backward in host memory until backward
        needs them (with activation checkpointing these are the segment boundaries).
    native_optimizer: update host-resident chunks with the native kernel (csrc/cpu_optim.cpp: one
        pass, casts folded in) instead of torch.optim's functions. Faster in mixed precision, within
        1e-6 of torch.optim rather than bit-identical to it; falls back to torch.optim, with one
        warning, when the kernel cannot be built. None (the default): on with CUDA, where chunks
        updated on the host and on the device already differ in the last bits; off in the CPU
        simulation, whose results stay bit-identical to torch.optim whatever the budget.
    overlap_update: with the native kernel and Adam/AdamW, update each host-resident chunk group on a
        worker thread as soon as backward has written its gradients, into spare host buffers that
        step() adopts when nothing the update read has changed since (clipping, a new learning rate
        or an fp16 overflow make step() update it again): the same bits, the host update overlapping
        backward (chunkmem/runtime/ahead.py). Costs 16 bytes of host memory per parameter updated
        there. Off by default: not yet measured on a GPU.
    gather_units: under ZeRO, names of module classes whose whole subtree is gathered when they start
        (chunkmem/zero/units.py, Note on units): modules that choose which children run by the data.
        Experts of a mixture of experts are found without it.
    disk: a directory for the disk tier: when the model data would exceed host_memory, fp32 master
        weights and optimizer states live in a file there and stream through host memory for the
        optimizer (chunkmem/memory/disk.py). None: no disk tier.
    disk_memory: most bytes of the disk tier's file; None means what is free on that file system.
    """

    device: str = dataclasses.field(default_factory=default_device)
    device_memory: int | str | None = None
    host_memory: int | str | None = None
    dtype: str = DEFAULT_DTYPE
    chunk_size: int | None = None
    offload_activations: bool = False
    native_optimizer: bool | None = None
    overlap_update: bool = False
    gather_units: tuple[str, ...] = ()
    disk: str | os.PathLike | None = None
    disk_memory: int | str | None = None

    def __post_init__(self) -> None:
        import torch

        if not isinstance(self.device, str) or not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ValueError(f"Config.device={self.device!r}: expected 'cuda', 'cuda:N' or 'cpu'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"Config.device={self.device!r} but CUDA is not available: "
                             "use device='cpu' for the CPU simulation")
        count = torch.cuda.device_count() if self.device.startswith("cuda:") else 0
        if count and int(self.device.removeprefix("cuda:")) >= count:
            raise ValueError(f"Config.device={self.device!r} but this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
        object.__setattr__(self, "device_memory", parse_size("device_memory", self.device_memory))
        object.__setattr__(self, "host_memory", parse_size("host_memory", self.host_memory))
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise ValueError(f"Config.dtype={self.dtype!r}: expected one of {sorted(_DTYPES)}")
        if self.chunk_size is not None and (
                isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(f"Config.chunk_size={self.chunk_size!r}: expected a positive int of elements or None")
        if not isinstance(self.offload_activations, bool):
            raise ValueError(f"Config.offload_activations={self.offload_activations!r}: expected True or False")
        if self.native_optimizer is not None and not isinstance(self.native_optimizer, bool):
            raise ValueError(f"Config.native_optimizer={self.native_optimizer!r}: expected True, False or None (auto)")
        if not isinstance(self.overlap_update, bool):
            raise ValueError(f"Config.overlap_update={self.overlap_update!r}: expected True or False")
        if self.overlap_update and self.native_optimizer is False:
            raise ValueError("Config.overlap_update=True needs the native optimizer, which native_optimizer=False "
                             "turns off: set native_optimizer=True (or None on CUDA), or overlap_update=False")
        if isinstance(self.gather_units, str) or not isinstance(self.gather_units, (tuple, list)) or \
                not all(isinstance(name, str) and name for name in self.gather_units):
            raise ValueError(f"Config.gather_units={self.gather_units!r}: expected a tuple of module class names, "
                             "e.g. ('SwitchTransformersSparseMLP',)")
        object.__setattr__(self, "gather_units", tuple(self.gather_units))
        self._check_disk()

    def _check_disk(self) -> None:
        if self.disk is not None and (not isinstance(self.disk, (str, os.PathLike)) or not os.fspath(self.disk)):
            raise ValueError(f"Config.disk={self.disk!r}: expected a directory path (str or os.PathLike) or None")
        if self.disk is not None:
            object.__setattr__(self, "disk", os.fspath(self.disk))
        object.__setattr__(self, "disk_memory", parse_size("disk_memory", self.disk_memory))
        if self.disk_memory is not None and self.disk is None:
            raise ValueError(f"Config.disk_memory={self.disk_memory!r} but Config.disk is None: give disk a "
                             "directory for the disk tier, or drop disk_memory")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    @property
    def uses_native_optimizer(self) -> bool:
        """native_optimizer, with None resolved: on with CUDA, off in the simulation."""
        return self.device != "cpu" if self.native_optimizer is None else self.native_optimizer
