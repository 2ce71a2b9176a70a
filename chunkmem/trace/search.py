"""Which combination of fixes makes a model fit, and the fastest of them (`chunkmem plan`).

One change at a time often fits nothing where two or three together fit easily (LLaMA-7B on a 24 GiB GPU
and 64 GiB of host memory needs bf16, activation checkpointing and the disk tier at once). The search
tries every combination of the changes chunkmem knows: compute dtype, activation checkpointing,
activations offloaded to the host, the disk tier, a smaller micro-batch with gradient accumulation (the
same tokens per step) and LoRA adapters of a few ranks. It plans each with trace/planner.py and ranks
those that fit by the predicted seconds of a step. LoRA trains something else (adapters on frozen
weights), so it comes after every full fine-tuning that fits.

[Note: the step-time model]
Seconds per step of the requested tokens, nothing overlapped (a bound to rank by, not a measurement):
  compute    FLOPs / (FLOPS * efficiency): 2 per parameter and token forward, 2 for the gradient of the
             inputs, 2 for the gradient of the trainable weights, 2 more to recompute the forward under
             checkpointing; fp32 at half of bf16's rate (TF32); efficiency falls with the rows of a
             micro-batch as in pipeline/planner.py (small GEMMs run below peak)
  streamed   the share of model data the device cannot keep beside the working set, activations and
             margins: its parameters read in by each micro-batch's forward and backward, its gradients
             sent down once, over PCIE
  host step  that share's groups update on the host: their gradients, master weights and optimizer states
             read and written once at HOST_UPDATE
  offloaded  activations sent to the host and back once per micro-batch, over PCIE
  disk       the disk tier's bytes read and written back once a step at DISK
FLOPS, PCIE, HOST_UPDATE and DISK are typical of one recent GPU machine, not measured here.
`chunkmem plan --simulate` also replays the simulated step at these speeds in the time model of trace/timing.py
(copies and host updates overlapping compute as the plan orders them), with chunkmem's own host time per event.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import torch

from chunkmem.trace.planner import Estimate, ModelSpec, Request, plan
from chunkmem.trace.timing import STAGES, Recorded, Speeds

FLOPS = 200e12  # dense bf16 a GPU sustains on large GEMMs
PCIE = 20e9  # host <-> device bytes per second
HOST_UPDATE = 10e9  # bytes of gradient, master and optimizer state a multi-core host steps per second
DEVICE_UPDATE = 500e9  # the same on the GPU (an H100's, fitted in benchmarks/time_model.py)
# chunkmem's host seconds per placer event (module access, gradient, update) as CUDA runs a step: the launch-bound
# LLaMA's extra host time at 50% of its model data, and resident (benchmarks/results/
# overhead_launch_bound_llama20_as_cuda.json, bf16: 68 and 14 ms over its 673 events)
HOST_PER_EVENT = 100e-6
RESIDENT_HOST_PER_EVENT = 20e-6
DISK = 2e9  # NVMe bytes per second each way
HALF_ROWS = 2048  # tokens per micro-batch at which GEMMs run at half their peak
LORA_RANKS = (64, 8)
OPTIMIZER_KINDS = ("grad", "master", "exp_avg", "exp_avg_sq", "momentum_buffer")


@dataclasses.dataclass(frozen=True)
class Option:
    changes: tuple[str, ...]  # what to change, as a user would ask for it; () for the request as it is
    estimate: Estimate
    seconds: float  # predicted per step of the requested tokens
    lora_rank: int = 0

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        return {"changes": list(self.changes), "verdict": e.verdict, "seconds": self.seconds,
                "lora_rank": self.lora_rank, "device_need": e.device_need, "host_need": e.host_need,
                "host_need_per_host": e.host_need_per_host, "disk_bytes": e.disk_bytes, "request": e.request.to_json()}


def with_lora(spec: ModelSpec, rank: int) -> ModelSpec:
    """The model with rank-`rank` adapters on every linear layer but the head, as `--lora-rank` trains it."""
    from chunkmem.finetune.lora import apply_lora

    module = copy.deepcopy(spec.module)
    with torch.device("meta"):
        apply_lora(module, rank=rank)
    return dataclasses.replace(spec, module=module)


def step_seconds(spec: ModelSpec, estimate: Estimate, tokens: int) -> float:
    """Predicted seconds of a step of `tokens` tokens as `estimate` runs it (the Note on the step-time model)."""
    request = estimate.request
    micro_batches = max(1, tokens // (request.batch_size * request.seq_len))
    room = max(0, request.device_memory - (estimate.device_need - estimate.working_set_bytes))
    spill = max(0.0, 1 - room / max(1, estimate.model_data_bytes))
    kinds = estimate.model_data_by_kind
    streamed = spill * (2 * micro_batches * kinds["param"] + kinds.get("grad", 0))
    stepped = spill * sum(kinds.get(kind, 0) for kind in OPTIMIZER_KINDS)
    offloaded = 2 * micro_batches * estimate.offloaded_activation_bytes
    return (sum(compute_seconds(spec, request, tokens).values()) + (streamed + offloaded) / PCIE
            + 2 * stepped / HOST_UPDATE + 2 * estimate.disk_bytes / DISK)


def compute_seconds(spec: ModelSpec, request: Request, tokens: int) -> dict[str, float]:
    """Seconds of kernels in the forward ("fwd") and backward ("bwd") of `tokens` tokens (the Note on the
    step-time model: its compute)."""
    params = sum(p.numel() for p in spec.module.parameters())
    trainable = sum(p.numel() for p in spec.module.parameters() if p.requires_grad)
    rows = request.batch_size * request.seq_len
    rate = FLOPS * (1.0 if request.dtype != "fp32" else 0.5) * rows / (rows + HALF_ROWS)
    backward = params * (2 + (2 if request.checkpointing else 0)) + 2 * trainable
    return {"fwd": tokens * 2 * params / rate, "bwd": tokens * backward / rate}


def typical_speeds(spec: ModelSpec, request: Request, recorded: Recorded) -> Speeds:
    """The time model's speeds (trace/timing.py) for a step of `recorded` on a typical GPU machine: this module's
    constants, and chunkmem's host time at HOST_PER_EVENT (RESIDENT_HOST_PER_EVENT when every group is home)."""
    per_event = RESIDENT_HOST_PER_EVENT if len(recorded.homes) == len(recorded.groups) else HOST_PER_EVENT
    host = {stage: per_event * sum(1 for s in recorded.stages if s == stage) for stage in STAGES}
    return Speeds(PCIE, PCIE, HOST_UPDATE, DEVICE_UPDATE,
                  compute_seconds(spec, request, request.batch_size * request.seq_len), host)


def options(spec: ModelSpec, request: Request) -> list[Option]:
    """Every combination of fixes: those that fit first, full fine-tuning before LoRA, room to spare before
    tight, then fastest first."""
    tokens = request.batch_size * request.seq_len
    dtypes = [request.dtype] + (["bf16"] if request.dtype == "fp32" else [])
    batches = [b for b in range(request.batch_size, 0, -1) if request.batch_size % b == 0]
    models = [(0, spec)] + [(rank, with_lora(spec, rank)) for rank in LORA_RANKS]
    found = []
    for (rank, model), dtype, checkpointing, offload, disk, batch in itertools.product(
            models, dtypes, {request.checkpointing, True}, {request.offload_activations, True}, {request.disk, True},
            batches):
        changed = dataclasses.replace(request, dtype=dtype, checkpointing=checkpointing, offload_activations=offload,
                                      disk=disk, batch_size=batch)
        estimate = plan(model, changed)
        if disk and not request.disk and not estimate.disk_bytes:
            continue  # the disk tier holds nothing: the same run as without it
        changes = _changes(request, changed, rank)
        found.append(Option(changes, estimate, step_seconds(model, estimate, tokens), rank))
    return sorted(found, key=lambda o: (o.estimate.verdict == "does not fit", o.lora_rank > 0,
                                        o.estimate.verdict == "tight", o.seconds, -o.lora_rank, len(o.changes)))


def _changes(request: Request, changed: Request, rank: int) -> tuple[str, ...]:
    out = []
    if changed.dtype != request.dtype:
        out.append(f"{changed.dtype} compute (--dtype {changed.dtype})")
    if changed.checkpointing != request.checkpointing:
        out.append("activation checkpointing (--grad-ckpt)")
    if changed.offload_activations != request.offload_activations:
        out.append("activations offloaded to the host (Config(offload_activations=True))")
    if changed.disk != request.disk:
        out.append("master weights and optimizer states on disk (--disk, Config(disk=DIR))")
    if changed.batch_size != request.batch_size:
        out.append(f"micro-batch {changed.batch_size} with {request.batch_size // changed.batch_size}x gradient "
                   "accumulation (same tokens per step)")
    if rank:
        out.append(f"LoRA rank {rank} (--lora-rank {rank}: adapters trained on frozen weights)")
    return tuple(out)
