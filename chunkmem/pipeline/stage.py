"""A rank's layers and the stages that run them, micro-batches of any size, and the shapes between stages.

[Note: padded micro-batches]
torch.distributed.pipelining allocates one receive buffer per micro-batch from one shape, so all
micro-batches must have the same number of rows. A batch of B rows split into M micro-batches has
sizes differing by one (torch.tensor_split), so each is padded with zero rows to the largest size;
the loss sees only the real rows (`Microbatches.loss`), so padded rows get zero gradient and add
nothing to parameter gradients. This assumes rows do not interact inside the model (no BatchNorm
over the batch), as micro-batching itself does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from chunkmem.wrapper import ChunkedModel

CHECKPOINT_MODES = ("always", "except_last", "never")


class StageBody(nn.Sequential):
    """The layers of the user's model this rank runs (of one stage, or of its virtual stages), with the
    user's names, so that the prepared model's state dict keys match. `Part`s run them."""


class Part(nn.Module):
    """One stage: consecutive layers of a rank's prepared body, run inside the prepared model's hooks
    (what `ChunkedModel.forward` does for a whole model), on inputs cast to the compute device and dtype.

    Activation checkpointing is chosen per micro-batch: "always", "except_last" (the last
    micro-batch's backward follows its forward at once under GPipe, so re-computing it saves
    nothing) or "never". Forwards with gradients run in micro-batch order under every schedule
    here, so counting them tells which micro-batch is running. `saved` are saved-tensor hooks to run
    inside the runtime's (2BW's weight versions: versions.py).
    """

    def __init__(self, model: ChunkedModel, names: Sequence[str], checkpoint_mode: str = "never") -> None:
        super().__init__()
        body = model.module
        self.layers = nn.Sequential(OrderedDict((name, body.get_submodule(name)) for name in names))
        self.hooks = model.hooks  # the prepared model is not a submodule: its parameters are these layers'
        self.runtime = model.runtime
        self.checkpoint_mode = checkpoint_mode
        self.n_microbatches = 1
        self.forwards = 0  # gradient-enabled forwards since `start_step`
        self.saved: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None

    def start_step(self, n_microbatches: int) -> None:
        self.n_microbatches, self.forwards = n_microbatches, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.runtime.config.torch_dtype if x.is_floating_point() else x.dtype
        x = x.to(self.runtime.device.torch_device, dtype)
        with self.hooks.forward(), _saved_tensors(self.saved):
            if not torch.is_grad_enabled():
                return self.layers(x)
            index, self.forwards = self.forwards, self.forwards + 1
            mode = self.checkpoint_mode
            if mode == "always" or (mode == "except_last" and index < self.n_microbatches - 1):
                return checkpoint(self.layers, x, use_reentrant=False)  # runs whole: see hooks.Hooks.forward
            return self.layers(x)


def _saved_tensors(hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None
                   ) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if hooks is None else torch.autograd.graph.saved_tensors_hooks(*hooks)


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The named layers a model is split between: an nn.Sequential's (or nn.ModuleList's) children."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList)):
        raise TypeError(f"chunkmem.pipeline splits an nn.Sequential (or nn.ModuleList) into stages, got "
                        f"{type(model).__name__}: express the model as nn.Sequential(embedding, *blocks, head)")
    return list(model.named_children())


@dataclasses.dataclass(frozen=True)
class Microbatches:
    """How a batch of `batch` rows is cut into `count` micro-batches, padded to `rows` each."""

    batch: int
    count: int

    def __post_init__(self) -> None:
        if self.batch < self.count:
            raise ValueError(f"a batch of {self.batch} rows cannot be split into n_microbatches={self.count}: "
                             f"pass at least {self.count} rows or use fewer micro-batches")

    @property
    def sizes(self) -> list[int]:
        return [self.batch // self.count + (1 if i < self.batch % self.count else 0) for i in range(self.count)]

    @property
    def rows(self) -> int:
        return self.sizes[0]

    def pad(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` ([batch, ...]) as [count * rows, ...], each micro-batch padded with zero rows."""
        if tensor.size(0) != self.batch:
            raise ValueError(f"expected {self.batch} rows (the batch size), got a tensor of shape {tuple(tensor.shape)}")
        parts = []
        for part in torch.split(tensor, self.sizes):
            parts.append(part)
            if part.size(0) < self.rows:
                parts.append(part.new_zeros((self.rows - part.size(0), *part.shape[1:])))
        return torch.cat(parts)

    def loss(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight: Callable[[int], float],
             record: list[torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """A loss for torch's schedule: the real rows of micro-batch i (losses come in micro-batch
        order), times weight(size), recorded detached."""
        counter = iter(self.sizes)

        def micro_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            size = next(counter)
            value = loss_fn(output[:size], target[:size]) * weight(size)
            record.append(value.detach())
            return value

        return micro_loss


# dtypes that cross stage boundaries, by a code small enough to send as an int
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 16


def send_shape(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, device: torch.device) -> None:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"a stage output of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot cross "
                         f"stages: expected at most {_HEADER - 2} dims and one of {_DTYPES}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header.to(device), dst=dst, group=group)


def recv_shape(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """An empty tensor with the shape and dtype the previous stage sent."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dims, code = int(header[0]), int(header[1])
    return torch.zeros([int(d) for d in header[2:2 + dims]], dtype=_DTYPES[code], device=device)
