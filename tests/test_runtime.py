"""Runtime.memory_stats: the device peak counts chunks and non-model data at the same moment."""

from __future__ import annotations

import copy
import functools

import torch

from chunkmem.activations import ActivationMeter
from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, prepared, tiny_gpt2, train


def plain_activation_peak(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the tensors plain PyTorch saves for backward at their peak (weights excluded)."""
    meter = ActivationMeter()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> object:
        return tensor if tensor.untyped_storage().data_ptr() in weights else meter.wrap(tensor)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved if isinstance(saved, torch.Tensor)
                                                  else saved.get(meter)):
        gpt2_loss(model, batch).backward()
    return meter.peak


def test_device_peak_is_chunks_plus_activations_at_the_same_moment() -> None:
    base, batches = tiny_gpt2(), gpt2_batches(3)
    model, opt = prepared(base, functools.partial(torch.optim.AdamW, lr=1e-3))  # everything fits: all resident
    train(model, opt, batches, gpt2_loss)
    stats = model.memory_stats()
    activations = plain_activation_peak(copy.deepcopy(base), batches[0])
    assert stats["device_chunk_bytes_peak"] == stats["model_data_bytes"]
    assert stats["device_bytes_peak"] == stats["model_data_bytes"] + activations


def test_device_peak_under_a_tight_budget_stays_within_it() -> None:
    base, batches = tiny_gpt2(), gpt2_batches(3)
    activations = plain_activation_peak(copy.deepcopy(base), batches[0])
    budget = activations + param_bytes(base) // 2
    model, opt = prepared(base, functools.partial(torch.optim.AdamW, lr=1e-3), device_memory=budget)
    train(model, opt, batches, gpt2_loss)
    stats = model.memory_stats()
    assert stats["h2d_bytes"] > 0  # chunks moved
    assert max(stats["device_chunk_bytes_peak"], activations) < stats["device_bytes_peak"] <= budget
    assert stats["device_bytes_peak"] < stats["device_chunk_bytes_peak"] + activations  # not two peaks added
