"""The simulated device's memory: every tensor a GPU would hold on the device, placed by the caching allocator's
rules (allocator.py), so that the simulation runs out of memory where CUDA would.

The simulation computes on the CPU, so nothing tells a device tensor from a host one by its device. What is
device memory here is what chunkmem puts there (`SimulatedDevice.alloc`: chunk slots, transient buffers) and
everything computed from it: an op that reads a device tensor leaves its new tensors on the device, as it
would on a GPU (activations, temporaries, gradients, the optimizer's temporaries for groups updated on the
device). A copy to "cpu" (`.to("cpu", copy=True)`) is a download, and ops with no device input (factories,
the host optimizer) are the host's. Each device tensor's storage holds its block until it dies, as CUDA's
caching allocator hands memory back when the last tensor using it goes.

One model per process, as CUDA has one caching allocator per device and process, capped as CudaDevice caps
it: at the budgets of the live prepared models less what the process holds outside the allocator. The op
hook is a dispatch mode kept at the bottom of the mode stack, below any mode a test or user enters for a
while, so that their `with` blocks unwind around it. CHUNKMEM_SIM_MEMORY=0 leaves it out (memory is then
counted by saved activations only, as before the model: for timing host overhead alone).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from chunkmem.memory.allocator import Block, CachingAllocator, Sizes
from chunkmem.memory.gpu_memory import allocator_cap

_TO_COPY = torch.ops.aten._to_copy.default
# Ops a GPU runs across host and device: copies.
# Ops that may take a device tensor and a host one: copies, and `param.data = t`'s check of their types (under
# inference_mode it reaches the dispatcher), which reads no bytes.
_CROSSING = frozenset({_TO_COPY, torch.ops.aten.copy_.default, torch.ops.aten.copy.default,
                       torch.ops.aten._copy_from.default, torch.ops.aten._copy_from_and_resize.default,
                       torch.ops.aten._has_compatible_shallow_copy_type.default})


class SimulatedMemory:
    """The blocks the device tensors of this process hold; `allocator` places them."""

    def __init__(self, sizes: Sizes = Sizes(), capped: bool = True) -> None:
        self.allocator = CachingAllocator(sizes=sizes, settle=self._settle)
        # False: tensors are placed and ops that mix devices refused, but nothing caps the allocator nor reads it
        # (CHUNKMEM_SIM_MEMORY=places: budgets counted in bytes, as without the model)
        self.models_budget = capped
        self.blocks: dict[int, Block] = {}  # storage address -> its block
        self.host: set[int] = set()  # storage addresses of pinned host buffers (chunk payloads, staging)
        self._budgets: weakref.WeakKeyDictionary[object, tuple[int, int]] = weakref.WeakKeyDictionary()
        self.devices: weakref.WeakSet[Any] = weakref.WeakSet()  # simulated devices whose copies hold its blocks

    def _settle(self) -> None:
        for device in list(self.devices):
            device.settle()

    def charge(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s storage is device memory from now until it dies (torch.OutOfMemoryError if it cannot be)."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.blocks or storage.nbytes() == 0:
            return tensor
        block = self.allocator.malloc(storage.nbytes())
        self.blocks[address] = block
        weakref.finalize(storage, self._release, address, block)
        return tensor

    def mark_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` is pinned host memory until its storage dies: an op that mixes it with device tensors
        fails, as on a GPU (_Placing)."""
        address = tensor.untyped_storage().data_ptr()
        self.host.add(address)
        weakref.finalize(tensor.untyped_storage(), self.host.discard, address)
        return tensor

    def _release(self, address: int, block: Block) -> None:
        if self.blocks.get(address) is block:
            del self.blocks[address]
        self.allocator.free(block)

    def on_device(self, tensor: torch.Tensor) -> bool:
        try:
            return tensor.untyped_storage().data_ptr() in self.blocks
        except (RuntimeError, NotImplementedError):  # no storage (sparse, wrappers)
            return False

    def limit(self, owner: object, budget: int, outside: int) -> None:
        """Cap what the allocator may reserve at the live owners' budgets less what the process holds outside it
        (gpu_memory.allocator_cap: CudaDevice's cap)."""
        if not self.models_budget:
            return
        known = owner in self._budgets
        self._budgets[owner] = (budget, outside)
        self._apply()
        if not known:
            weakref.finalize(owner, self._apply)

    def capped(self) -> bool:
        return len(self._budgets) > 0

    def _apply(self) -> None:
        """The cap; lowered below what the allocator reserves, its wholly free segments go (as _apply_cap's on CUDA)."""
        budgets = list(self._budgets.values())
        self.allocator.allowed = allocator_cap(budgets) if budgets else None
        if self.allocator.allowed is not None and self.allocator.reserved > self.allocator.allowed:
            self.allocator.empty_cache()

    @property
    def reserved(self) -> int:
        return self.allocator.reserved


_memory: SimulatedMemory | None = None
_hook: TorchDispatchMode | None = None  # the op hook, at the bottom of the mode stack while it is in place


def simulated_memory() -> SimulatedMemory | None:
    """This process's simulated device memory, with its op hook in place. CHUNKMEM_SIM_MEMORY: unset or "cuda",
    CUDA's sizes; "scale:D", sizes divided by D (Sizes.scaled); "places", device tensors placed and ops that mix
    devices refused, the allocator neither capped nor read (budgets then count bytes); "0", not modelled (None)."""
    setting = os.environ.get("CHUNKMEM_SIM_MEMORY", "cuda")
    if setting == "0":
        return None
    if _memory is None and setting == "places":
        use_simulated_memory(capped=False)
    if _memory is None:
        kind, _, divisor = setting.partition(":")
        try:
            sizes = Sizes() if setting == "cuda" else Sizes.scaled(float(divisor)) if kind == "scale" else None
        except ValueError:
            sizes = None
        if sizes is None:
            raise ValueError(f"CHUNKMEM_SIM_MEMORY={setting!r}: expected 'cuda', 'scale:D' (D a number), 'places' "
                             "or '0'")
        use_simulated_memory(sizes)
    return _memory


def use_simulated_memory(sizes: Sizes = Sizes(), capped: bool = True) -> SimulatedMemory:
    """Start this process's simulated device memory afresh, with the allocator's `sizes` (for tests: devices made
    from now on use it; tensors charged to the one before stay charged there)."""
    global _memory, _hook
    _memory = SimulatedMemory(sizes, capped)
    if _hook is None:
        _hook = _Placing()
        _restack(lambda modes: [_hook, *modes])
    return _memory


def stop_simulated_memory() -> None:
    """No simulated device memory from now on, and no op hook (for tests: devices made before keep theirs)."""
    global _memory, _hook
    hook, _memory, _hook = _hook, None, None
    if hook is not None:  # brought to the top, it exits as a `with` would
        _restack(lambda modes: [*(m for m in modes if m is not hook), hook])
        hook.__exit__(None, None, None)


def moving_versions(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)` from a dispatch mode, with the version counters of the tensors an in-place foreach op
    changed moved, as outside one. Under any dispatch mode torch 2.13 leaves them as they were (a plain call moves
    them): a change made through `torch._foreach_mul_` (torch's clip_grad_norm_, foreach optimizers) would go unseen
    in the simulation where CUDA sees it (an update made ahead adopted over gradients that clipping scaled). Moved
    twice under two modes, they still tell a change; autograd compares them for equality only."""
    out = func(*args, **kwargs)
    if func.__name__.startswith("_foreach_") and func._schema.arguments[0].alias_info is not None:
        torch.autograd.graph.increment_version(args[0])
    return out


class _Placing(TorchDispatchMode):
    """Charges the new tensors of every op that reads a device tensor (the module's docstring), and refuses an
    op that mixes device tensors with pinned host ones, as a GPU does."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        memory = _memory
        if memory is None or not memory.blocks:
            return moving_versions(func, args, kwargs)
        blocks = memory.blocks
        inputs = _storages(args, kwargs)
        if not any(address in blocks for address in inputs):
            return moving_versions(func, args, kwargs)
        if memory.host and not inputs.isdisjoint(memory.host) and func not in _CROSSING:
            _refuse_mixed(func, args, kwargs, memory.host, blocks)
        out = moving_versions(func, args, kwargs)
        if func is _TO_COPY and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            return out  # a download: host memory on a GPU
        for tensor in _tensors(out):
            address = _address(tensor)
            if address is not None and address not in blocks and address not in inputs:
                memory.charge(tensor)
        return out


def _refuse_mixed(func: Any, args: tuple, kwargs: dict, host: set[int], blocks: dict[int, Block]) -> None:
    """CUDA's error for an op given a device tensor and a host tensor, both of one or more dimensions. Scalars
    pass: a 0-dim CPU tensor is a scalar to a GPU op, and a 0-dim device tensor moved to the host by `.to("cpu")`
    is still a device tensor here, where that move does nothing. A foreach op's lists may hold tensors of several
    devices (torch groups them by device), but not at one index: the ops torch falls back to for those raise
    (`torch._foreach_lerp_([device], [host], w)`, an EMA of timm's, passed here)."""
    if func.__name__.startswith("_foreach_"):
        if func.__name__.startswith("_foreach_copy"):  # a copy crosses devices, each one as `copy_` does
            return
        lists = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, (list, tuple)) and _tensors(arg)]
        for column in zip(*lists):
            _refuse_among(func, [t for t in column if isinstance(t, torch.Tensor) and t.dim() > 0], host, blocks)
        return
    _refuse_among(func, [t for arg in (*args, *kwargs.values()) for t in _tensors(arg) if t.dim() > 0], host, blocks)


def _refuse_among(func: Any, tensors: list[torch.Tensor], host: set[int], blocks: dict[int, Block]) -> None:
    """`_refuse_mixed`'s for the tensors one op computes on together."""
    if not any(_address(t) in blocks for t in tensors):
        return
    for tensor in tensors:
        if _address(tensor) in host:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                f"({func.__name__} was given a host tensor of shape {tuple(tensor.shape)} beside device tensors: "
                "chunkmem's simulation of a GPU. A parameter whose chunk is off the device is a host tensor; copy "
                "it to the device first, with `.to(model.device, copy=True)`: the simulated device is the CPU, so "
                "`.to(model.device)` alone moves nothing here, where it copies on a GPU; or read it inside forward)")


def _restack(change: Callable[[list[TorchDispatchMode]], list[TorchDispatchMode]]) -> None:
    """Rebuild the mode stack as `change(modes)` (bottom first), entering a mode new to it: modes entered by `with`
    above the hook exit above it, as they entered."""
    modes = [_pop_mode() for _ in range(len(_get_current_dispatch_mode_stack()))][::-1]
    for mode in change(modes):
        if mode in modes:
            _push_mode(mode)
        else:
            mode.__enter__()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _address(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _storages(args: tuple, kwargs: dict) -> set[int]:
    """Storage addresses of the tensors among an op's arguments (and in its list arguments)."""
    found = set()
    for arg in (*args, *kwargs.values()):
        for tensor in _tensors(arg):
            address = _address(tensor)
            if address is not None:
                found.add(address)
    return found
