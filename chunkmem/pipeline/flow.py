"""PipeDream-2BW on one rank: the orders schedule.py writes, run with point-to-point sends, never flushed.

Each `step` runs this stage's segment of the order for one more mini-batch (`schedule.twobw_segment`):
its M forwards, the backwards in flight before each, and the update of the mini-batch whose last
backward that was. Weights come from versions.py (mini-batch u computes with version u-1). Nothing
waits for the pipeline to drain: activations and gradients go out with `isend` and come in when an
action needs them. `flush` drains (the backwards still in flight and their updates) and the next step
fills the pipeline again; the weights do not depend on where the flushes are, only on the versions.

[Note: the loss comes one step late]
The loss of mini-batch t is known on the last stage when its segment ends, long after the first
stage has finished its own. Waiting for it would put the bubble back, so it travels by an asynchronous
broadcast on a group of its own (so it never mixes with the activations and gradients the stages
exchange) and each rank collects it at the end of the next step: `step` returns the loss of the
mini-batch before (NaN on the first), `flush` the loss of the last.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from chunkmem.pipeline.layout import Layout
from chunkmem.pipeline.schedule import Action, Kind, twobw_drain, twobw_segment
from chunkmem.pipeline.stage import Part
from chunkmem.pipeline.versions import WeightVersions

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Feed:
    """What the forwards of one mini-batch need: the micro-batches (first stage), targets and loss (last)."""

    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    loss: LossFn | None
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)


class Flow:
    """2BW for the one stage this rank runs (see the module docstring)."""

    def __init__(self, part: Part, stage: int, layout: Layout, shapes: tuple[torch.Tensor, torch.Tensor],
                 comm_device: torch.device, versions: WeightVersions, n_microbatches: int, loss_group: Any,
                 executed: list[Action]) -> None:
        self.part, self.stage, self.layout = part, stage, layout
        self.n_stages = layout.n_ranks
        self.first, self.last = stage == 0, stage == self.n_stages - 1
        self.shapes, self.comm_device = shapes, comm_device
        self.versions, self.m = versions, n_microbatches
        self.loss_group, self.executed = loss_group, executed
        self.minibatch = self.base = 0
        self.restart()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output or loss)
        self.feed: Feed | None = None
        self.sends: list[tuple[Any, torch.Tensor]] = []  # isends in flight, with the tensors they read
        self.pending: list[tuple[torch.Tensor, Any]] = []  # loss broadcasts not yet collected

    # -- steps -------------------------------------------------------------------------------------
    def restart(self) -> None:
        """Count mini-batches from the updates the weights have seen: a flow starts drained (first, after a
        checkpoint's load, or after another shape's flow ran)."""
        self.minibatch = self.base = self.versions.newest  # mini-batches started; the first since the last fill

    def step(self, feed: Feed) -> float:
        """Run this stage's segment of mini-batch `self.minibatch`; the loss of the one before (the Note)."""
        self.feed = feed
        self.part.start_step(self.m)
        for action in self._shifted(twobw_segment(self.stage, self.n_stages, self.m, self.minibatch - self.base)):
            self._run(action)
        self.versions.use(self.versions.newest)  # between steps, parameters are the newest (state_dict, saving)
        self.minibatch += 1
        self._share_loss(feed.losses)
        self._reap_sends()
        return self._collect(keep=1)

    def flush(self) -> float:
        """Drain: the backwards still in flight and their updates. The loss of the last mini-batch."""
        for action in self._shifted(twobw_drain(self.stage, self.n_stages, self.m, self.minibatch - self.base)):
            self._run(action)
        self.base = self.minibatch
        for work, _ in self.sends:
            work.wait()
        self.sends = []
        return self._collect(keep=0)

    def _shifted(self, actions: list[Action]) -> list[Action]:
        """Actions of the order that started at mini-batch `base`, numbered from the first mini-batch."""
        return [dataclasses.replace(a, microbatch=a.microbatch + (self.base if a.kind is Kind.UPDATE
                                                                  else self.base * self.m)) for a in actions]

    # -- actions -----------------------------------------------------------------------------------
    def _run(self, action: Action) -> None:
        self.executed.append(action)
        if action.kind is Kind.FORWARD:
            self._forward(action.microbatch)
        elif action.kind is Kind.BACKWARD:
            self._backward(action.microbatch)
        else:
            self.versions.update()

    def _version(self, microbatch: int) -> int:
        return max(microbatch // self.m - 1, 0)

    def _forward(self, g: int) -> None:
        feed, j = self.feed, g % self.m
        assert feed is not None
        if self.first:
            assert feed.inputs is not None
            x = feed.inputs[j]
        else:
            x = self._recv(self.stage - 1, self.shapes[0]).requires_grad_(self.shapes[0].is_floating_point())
        self.versions.use(self._version(g))
        out = self.part(x)
        if self.last:
            assert feed.targets is not None and feed.loss is not None
            self.saved[g] = (x, feed.loss(out, feed.targets[j]))
        else:
            self.saved[g] = (x, out)
            self._send(out.detach(), self.stage + 1)

    def _backward(self, g: int) -> None:
        x, y = self.saved.pop(g)
        self.versions.use(self._version(g))
        self.versions.runtime.backward_begins(None)  # the gradients the last micro-batch's backward showed
        if self.last:
            y.backward()
        else:
            torch.autograd.backward(y, self._recv(self.stage + 1, self.shapes[1]))
        if not self.first and x.grad is not None:
            self._send(x.grad, self.stage - 1)

    # -- communication -----------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.to(self.comm_device)
        self.sends.append((dist.isend(tensor, self.layout.global_rank(stage), group=self.layout.pipe_group), tensor))

    def _recv(self, stage: int, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(like.shape, dtype=like.dtype, device=self.comm_device)
        dist.recv(buffer, self.layout.global_rank(stage), group=self.layout.pipe_group)
        return buffer.to(self.part.runtime.device.torch_device)

    def _reap_sends(self) -> None:
        self.sends = [(work, tensor) for work, tensor in self.sends if not work.is_completed()]

    def _share_loss(self, losses: list[torch.Tensor]) -> None:
        value = torch.stack(losses).double().sum() if losses else torch.zeros((), dtype=torch.float64)
        value = value.to(self.comm_device)
        work = dist.broadcast(value, self.layout.global_rank(self.n_stages - 1), group=self.loss_group,
                              async_op=True)
        self.pending.append((value, work))

    def _collect(self, keep: int) -> float:
        """Wait for all but the newest `keep` loss broadcasts; the value of the newest waited for."""
        value = math.nan
        while len(self.pending) > keep:
            tensor, work = self.pending.pop(0)
            work.wait()
            value = tensor.item()
        return value
