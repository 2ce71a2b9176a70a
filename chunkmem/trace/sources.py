"""Where the numbers of a moment come from: a chunk runtime (exact), or a plain model (observer mode).

A source answers three questions at any moment: model data by kind on device and host, non-model
bytes on the device, and which chunks are resident. With a chunk runtime the answers are the
runtime's own books (`ModelData.model_bytes`, its activation meter), so a trace agrees with
`memory_stats()` to the byte. On a plain model they are read off the tensors the model and the
optimizer hold; the compute device is the one the parameters are on (the CPU for a CPU run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from chunkmem.trace.schema import MODEL_KINDS

Sides = dict[str, dict[str, int]]  # {"device": {kind: bytes}, "host": {kind: bytes}}
_STATE_KINDS = {"exp_avg", "exp_avg_sq", "momentum_buffer"}


class Source(Protocol):
    kind: str  # "chunks" | "observer"
    torch_device: torch.device

    def model_bytes(self) -> Sides: ...
    def nonmodel_device(self) -> int: ...
    def resident(self) -> list[str] | None: ...
    def layout(self) -> dict[str, Any]: ...
    def pinned_bytes(self) -> int | None:
        """Host bytes chunkmem itself keeps page-locked, or None when it keeps none (observer mode)."""
        ...


class ChunkSource:
    """A prepared model's runtime: categories are its chunk families, counted from its chunks."""

    kind = "chunks"

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.torch_device = runtime.device.torch_device
        # Issue 3 adds `Runtime.activation_bytes()`; until then the simulation's reading is the meter.
        self._activations: Callable[[], int] = getattr(runtime, "activation_bytes", None) or runtime.nonmodel_bytes

    def model_bytes(self) -> Sides:
        return self.runtime.data.model_bytes()

    def nonmodel_device(self) -> int:
        return int(self._activations())

    def resident(self) -> list[str]:
        return sorted(self.runtime.residency.resident)

    def pinned_bytes(self) -> int:
        return int(self.runtime.device.host_pool.stats()["host_pinned_bytes"])

    def layout(self) -> dict[str, Any]:
        store = self.runtime.store
        chunks = []
        for group in store.groups:
            for family, chunk in group.chunks.items():
                chunks.append({"name": chunk.name, "kind": family, "group": group.index, "trainable": group.trainable,
                               "numel": chunk.numel, "dtype": str(chunk.dtype).removeprefix("torch."),
                               "bytes": chunk.nbytes,
                               "members": [{"name": r.name, "offset": r.slot.offset, "numel": r.slot.numel}
                                           for r in group.members]})
        return {"chunk_size": store.chunk_size, "world": store.world, "rank": store.rank, "chunks": chunks,
                "device_limit_bytes": self.runtime.limit}


class PlainSource:
    """A plain PyTorch model and (once known) its optimizer: model data found from their tensors.

    Each storage is counted once (tied weights, views). Optimizer state tensors are classed by their
    key; anything else the optimizer keeps (Adam's `step`, `max_exp_avg_sq`) is "optim_other".
    `activation_bytes` reads the observer's own saved-tensor meter (CPU runs; on CUDA the allocator
    reading is used instead).
    """

    kind = "observer"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 activation_bytes: Callable[[], int]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.activation_bytes = activation_bytes
        first = next(model.parameters(), None)
        self.torch_device = first.device if first is not None else torch.device("cpu")

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for param in self.model.parameters():
            out.append(("param", param))
            if param.grad is not None:
                out.append(("grad", param.grad))
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        out.append((key if key in _STATE_KINDS else "optim_other", value))
        return out

    def model_bytes(self) -> Sides:
        sides: Sides = {"device": {}, "host": {}}
        seen: set[tuple[str, int]] = set()
        for kind, tensor in self._tensors():
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key in seen or tensor.device.type == "meta":
                continue
            seen.add(key)
            side = "device" if tensor.device == self.torch_device else "host"
            sides[side][kind] = sides[side].get(kind, 0) + storage.nbytes()
        return sides

    def nonmodel_device(self) -> int:
        if self.torch_device.type == "cuda":
            model = sum(self.model_bytes()["device"].values())
            return max(0, torch.cuda.memory_allocated(self.torch_device) - model)
        return self.activation_bytes()

    def pinned_bytes(self) -> None:
        return None

    def resident(self) -> None:
        return None

    def layout(self) -> dict[str, Any]:
        tensors = [{"name": n, "numel": p.numel(), "dtype": str(p.dtype).removeprefix("torch."),
                    "bytes": p.numel() * p.element_size(), "trainable": p.requires_grad}
                   for n, p in self.model.named_parameters()]
        return {"chunk_size": None, "chunks": [], "tensors": tensors}


def host_readings(torch_device: torch.device) -> dict[str, int]:
    """Process-wide host figures: resident set size and PyTorch's pinned host allocator."""
    import psutil

    out = {"rss": psutil.Process().memory_info().rss}
    if torch_device.type == "cuda":
        try:
            stats = torch.cuda.host_memory_stats()
            out["pinned_torch"] = int(stats.get("allocated_bytes.current", stats.get("allocated_bytes", 0)))
        except (AttributeError, RuntimeError):  # older torch: no host allocator statistics
            pass
    return out


def kinds_of(sides: Sides) -> Sides:
    """Map unknown families onto the chart's categories (any other optimizer state -> optim_other)."""
    return {side: _fold(values) for side, values in sides.items()}


def _fold(values: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, nbytes in values.items():
        name = kind if kind in MODEL_KINDS else "optim_other"
        out[name] = out.get(name, 0) + nbytes
    return out
