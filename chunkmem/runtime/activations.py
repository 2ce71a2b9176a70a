"""Activations autograd saves for backward: counted, and optionally kept in host memory.

Every saved tensor that is not a chunk view passes through `wrap`; it is held by a small object
whose lifetime is autograd's, and its storage is counted once however many saved tensors share it:
the non-model data the CPU simulation can see (on CUDA the allocator's reading replaces it, see
Runtime.nonmodel_bytes). With offloading on, saved tensors of at least MIN_OFFLOAD_BYTES go to host
memory when saved and come back when backward (or recomputation under activation checkpointing,
whose only saved tensors are the segment boundaries) needs them.

[Note: no Python code when a saved tensor dies]
Autograd drops saved tensors wherever the garbage collector runs, and a signal handler runs at
the next Python instruction: had the release been a Python callback (weakref.finalize), a Ctrl-C
landing in it would be printed as "Exception ignored" and training would go on. So a dying `Saved`
only appends its weak reference to a deque (a C call, no bytecode, so no signal handler runs in
it), and the books are settled the next time the meter is read or wraps a tensor.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

import torch

MIN_OFFLOAD_BYTES = 4096  # smaller tensors cost more in copies than they free


class Saved:
    """A saved activation; autograd keeps it, and frees it after the backward that used it."""

    __slots__ = ("tensor", "device", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, device: torch.device | None = None, version: int = 0) -> None:
        self.tensor = tensor  # on the device, or on the host when `device` says where it goes back
        self.device = device
        self.version = version  # the tensor's version counter when saved (not offloaded: `device` None)

    def get(self, meter: ActivationMeter) -> torch.Tensor:
        if self.device is None:
            return unchanged(self.tensor, self.version)
        meter.offload_bytes += self.tensor.nbytes
        return meter.device_like(self.tensor, self.device).copy_(self.tensor, non_blocking=True)


def unchanged(tensor: torch.Tensor, version: int) -> torch.Tensor:
    """`tensor`, saved for backward at `version`, unless changed in place since: then the error autograd gives for a
    tensor it saved itself (it checks none that saved-tensor hooks keep, as chunkmem's do), as plain PyTorch would."""
    if tensor._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; "
                           f"expected version {version} instead (it was changed in place after the forward saved it)")
    return tensor


class ActivationMeter:
    def __init__(self, offload: bool = False, host_alloc: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device_alloc: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None) -> None:
        self._live = 0  # bytes of distinct device storages held by saved tensors
        self.peak = 0
        self.offload = offload
        self.offload_bytes = 0  # both ways
        self._host_alloc = host_alloc or (lambda t: torch.empty_like(t, device="cpu"))
        # Room on the device for an offloaded activation coming back (the device's own: a simulated device's is device
        # memory, where torch's `.to` of a CPU "device" would hand back the host buffer itself)
        self.device_like = device_alloc or (lambda t, device: torch.empty_like(t, device=device))
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, holders]
        # id(weakref to a Saved) -> (that weakref, kept alive so its callback fires; the data_ptr it holds)
        self._holders: dict[int, tuple[weakref.ref[Saved], int]] = {}
        self._dead: collections.deque[weakref.ref[Saved]] = collections.deque()  # see the Note above

    @property
    def live(self) -> int:
        """Bytes of distinct device storages held by saved tensors now."""
        if self._dead:
            self._settle()
        return self._live

    def wrap(self, tensor: torch.Tensor, storage: torch.UntypedStorage | None = None) -> Saved:
        """Hold a saved tensor, counting its storage (`storage`, when the caller has it already)."""
        if self.offload and tensor.nbytes >= MIN_OFFLOAD_BYTES and tensor.is_contiguous():
            host = self._host_alloc(tensor)
            host.copy_(tensor, non_blocking=True)
            self.offload_bytes += tensor.nbytes
            return Saved(host, tensor.device)
        saved = Saved(tensor.detach(), version=tensor._version)  # not the tensor itself: Runtime.pack says why
        if storage is None:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return saved
        self._settle()  # a storage freed since may have been reused at this address
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [storage.nbytes(), 0]
            self._live += entry[0]
            self.peak = max(self.peak, self._live)
        entry[1] += 1
        ref = weakref.ref(saved, self._dead.append)
        self._holders[id(ref)] = (ref, key)
        return saved

    def _settle(self) -> None:
        """Release the storages of saved tensors that died since the last call."""
        while self._dead:
            _, key = self._holders.pop(id(self._dead.popleft()))
            entry = self._storages[key]
            entry[1] -= 1
            if entry[1] == 0:
                self._live -= entry[0]
                del self._storages[key]
