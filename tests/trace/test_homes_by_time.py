"""Homes chosen by time (chunks/planning.py's Note on homes by time): the planner weighs host updates against copies
at the speeds runtime/speeds.py measures, and the time model (trace/timing.py, code apart from the planner's) says
the step it plans is shorter than the one homes by bytes alone make."""

from __future__ import annotations

import pytest
import torch

import chunkmem
from chunkmem.chunks.layout import search_chunk_size
from chunkmem.chunks.planning import update_bytes
from chunkmem.memory import native
from chunkmem.memory.sim import SimulatedDevice
from chunkmem.runtime import speeds
from chunkmem.trace.timing import Recorded, Speeds, predict
from tests.helpers import tiny_gpt2

transformers = pytest.importorskip("transformers")
time_model = pytest.importorskip("benchmarks.time_model")

NARROW = 16  # benchmarks/time_model.py's LLaMA, 16 times narrower: 9 chunk groups, a step in a tenth of a second
H200 = Speeds(h2d=52.9e9, d2h=52.9e9, host_update=52.9e9 / speeds.SIM_WEIGHT, device_update=700e9,
              compute={"fwd": 0.035, "bwd": 0.062}, host={})  # the lent H200's, whose ratio the simulation plans by


def hosted_bytes(recorded: Recorded) -> float:
    return sum(update_bytes(g, recorded.sizes) for g in recorded.groups if g.index not in recorded.homes)


def test_weighing_host_updates_homes_more_and_the_time_model_predicts_a_shorter_step() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(time_model.config(NARROW))
    chunk = search_chunk_size([(n, p.numel()) for n, p in model.named_parameters()])
    ids = torch.randint(0, 32000 // NARROW, (1, 32), generator=torch.Generator().manual_seed(0))
    probe = time_model.record(model, ids, None, chunk)
    # 30%: room to home a group or two beside their updates' temporaries (planning's Note on update scratch)
    budget = max(e.nonmodel for e in probe.events) + int(0.3 * sum(probe.sizes.values()))
    by_bytes = time_model.record(model, ids, budget, chunk, host_weight=0.0)
    by_time = time_model.record(model, ids, budget, chunk, host_weight=speeds.SIM_WEIGHT)
    assert by_time.homes != by_bytes.homes and hosted_bytes(by_time) < hosted_bytes(by_bytes)
    bytes_step, time_step = predict(by_bytes, H200), predict(by_time, H200)
    # Each choice wins by its own measure: bytes alone move fewer bytes, and homes by time make the shorter step.
    assert bytes_step.h2d_bytes + bytes_step.d2h_bytes <= time_step.h2d_bytes + time_step.d2h_bytes
    assert time_step.step_s < bytes_step.step_s and time_step.host_update_s < bytes_step.host_update_s


@pytest.mark.parametrize("native_optimizer,weight", [(True, speeds.SIM_WEIGHT), (False, 0.0)])
def test_the_simulation_plans_by_the_h200s_speeds_with_the_native_kernel_and_by_bytes_without(
        native_optimizer: bool, weight: float) -> None:
    if native_optimizer and native.load() is None:
        pytest.skip("the native extension could not be built here")
    model = tiny_gpt2()
    data = sum(p.numel() for p in model.parameters()) * 16
    cm, _ = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()),
                             chunkmem.Config(dtype="bf16", device_memory=data // 2, native_optimizer=native_optimizer))
    assert cm.runtime.placer.host_weight == weight


def test_measured_speeds_are_those_of_the_kernel_and_of_a_copy() -> None:
    if native.load() is None:
        pytest.skip("the native extension could not be built here")
    # Bounds no machine is outside of: at least 100 MB/s, less than the 10 TB/s no memory system reaches.
    assert 1e8 < speeds.update_speed() < 1e13
    assert 1e8 < speeds.copy_speed(SimulatedDevice()) < 1e13


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_scratch_a_plan_leaves_a_homed_update_covers_what_the_update_allocates(dtype: str, sim_memory) -> None:
    """planning's Note on update scratch: the warm-up updates every group on the host and never sees what a group
    homed later allocates for its update on the device (fp32 gradients, Adam's temporaries). The room the plan leaves
    for it (GroupChunks.scratch) is held here against what CUDA's allocator model counts during each group's update."""
    memory = sim_memory(1.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(time_model.config(NARROW))
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                               chunkmem.Config(dtype=dtype, native_optimizer=False))
    ids = torch.randint(0, 32000 // NARROW, (1, 32), generator=torch.Generator().manual_seed(0))
    placer = cm.runtime.placer
    assert placer.all_homed and all(g.scratch > 0 for g in placer.groups)
    for _ in range(2):
        cm(ids, labels=ids).loss.backward()
        allocator = memory.allocator
        allocator.peak_allocated = before = allocator.allocated
        opt.step()
        opt.zero_grad()
    largest = max(g.scratch for g in placer.groups)
    assert largest // 2 < allocator.peak_allocated - before <= largest
