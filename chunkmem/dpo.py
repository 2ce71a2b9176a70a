"""TRL's DPOTrainer on chunkmem: the policy and its frozen reference under one `chunkmem.Manager`.

    trainer = DPOTrainer(model=policy, ref_model=reference, args=DPOConfig(...), ...)      # before
    trainer = ChunkmemDPOTrainer(model=policy, ref_model=reference, args=DPOConfig(...), ...,
                                 chunkmem_config=chunkmem.Config(device_memory="20GiB"))    # after

What ChunkmemTrainer does for one model (chunkmem/trainer.py), done for both: when training starts,
`create_optimizer` prepares the policy with its optimizer and then the reference, frozen, into one manager, so one
device budget and one plan cover the policy's step and the reference's forwards (manager.py's Note). The reference
is never moved to the device whole: Accelerate's device placement is off before DPOTrainer's `__init__` hands it
to `prepare_model`. TRL's fused LM head (`add_fused_lm_head`) reads the head's weight outside the head's forward;
the hooks fetch it there as for any weight used outside its module. Without `ref_model` (a PEFT adapter, or
`precompute_ref_log_probs=True`), the manager holds the policy alone.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import DPOTrainer

import chunkmem
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.trainer import ChunkmemTrainer
from chunkmem.wrapper import ChunkedModel


class ChunkmemDPOTrainer(ChunkmemTrainer, DPOTrainer):
    """`trl.DPOTrainer` whose policy and reference share one chunkmem budget. See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.manager: chunkmem.Manager | None = None
        super().__init__(*args, **kwargs)

    def _prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                 ) -> tuple[ChunkedModel, ChunkOptimizer]:
        manager = chunkmem.Manager(self.chunkmem_config)
        prepared = manager.prepare(model, optimizer)
        if self.ref_model is not None:
            self.ref_model = manager.prepare(self.accelerator.unwrap_model(self.ref_model))  # type: ignore[assignment]
        self.manager = manager
        return prepared


__all__ = ["ChunkmemDPOTrainer"]
