"""Hugging Face Trainer on chunkmem: an existing Trainer script changes one line.

    trainer = Trainer(model=model, args=args, ...)                       # before
    trainer = ChunkmemTrainer(model=model, args=args, ..., chunkmem_config=chunkmem.Config(
        device_memory="20GiB", dtype="bf16"))                            # after

The Trainer builds its optimizer as usual; `create_optimizer` then hands model and optimizer to
`chunkmem.prepare`, and the Trainer trains the prepared model. What changes underneath:

- chunkmem moves the model itself, so neither the Trainer nor Accelerate may `.to(device)` it
  (that would pull every parameter onto the device at once): device placement is turned off, and
  the prepared model moves each batch to its device.
- Gradients live in chunks (`p.grad` is None), so clipping calls `model.clip_grad_norm_`.
- Saving writes a Hugging Face directory parameter by parameter (chunkmem.finetune.hf), a PEFT model's adapter
  through its own save_pretrained, and the optimizer state goes into a chunkmem checkpoint inside the Trainer's
  checkpoint folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import can_return_loss, find_labels

import chunkmem
from chunkmem.finetune import hf
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.wrapper import ChunkedModel

OPTIMIZER_DIR = "chunkmem_optimizer"
SCHEDULER_FILE = "chunkmem_scheduler.json"


class ChunkmemTrainer(Trainer):
    """`transformers.Trainer` whose model data lives in chunkmem chunks. See the module docstring."""

    def __init__(self, *args: Any, chunkmem_config: chunkmem.Config | None = None, **kwargs: Any) -> None:
        self.chunkmem_config = chunkmem_config or chunkmem.Config()
        super().__init__(*args, **kwargs)
        if isinstance(self.model, ChunkedModel):  # prepared already: what it takes is what the wrapped model takes
            wrapped = type(self.model.module)
            self.label_names = find_labels(wrapped) if self.args.label_names is None else self.args.label_names
            self.can_return_loss = can_return_loss(wrapped)

    # transformers reads a model's forward for which dataset columns to keep, and its class name for whether label
    # smoothing shifts the labels (a causal LM's). A prepared model gives the wrapped model's, but a PEFT model is told
    # apart by its type, which the prepared one is not: the Trainer is given the wrapped model to read.
    def _set_signature_columns_if_needed(self) -> None:
        model = self.model
        self.model = model.module if isinstance(model, ChunkedModel) else model
        try:
            super()._set_signature_columns_if_needed()
        finally:
            self.model = model

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        unwrap = self.accelerator.unwrap_model

        def unwrapped(*given: Any, **options: Any) -> Any:
            inner = unwrap(*given, **options)
            return inner.module if isinstance(inner, ChunkedModel) else inner

        self.accelerator.unwrap_model = unwrapped  # type: ignore[method-assign]
        try:
            return super().compute_loss(model, inputs, *args, **kwargs)
        finally:
            self.accelerator.unwrap_model = unwrap  # type: ignore[method-assign]

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.device_placement = False  # before a subclass's __init__ prepares another model with it

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        """chunkmem places the parameters; moving the whole model would defeat it."""

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if isinstance(self.model, ChunkedModel):
            if self.optimizer is None:
                raise RuntimeError("ChunkmemTrainer: the model is already prepared but the Trainer has no optimizer: "
                                   "pass the ChunkOptimizer from chunkmem.prepare as optimizers=(optimizer, None), "
                                   "or pass the plain model and let the Trainer prepare it")
            return self.optimizer
        if self.model is None:
            raise RuntimeError("ChunkmemTrainer: no model to prepare: pass model= (or model_init=) to the Trainer")
        plain = super().create_optimizer(model)
        self.model, self.optimizer = self._prepare(self.model, plain)
        self.model_wrapped = self.model
        return self.optimizer

    def _prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                 ) -> tuple[ChunkedModel, ChunkOptimizer]:
        return chunkmem.prepare(model, optimizer, self.chunkmem_config)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self._prepared().clip_grad_norm_(self.args.max_grad_norm)

    def _prepared(self) -> ChunkedModel:
        """The model `create_optimizer` prepared; clipping and checkpoints need its chunks."""
        if not isinstance(self.model, ChunkedModel):
            raise TypeError(f"ChunkmemTrainer: the model is a {type(self.model).__name__}, not yet prepared by "
                            "chunkmem: create_optimizer prepares it when training starts")
        return self.model

    def _chunk_optimizer(self) -> ChunkOptimizer:
        optimizer: object = self.optimizer
        while not isinstance(optimizer, ChunkOptimizer):  # Accelerate wraps it
            inner = getattr(optimizer, "optimizer", None)
            if inner is None:
                raise TypeError(f"ChunkmemTrainer: the Trainer's optimizer is a {type(optimizer).__name__} and "
                                "wraps no ChunkOptimizer: create_optimizer has not prepared the model")
            optimizer = inner
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not isinstance(self.model, ChunkedModel):  # not prepared yet: nothing of chunkmem's to save
            super()._save(output_dir, state_dict)
            return
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        if output_dir is None:
            raise ValueError("ChunkmemTrainer: nowhere to save: set TrainingArguments.output_dir")
        if getattr(self.model.module, "peft_config", None) is not None and self.model.runtime.shards is None:
            self.model.save_pretrained(output_dir)  # a PEFT model's adapter alone, as the plain Trainer saves it
        else:
            hf.save_pretrained(self.model, output_dir)  # fp32, from the master weights, as the plain Trainer's in bf16
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        chunkmem.save_checkpoint(Path(output_dir) / OPTIMIZER_DIR, self._prepared(), self._chunk_optimizer())
        if self.lr_scheduler is not None:
            state = {k: v for k, v in self.lr_scheduler.state_dict().items() if _jsonable(v)}
            (Path(output_dir) / SCHEDULER_FILE).write_text(json.dumps(state))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if not (Path(checkpoint) / OPTIMIZER_DIR).exists():
            if any((Path(checkpoint) / name).exists() for name in ("optimizer.pt", "optimizer.bin", "scheduler.pt")):
                # Resumed without them, the optimizer states and the learning-rate schedule would start again.
                raise ValueError(f"ChunkmemTrainer: {checkpoint} is a checkpoint of transformers' Trainer "
                                 "(optimizer.pt, scheduler.pt): a chunkmem optimizer keeps its state in chunks and "
                                 "cannot read it. "
                                 f"Resume from a ChunkmemTrainer checkpoint (with {OPTIMIZER_DIR}/), or start "
                                 "from the model weights alone (from_pretrained, no resume_from_checkpoint)")
            return
        chunkmem.load_checkpoint(Path(checkpoint) / OPTIMIZER_DIR, self._prepared(), self._chunk_optimizer())
        scheduler_file = Path(checkpoint) / SCHEDULER_FILE
        if self.lr_scheduler is not None and scheduler_file.exists():
            self.lr_scheduler.load_state_dict(json.loads(scheduler_file.read_text()))


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


__all__ = ["ChunkmemTrainer"]
