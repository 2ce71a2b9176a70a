"""How many bytes autograd holds for backward: the non-model data the CPU simulation can see.

Every saved tensor that is not a chunk view passes through `pack`; it is wrapped in a small holder
whose lifetime is autograd's, and its storage is counted once however many saved tensors share it.
On CUDA the allocator's own reading replaces this (see Runtime.nonmodel_bytes).
"""

from __future__ import annotations

import weakref

import torch


class Saved:
    """A saved activation; autograd keeps it, and frees it after the backward that used it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    def __init__(self) -> None:
        self.live = 0  # bytes of distinct storages held by saved tensors
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, holders]

    def wrap(self, tensor: torch.Tensor) -> Saved:
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
