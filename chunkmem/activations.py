"""Activations autograd saves for backward: counted, and optionally kept in host memory.

Every saved tensor that is not a chunk view passes through `wrap`; it is held by a small object
whose lifetime is autograd's, and its storage is counted once however many saved tensors share it:
the non-model data the CPU simulation can see (on CUDA the allocator's reading replaces it, see
Runtime.nonmodel_bytes). With offloading on, saved tensors of at least MIN_OFFLOAD_BYTES go to host
memory when saved and come back when backward (or recomputation under activation checkpointing,
whose only saved tensors are the segment boundaries) needs them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


MIN_OFFLOAD_BYTES = 4096  # smaller tensors cost more in copies than they free


class Saved:
    """A saved activation; autograd keeps it, and frees it after the backward that used it."""

    __slots__ = ("tensor", "device", "__weakref__")

    def __init__(self, tensor: torch.Tensor, device: torch.device | None = None) -> None:
        self.tensor = tensor  # on the device, or on the host when `device` says where it goes back
        self.device = device

    def get(self, meter: ActivationMeter) -> torch.Tensor:
        if self.device is None:
            return self.tensor
        meter.offload_bytes += self.tensor.nbytes
        return self.tensor.to(self.device, non_blocking=True)


class ActivationMeter:
    def __init__(self, offload: bool = False, host_alloc: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.live = 0  # bytes of distinct device storages held by saved tensors
        self.peak = 0
        self.offload = offload
        self.offload_bytes = 0  # both ways
        self._host_alloc = host_alloc or (lambda t: torch.empty_like(t, device="cpu"))
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, holders]

    def wrap(self, tensor: torch.Tensor) -> Saved:
        if self.offload and tensor.nbytes >= MIN_OFFLOAD_BYTES and tensor.is_contiguous():
            host = self._host_alloc(tensor)
            host.copy_(tensor, non_blocking=True)
            self.offload_bytes += tensor.nbytes
            return Saved(host, tensor.device)
        saved = Saved(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return saved
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [storage.nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[key]
