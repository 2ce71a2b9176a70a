"""What a fine-tuning run reports: chunk traffic, the device peak against the budget, the summary.

The budget (`device_memory`) covers chunks and non-model data (activations, temporaries), but only
chunks are chunkmem's to move: when activations alone need more than the budget leaves, the device
holds more than the budget, and the run says so (after its first step and in the summary) instead
of reporting chunk bytes as if they were all of it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import psutil

from chunkmem.chunks.observe import Moment, Move
from chunkmem.wrapper import ChunkedModel

if TYPE_CHECKING:
    from chunkmem.finetune.train import Result

log = logging.getLogger("chunkmem")


class Traffic:
    """Observer of chunk copies (chunkmem.chunks.observe): bytes each way and seconds spent, per step. Moments are
    nothing to it: steps may run resident or lean."""

    wants_moments = False

    def __init__(self) -> None:
        self.h2d = self.d2h = 0
        self.seconds = 0.0
        self.per_step: list[int] = []  # bytes moved (both ways) in each finished step
        self._at_step_start = 0

    def moment(self, moment: Moment) -> None:
        pass

    def moved(self, move: Move) -> None:
        if move.dst == "device":
            self.h2d += move.nbytes
        else:
            self.d2h += move.nbytes
        self.seconds += move.seconds

    def step_done(self) -> None:
        self.per_step.append(self.h2d + self.d2h - self._at_step_start)
        self._at_step_start = self.h2d + self.d2h

    def steady_bytes(self) -> float:
        """Mean bytes moved per step after the first (which warms up and moves chunks in once)."""
        steady = self.per_step[1:] or self.per_step
        return sum(steady) / max(1, len(steady))


def memory_text(model: ChunkedModel) -> str:
    """The device peak (chunks and non-model data) against the budget, and this process's host memory."""
    stats = model.memory_stats()
    host = psutil.Process().memory_info().rss
    return f"dev {_size(stats['device_bytes_peak'])}/{_size(stats['device_limit_bytes'])}, host {_size(host)}"


def over_budget(model: ChunkedModel) -> str | None:
    """A warning when the device held more than the budget at some moment (non-model data is not chunkmem's
    to evict: activations beyond what the budget leaves), else None."""
    stats = model.memory_stats()
    peak, limit = stats["device_bytes_peak"], stats["device_limit_bytes"]
    if peak <= limit:
        return None
    module = model.module
    checkpointed = getattr(module, "is_activation_checkpointing", None)  # transformers >= 5
    if checkpointed is None:
        checkpointed = getattr(module, "is_gradient_checkpointing", False)
    return (f"the device peak {_size(peak)} exceeded the {_size(limit)} budget: activations need more than it "
            f"leaves beside the chunks in use; raise --device-memory, or lower --batch-size or --seq-len"
            f"{'' if checkpointed else ', or add --grad-ckpt'} (`chunkmem plan` estimates the need)")


def warn_over_budget(model: ChunkedModel) -> None:
    message = over_budget(model)
    if message is not None:
        log.warning("%s", message)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{nbytes:.0f}B"


def summary(result: Result) -> str:
    """A few lines for the end of a run."""
    stats = result.model.memory_stats()
    steps = len(result.losses)
    if not steps:
        return (f"the run in {result.output} had finished: all {result.total_steps} steps are trained, nothing to do "
                "(its model is there; choose another --output for a new run)")
    lines = [f"trained steps {result.step - steps + 1}-{result.step} of {result.total_steps} "
             f"in {result.seconds:.1f}s ({result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s)"]
    if result.losses:
        lines.append(f"training loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    if result.evals:
        step, loss = result.evals[-1]
        lines.append(f"held-out loss {loss:.3f}, perplexity {math.exp(min(loss, 50.0)):.2f} (step {step})")
    lines.append(f"memory: model data {_size(stats['model_data_bytes'])}; device budget "
                 f"{_size(stats['device_limit_bytes'])} for chunks and activations"
                 f"{' (the default: chunks get a quarter of the model data)' if result.streaming_default else ''}, "
                 f"peak {_size(stats['device_bytes_peak'])}; host {_size(psutil.Process().memory_info().rss)}")
    traffic = result.traffic
    share = traffic.seconds / max(result.seconds, 1e-9)
    lines.append(f"chunks moved {_size(traffic.steady_bytes())} per step ({_size(traffic.h2d)} to the device, "
                 f"{_size(traffic.d2h)} back in {steps} steps); {traffic.seconds:.2f}s copying ({share:.0%} of training)")
    warning = over_budget(result.model)
    if warning is not None:
        lines.append(f"warning: {warning}")
    if result.step == result.total_steps:
        lines.append(f"output: {result.output} (Hugging Face directory)")
    else:
        lines.append(f"output: {result.output} (checkpoint at step {result.step}; continue with --resume)")
    return "\n".join(lines)
