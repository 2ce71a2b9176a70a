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


@pytest.mark.parametrize("scratch", [True, False])
def test_a_group_homed_for_its_update_leaves_room_for_the_updates_temporaries(scratch: bool, monkeypatch,
                                                                              sim_memory) -> None:
    """planning's Note on update scratch: weighing host updates (a host that updates a byte in the time PCIe moves
    two), the planner homes a group at a quarter of the model data; its update on the device allocates fp32 gradients
    and Adam's temporaries the warm-up never saw (it updated every group on the host). Not counted, the update runs
    out of CUDA's allocator inside the optimizer step, where nothing can fall back; counted, every step trains."""
    from chunkmem.chunks import placement

    if not scratch:
        monkeypatch.setattr(placement, "_update_scratch", lambda group: 0)
    sim_memory(1.0)  # CUDA's caching allocator, at its own sizes
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(time_model.config(8))
    chunk = 4 * max(p.numel() for p in model.parameters()) + 1
    ids = torch.randint(0, 32000 // 8, (1, 64), generator=torch.Generator().manual_seed(0))
    probe = time_model.record(model, ids, None, chunk)
    budget = max(e.nonmodel for e in probe.events) + int(0.25 * sum(probe.sizes.values()))
    if not scratch:
        with pytest.raises(torch.OutOfMemoryError):
            time_model.record(model, ids, budget, chunk, host_weight=2.0)
        return
    recorded = time_model.record(model, ids, budget, chunk, host_weight=2.0)  # three steps
    assert recorded.homes  # updated on the device, beside the room its temporaries took
