"""`chunkmem plan --simulate`: one real forward and backward in the CPU simulation, measured.

The model is built for real (random weights) and prepared with Config(device="cpu",
device_memory=...), so the chunk-size search, the placement and every chunk copy are the
runtime's own. What is measured:
  activation peak  the most bytes of distinct storages autograd held for backward at once, read
                   from the runtime's activation meter (chunkmem.runtime.activations). This is the quantity
                   the runtime places chunks around, it is exact and deterministic; process RSS or
                   tracemalloc would mix in allocator caching, the Python heap and the other work
                   on a shared machine (tracemalloc does not even see PyTorch's allocations).
  chunk peak       memory_stats()["device_chunk_bytes_peak"]
  model data       memory_stats()["model_data_bytes"]
With `record`, two more steps follow (AdamW or SGD's step after each backward), and the third, under the plan the
warm-up made, is recorded for the time model (chunkmem/trace/timing.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import psutil
import torch

import chunkmem
from chunkmem.trace import timing
from chunkmem.trace.planner import ITEMSIZE, Estimate, Request

MAX_FRACTION_OF_RAM = 0.5  # of available host memory: beyond this, simulating would risk the machine


@dataclasses.dataclass(frozen=True)
class Measured:
    activation_peak: int
    device_chunk_peak: int
    model_data_bytes: int
    chunk_size: int
    seconds: float
    recorded: timing.Recorded | None = None  # the third step, with `record`

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "recorded"}


def simulate(config: Any, request: Request, estimate: Estimate, seed: int = 0, use_cache: bool = True,
             record: bool = False, host_weight: float = 0.0, chunk_size: int | None = None) -> Measured:
    """Run one training step of `config`'s model under `request` in the CPU simulation.

    host_weight: the planner's (chunks/planning.py's Note on homes by time), as the GPU machine predicted would
    plan: the simulation's own says how CI plans, not how that machine does. chunk_size: Config.chunk_size.

    use_cache: Hugging Face's default forward keeps the key/value cache (True: what a plain loop
    calling `model(ids, labels=ids)` runs, and what the activation model counts); `chunkmem
    finetune` passes False, which saves 2 * hidden * itemsize bytes per token per layer less.
    """
    from transformers import AutoModelForCausalLM

    need = estimate.model_data_bytes + estimate.activation_bytes + 4 * estimate.model_data_bytes // max(
        ITEMSIZE[request.dtype], 1)
    available = psutil.virtual_memory().available
    if need > available * MAX_FRACTION_OF_RAM:
        raise MemoryError(f"--simulate would need about {need / 2**30:.1f} GiB of this machine's memory "
                          f"({available / 2**30:.1f} GiB available): simulate a smaller --layers/--hidden or "
                          f"--batch-size, or drop --simulate")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if request.checkpointing:  # as `chunkmem finetune --grad-ckpt` enables it
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-4) if request.optimizer == "adam" else
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9 if request.optimizer == "sgd-momentum" else 0))
    prepared, optimizer = chunkmem.prepare(model, optimizer, chunkmem.Config(
        device="cpu", device_memory=request.device_memory, dtype=request.dtype, chunk_size=chunk_size,
        offload_activations=request.offload_activations))
    prepared.runtime.placer.host_weight = host_weight
    ids = torch.randint(0, config.vocab_size, (request.batch_size, request.seq_len),
                        generator=torch.Generator().manual_seed(seed))

    def forward_backward() -> None:
        prepared(ids, labels=ids, use_cache=use_cache and not request.checkpointing).loss.backward()

    def train_step() -> None:
        forward_backward()
        optimizer.step()
        optimizer.zero_grad()

    start = time.perf_counter()
    forward_backward()
    seconds = time.perf_counter() - start
    # With checkpointing this is the forward's peak: the recomputation in backward keeps its tensors
    # inside torch.utils.checkpoint's own frame, where no saved-tensor hook sees them.
    stats, peak = prepared.memory_stats(), prepared.runtime.activations.peak
    recorded = None
    if record:
        optimizer.step()
        optimizer.zero_grad()
        train_step()
        recorded = timing.record(prepared.runtime, train_step)
    return Measured(peak, stats["device_chunk_bytes_peak"], stats["model_data_bytes"],
                    stats["chunk_size"], seconds, recorded)
