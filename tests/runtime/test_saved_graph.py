"""The activations a forward saves die with its graph, whether or not backward ran: a pack hook that kept the tensor
itself (an op's output, whose grad_fn holds the saved tensor) made a cycle through autograd's C++ side, which
Python's collector cannot see, so the device held them for good."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import chunkmem
from benchmarks.budget_sweep import h100_rule
from tests import zoo


@pytest.mark.parametrize("steps_before", [0, 2], ids=["warm-up, metered", "after it, lean"])
def test_a_forward_whose_output_is_dropped_without_backward_frees_what_it_saved(sim_memory, steps_before):
    """A loss computed with gradients and then dropped (a skipped NaN loss, evaluation without no_grad): at the
    warm-up, saved tensors are metered; after it, forwards run lean and keep them as they are. Before, each lean
    forward left its activations on the device."""
    arch = zoo.by_name("llama")
    model, batches = arch.build(), arch.batches(2)
    memory = sim_memory(1)
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               chunkmem.Config(device="cpu", device_memory=3_000_000))
    for _ in range(steps_before):
        zoo.loss(cm, batches[0]).backward()
        opt.step()
        opt.zero_grad()
    zoo.loss(cm, batches[1])  # dropped: its graph dies here
    held = memory.allocator.allocated
    for _ in range(3):
        zoo.loss(cm, batches[1])
    assert memory.allocator.allocated == held


def test_after_cudas_error_in_backward_a_smaller_batch_trains_as_plain_pytorch(sim_memory):
    """LLaMA in fp32 at 1% of its model data beside 1.15 x plain's activation peak: in the warm-up's backward a chunk
    finds no room beside the activations (nothing falls back there): refused, naming the bytes. (At 5%, where it
    was a weight's gradient with no block, it trains now that released slots leave the device: arena.py's Note.)
    The user retries with half the batch, as accelerate's find_executable_batch_size does after CUDA's error: the
    failed step's activations are gone with its graph, and training goes on bit-identical to plain PyTorch on the
    smaller batches. Before, they stayed on the device and the retry was refused."""
    arch = zoo.by_name("llama")
    model, batches = arch.build(), arch.batches(3)
    ref = copy.deepcopy(model)
    budget, divisor = h100_rule(model, batches[0], 0.01, sim_memory)
    memory = sim_memory(divisor)
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               chunkmem.Config(device="cpu", device_memory=budget))
    try:  # caught and dropped, as the retrying loop does (pytest.raises would keep the frames, the loss among them)
        zoo.loss(cm, batches[0]).backward()
        refusal = ""
    except chunkmem.MemoryBudgetError as error:
        refusal = str(error)
    assert re.search(r"needs \d+ bytes on the device", refusal), refusal
    assert memory.allocator.allocated == cm.memory_stats()["device_chunk_bytes"], "only chunks left on the device"
    opt.zero_grad()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for batch in batches:
        one = {k: v[:1] for k, v in batch.items()}  # of its two sequences
        for net, optimizer in ((cm, opt), (ref, ref_opt)):
            zoo.loss(net, one).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
