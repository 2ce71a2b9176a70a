"""The schedules torch.distributed.pipelining runs: a PipelineStage per stage of this rank, the order they
really ran in, and the weight gradients zero-bubble schedules compute outside autograd's accumulation.

[Note: weight gradients under zero bubble]
Zero-bubble schedules split a backward into I (input gradient, `torch.autograd.grad` on the inputs with
the graph kept) and W (weight gradients). torch computes W with `torch.autograd.grad` too and adds the
result to `param.grad` itself, so the post-accumulate hooks that move a gradient into its chunk never
fire (the first stage is the exception: its W is a plain backward). After each W the stage hands every
`param.grad` it left to the runtime, as the hook would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from chunkmem.pipeline.layout import Layout
from chunkmem.pipeline.schedule import Action, Kind, check_twobw
from chunkmem.pipeline.stage import Part, recv_shape, send_shape

SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # one stage per rank
MULTI = {"interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble,
         "zbv": ScheduleZBVZeroBubble}
Shapes = dict[int, tuple[torch.Tensor, torch.Tensor]]  # stage -> (an input, an output) of one micro-batch


class RecordingStage(PipelineStage):
    """torch's stage over one Part: notes the order it ran forwards and backwards in (schedule.py), and
    moves zero-bubble's weight gradients into chunks (the Note)."""

    def __init__(self, part: Part, index: int, n_stages: int, shapes: tuple[torch.Tensor, torch.Tensor],
                 group: Any, executed: list[Action]) -> None:
        super().__init__(part, index, n_stages, part.runtime.device.torch_device, input_args=shapes[0],
                         output_args=shapes[1], group=group)
        self.part = part
        self.executed = executed

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.executed.append(Action(self.stage_index, Kind.FORWARD, fwd_chunk_id))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        kind = Kind.BACKWARD if full_backward else Kind.INPUT
        self.executed.append(Action(self.stage_index, kind, bwd_chunk_id))
        self.part.runtime.backward_begins(None)  # the gradients the last micro-batch's backward showed
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self.executed.append(Action(self.stage_index, Kind.WEIGHT, bwd_chunk_id))
        self.part.runtime.backward_begins(None)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        runtime = self.part.runtime
        for param in self.part.parameters():
            if param.grad is not None:
                runtime.grad_ready(runtime.store.records[param])


def exchange_shapes(parts: dict[int, Part], first: torch.Tensor, ranks: Sequence[int], layout: Layout,
                    comm_device: torch.device) -> Shapes:
    """Each of this rank's stages runs one micro-batch without gradients to learn its output; stage i learns its
    input from stage i-1 (sent by the rank that holds it). Stages go in order on every rank, so no rank
    waits on one that waits on it."""
    shapes: Shapes = {}
    position, device = layout.position, None
    for index, part in sorted(parts.items()):
        device = part.runtime.device.torch_device
        if index == 0:
            stage_in = first
        elif ranks[index - 1] == position:
            stage_in = shapes[index - 1][1].detach().clone()
        else:
            stage_in = recv_shape(layout.global_rank(ranks[index - 1]), layout.pipe_group, comm_device).to(device)
        stage_in.requires_grad_(index > 0 and stage_in.is_floating_point())
        with torch.no_grad():
            out = part(stage_in)
        if index < len(ranks) - 1 and ranks[index + 1] != position:
            send_shape(out, layout.global_rank(ranks[index + 1]), layout.pipe_group, comm_device)
        shapes[index] = (stage_in, out.detach().requires_grad_(out.is_floating_point()))
    return shapes


def build(name: str, parts: dict[int, Part], shapes: Shapes, n_stages: int, n_microbatches: int,
          loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: Any, executed: list[Action]) -> Any:
    """torch's schedule `name` over this rank's stages. Gradients are not scaled by torch (runner's Note)."""
    stages: list[Any] = [RecordingStage(part, index, n_stages, shapes[index], group, executed)
                         for index, part in sorted(parts.items())]
    if name in SINGLE:
        return SINGLE[name](stages[0], n_microbatches, loss_fn=loss, scale_grads=False)
    return MULTI[name](stages, n_microbatches, loss_fn=loss, scale_grads=False)


def check_layout(name: str, n_ranks: int, n_microbatches: int, virtual: int, data_parallel: int) -> None:
    """Whether chunkmem.pipeline runs schedule `name` on this layout: a clear error before any step if not."""
    if name != "2bw":
        check(name, n_ranks, n_microbatches, virtual, data_parallel)
        return
    check_twobw(n_ranks, n_microbatches)
    if data_parallel > 1:
        raise ValueError(f"schedule='2bw' with data_parallel={data_parallel}: 2BW's weight versions are not "
                         "sharded by ZeRO yet; use data_parallel=1, or schedule='1f1b'/'interleaved'")


def check(name: str, n_ranks: int, n_microbatches: int, virtual: int, data_parallel: int) -> None:
    """What torch's multi-stage schedules (and chunkmem's handling of them) require, said before any step."""
    if name not in MULTI:
        return
    if name == "zbv" and virtual != 2:
        raise ValueError(f"virtual_stages={virtual}: schedule='zbv' runs exactly 2 stages per rank (a V): "
                         "pass virtual_stages=2")
    if name == "interleaved" and virtual < 2:
        raise ValueError(f"virtual_stages={virtual}: schedule='interleaved' needs at least 2 stages per rank "
                         "(with one it is 1F1B: use schedule='1f1b')")
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        raise ValueError(f"n_microbatches={n_microbatches}: schedule={name!r} on {n_ranks} ranks runs micro-batches "
                         f"in {rounds} rounds, so it needs a multiple of {rounds}: use "
                         f"{rounds * (n_microbatches // rounds)}"
                         f" or {rounds * (n_microbatches // rounds + 1)}")
    if name != "interleaved" and data_parallel > 1:
        raise ValueError(f"schedule={name!r} with data_parallel={data_parallel}: zero-bubble weight gradients reach "
                         "chunks outside autograd's backward, where ZeRO cannot reduce them yet; use "
                         "data_parallel=1, or schedule='interleaved' with data parallelism")
