"""benchmarks/budget_sweep.py tells each way a budgeted run ends."""

from __future__ import annotations

import pytest
import torch

from chunkmem.runtime.runtime import Runtime
from tests import zoo

budget_sweep = pytest.importorskip("benchmarks.budget_sweep")
pytest.importorskip("transformers")


def test_a_run_that_trains_within_its_budget_says_so(sim_memory) -> None:
    sim_memory(1.0)  # devices model the allocator, as the benchmark's main() makes them (run() sets its sizes)
    row = budget_sweep.run(zoo.by_name("gpt2"), "fp32", 0.5, coarse=False, steps=2)
    assert row["outcome"] == "trains" and 0 < row["reserved KiB"] <= row["budget KiB"]


def test_cudas_error_in_a_step_is_told_apart_from_a_refusal(sim_memory, monkeypatch) -> None:
    sim_memory(1.0)
    original, calls = torch.Tensor.backward, []

    def backward(self, *args, **kwargs):  # plain PyTorch's, measured first, runs; chunkmem's first step's fails
        calls.append(self)
        if len(calls) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    row = budget_sweep.run(zoo.by_name("gpt2"), "fp32", 0.5, coarse=False, steps=2)
    assert row["outcome"] == "CUDA OOM in step 0 (backward)"
    monkeypatch.undo()
    negative = budget_sweep.run(zoo.by_name("gpt2"), "fp32", -1.0, coarse=False, steps=2)  # below zero: bad input
    assert negative["outcome"].startswith("error in step -1 (prepare): ValueError: Config.device_memory=-")


def test_a_run_falling_back_after_its_warm_up_is_not_counted_as_training(sim_memory, monkeypatch) -> None:
    # The contract allows an out-of-memory fallback in the warm-up only: one in every later step is told apart.
    sim_memory(1.0)
    original, calls = Runtime.memory_stats, []

    def memory_stats(self):
        calls.append(self)
        return original(self) | {"oom_fallbacks": len(calls)}

    monkeypatch.setattr(Runtime, "memory_stats", memory_stats)
    row = budget_sweep.run(zoo.by_name("gpt2"), "fp32", 0.5, coarse=False, steps=2)
    assert row["outcome"] == "trains, falling back after the warm-up" and row["after warm-up"] == 1
