"""Balance: which consecutive layers each stage runs, chosen to minimise the slowest stage.

`profile` measures each layer on the target device (the CPU in the simulation): forward plus
backward time of one micro-batch, the bytes autograd saves for backward, the bytes of the layer's
output (all that activation checkpointing keeps), and its parameters. `partition` then solves the
block-partition problem exactly by dynamic programming over (stages, layer prefix): minimise the
largest stage time, subject to each stage's device memory estimate fitting its budget.

[Note: the device memory of a stage]
chunkmem streams parameter chunks, so a stage needs on the device at once only its largest
layer's parameters (in the compute dtype), not all of them; what it cannot stream are the
activations of the micro-batches in flight: min(M, K - s) under 1F1B, M under GPipe. With
checkpointing, a micro-batch in flight holds only its stage input, and one micro-batch at a time
re-computes the full activations; that re-computation, one non-reentrant checkpoint over the whole
stage (stage.py), holds every layer's parameters until its backward is done (hooks' Note on
re-computation), so the stage needs them all at once. Parameters come in whole chunks, and a layer
may straddle two: where the chunk size is known, the estimate counts one chunk more than they fill.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn

from chunkmem.errors import MemoryBudgetError


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What one layer costs for one micro-batch."""

    seconds: float  # forward + backward
    param_bytes: int  # parameters in the compute dtype: the layer's device working set
    activation_bytes: int  # saved for backward
    output_bytes: int  # the layer's output: what a checkpointed segment keeps of it


@dataclasses.dataclass(frozen=True)
class StageNeeds:
    """How many micro-batches a stage keeps activations for, and how it re-computes them."""

    in_flight: int
    checkpoint: str  # "always" | "except_last" | "never"
    chunk_bytes: int = 0  # a parameter chunk's, where Config.chunk_size sets it (0: searched at prepare)


def stage_bytes(costs: Sequence[LayerCost], input_bytes: int, needs: StageNeeds) -> int:
    """Device bytes a stage of these layers needs at its peak (see the Note)."""
    params = [c.param_bytes for c in costs]
    working = max(params, default=0) if needs.checkpoint == "never" else sum(params)
    if needs.chunk_bytes:
        working = (-(-working // needs.chunk_bytes) + 1) * needs.chunk_bytes
    full = sum(c.activation_bytes for c in costs)
    if needs.checkpoint == "never":
        return working + needs.in_flight * full
    kept = needs.in_flight if needs.checkpoint == "always" else needs.in_flight - 1
    return working + kept * input_bytes + full


def partition(costs: Sequence[LayerCost], n_stages: int, input_bytes: int,
              budgets: Sequence[int | None], needs: Sequence[StageNeeds]) -> list[int]:
    """Layer counts per stage that minimise the slowest stage with every stage within its budget
    and holding parameters."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages: every stage needs at least one layer; "
                         f"use at most {n} stages")
    boundary = [input_bytes] + [c.output_bytes for c in costs]  # input bytes of a stage starting at layer i
    inf = float("inf")
    # best[k][j]: the least possible slowest-stage time placing layers [0, j) on stages [0, k)
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        budget = budgets[k - 1]
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or not any(c.param_bytes for c in costs[i:j]):
                    continue  # every stage needs parameters: chunkmem prepares a model and its optimizer
                if budget is not None and stage_bytes(costs[i:j], boundary[i], needs[k - 1]) > budget:
                    continue
                slowest = max(best[k - 1][i], sum(c.seconds for c in costs[i:j]))
                if slowest < best[k][j]:
                    best[k][j], cut[k][j] = slowest, i
    if best[n_stages][n] == inf:
        raise MemoryBudgetError(_infeasible(costs, n_stages, input_bytes, budgets, needs))
    counts, j = [], n
    for k in range(n_stages, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return counts[::-1]


def _infeasible(costs: Sequence[LayerCost], n_stages: int, input_bytes: int,
                budgets: Sequence[int | None], needs: Sequence[StageNeeds]) -> str:
    even = even_counts(len(costs), n_stages)
    start, lines = 0, []
    for s, count in enumerate(even):
        need = stage_bytes(costs[start:start + count], input_bytes if s == 0 else costs[start - 1].output_bytes,
                           needs[s])
        lines.append(f"stage {s}: {count} layers need about {need} bytes, budget {budgets[s]}")
        start += count
    checkpoint = "" if all(n.checkpoint == "always" for n in needs) else ", or checkpoint activations " \
        "(checkpoint='always')"
    return (f"no split of {len(costs)} layers into {n_stages} stages fits the device budgets (an even split: "
            + "; ".join(lines) + f"): raise Config.device_memory, use more stages or micro-batches{checkpoint}")


def even_counts(n_layers: int, n_stages: int) -> list[int]:
    return [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]


def profile(layers: Sequence[nn.Module], sample: torch.Tensor, device: torch.device, dtype: torch.dtype,
            repeats: int = 3) -> list[LayerCost]:
    """Measure each layer on `device` with `sample` (one micro-batch) flowing through them in turn.

    Each layer is copied to the device alone, so a model larger than the device can be profiled.
    Time is the median of `repeats` forward+backward runs after one warm-up run.
    """
    costs = []
    x = _cast(sample, device, dtype)
    for layer in layers:
        local = copy.deepcopy(layer).to(device, dtype)
        times, saved, out = [], 0, x
        for _ in range(repeats + 1):
            begin = time.perf_counter()
            saved, out = _forward_backward(local, x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
        params = sum(p.numel() * p.element_size() for p in local.parameters())
        costs.append(LayerCost(sorted(times[1:])[len(times[1:]) // 2], params, saved, out.nbytes))
        x = out.detach().requires_grad_(out.is_floating_point())
    return costs


def _forward_backward(layer: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of distinct storages autograd saves in one forward, and the output (after a backward)."""
    storages: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:  # parameters are model data, not activations
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    if out.requires_grad:
        out.backward(torch.ones_like(out))
    return sum(storages.values()), out


def _cast(sample: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if sample.is_floating_point():
        return sample.to(device, dtype).requires_grad_(False)
    return sample.to(device)
