"""Pipeline parallel training with chunk-managed stages (issue 6).

```python
pipe = chunkmem.pipeline(nn.Sequential(...), lambda params: torch.optim.AdamW(params, lr=1e-3),
                         nn.functional.cross_entropy, n_microbatches=8, schedule="1f1b",
                         config=chunkmem.Config(device="cuda", device_memory="20GiB"))
for inputs, targets in loader:          # the same batch on every rank
    loss = pipe.step(inputs, targets)   # forward, backward, optimizer step; the loss on every rank
```

Modules: runner (the Pipeline object), layout (which rank runs which stage), stage (a rank's layers,
the Part that runs one stage, micro-batches, shapes between stages), scheduled (torch's schedules over
a rank's stages), flow (PipeDream-2BW's executor) and versions (its two weight versions in chunks),
balance (profiling and partitioning layers), schedule (schedules as data: orders, validate, simulate),
planner (which layout of N GPUs: `chunkmem plan --gpus N`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from chunkmem.config import Config
from chunkmem.pipeline.runner import LossFn, OptimizerFactory, Pipeline


def pipeline(model: nn.Module, optimizer_factory: OptimizerFactory, loss_fn: LossFn, *, n_microbatches: int = 4,
             schedule: str = "1f1b", balance: str | Sequence[int] = "auto", checkpoint: str = "never",
             reduction: str = "mean", config: Config | Sequence[Config] | None = None,
             data_parallel: int = 1, virtual_stages: int | None = None) -> Pipeline:
    """Train `model` (an nn.Sequential) as one chunk-managed stage per rank. Call on every rank.

    optimizer_factory: builds the optimizer from a stage's parameters (`lambda ps: AdamW(ps, lr=...)`).
    loss_fn(output, target): the loss of a micro-batch's real rows; `reduction` says whether it is
        a mean over rows ("mean", as nn.functional losses by default) or a sum ("sum"), so that
        the step equals one step on the whole mini-batch.
    n_microbatches: any batch of at least that many rows is split into that many micro-batches.
    schedule: "gpipe", "1f1b", "interleaved", "zero-bubble", "zbv" (torch.distributed.pipelining's
        ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble) or "2bw" (PipeDream-2BW: no flush between mini-batches, two weight
        versions per stage, the update W(t+1) = W(t) - lr * grad(W(t-1)); `step` returns the loss of
        the mini-batch before and `flush()` drains; see flow.py and versions.py).
    virtual_stages: stages per rank for "interleaved" and "zero-bubble" (default 2; "zbv" runs 2):
        the model is split into K * virtual_stages stages, stage i on rank i % K (ZBV: a V).
    balance: "auto" (profile each layer on the first micro-batch and minimise the slowest stage
        within each stage's device budget) or layer counts per stage, e.g. [3, 5] (K * virtual_stages
        counts with virtual stages).
    checkpoint: activation checkpointing per stage: "always", "except_last" or "never".
    config: one chunkmem.Config for every rank, or one per pipeline position (each rank's own budget;
        a rank's virtual stages share it).
    data_parallel: D pipelines over world = D x K ranks; stage s of each pipeline shards its model
        data over the D ranks that run it (ZeRO), and each pipeline takes 1/D of every batch.
    """
    return Pipeline(model, optimizer_factory, loss_fn, n_microbatches=n_microbatches, schedule=schedule,
                    balance=balance, checkpoint=checkpoint, reduction=reduction, config=config,
                    data_parallel=data_parallel, virtual_stages=virtual_stages)


__all__ = ["Pipeline", "pipeline"]
