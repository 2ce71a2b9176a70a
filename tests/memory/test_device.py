"""Which device a Config names, and the device layer's parts that run without a GPU."""

from __future__ import annotations

import pytest
import torch

from chunkmem.memory import device
from chunkmem.memory.device import check_allocator, cuda_index, make_device, use_device
from chunkmem.memory.sim import SimulatedDevice


@pytest.mark.parametrize("name,env,count,expected", [
    ("cuda:5", {"LOCAL_RANK": "1"}, 8, 5),  # an explicit index wins
    ("cuda", {"LOCAL_RANK": "3"}, 8, 3),  # under torchrun each rank of a node gets its own GPU
    ("cuda", {"LOCAL_RANK": "3"}, 1, 0),  # a scheduler left one GPU visible to this process
])
def test_cuda_means_the_local_ranks_gpu_under_torchrun(name, env, count, expected):
    assert cuda_index(name, env, count) == expected


def test_cuda_without_torchrun_is_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert cuda_index("cuda", {}, 4) == 2


def test_more_ranks_per_node_than_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match=r"LOCAL_RANK='4' and 4 CUDA devices are visible: pass device='cuda:N'"):
        cuda_index("cuda", {"LOCAL_RANK": "4"}, 4)


def test_cpu_is_the_simulation():
    assert use_device("cpu") == torch.device("cpu")
    device = make_device("cpu", "1GiB")
    assert isinstance(device, SimulatedDevice) and device.host_pool.limit == 2**30


def test_a_cuda_device_is_made_current_so_nothing_lands_on_gpu_0(monkeypatch):
    # The GPU test of this (test_cuda.py) cannot fail on a one-GPU machine: here four GPUs are visible and the
    # rank's is the third; NCCL and the allocator's defaults use the current device.
    made_current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert use_device("cuda") == torch.device("cuda", 2)
    assert made_current == [torch.device("cuda", 2)]


def test_a_budget_on_cuda_needs_the_native_caching_allocator():
    check_allocator("native")
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF selects the 'cudaMallocAsync' backend: remove "
                                         "backend:cudaMallocAsync"):
        check_allocator("cudaMallocAsync")


def test_allocator_options_that_change_its_blocks_are_named_under_a_budget(caplog):
    with caplog.at_level("WARNING", logger="chunkmem"):
        check_allocator("native", "max_split_size_mb:128, roundup_power2_divisions:[256:1,512:2],"
                                  "pinned_use_cuda_host_register:True,expandable_segments:True")
        check_allocator("native", "pinned_use_cuda_host_register:True,expandable_segments:False")
        check_allocator("native", "")
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and "sets max_split_size_mb:128, roundup_power2_divisions:[256:1,512:2], " \
        "expandable_segments:True," in named[0]


def test_without_the_copy_engine_a_reading_sees_a_new_peak_since_the_last_one():
    # device.py's peak_reading: a temporary an op made and freed between two readings counts, where the allocator's
    # peak rose (its statistics are not reset: they stay the user's); where it did not, what is held now.
    stats = {"active_bytes.all.current": 100, "inactive_split_bytes.all.current": 20, "active_bytes.all.peak": 150}
    assert device.peak_reading(stats, last_peak=0) == (170, 150)
    assert device.peak_reading(stats, last_peak=150) == (120, 150)
    # The user reset the peak (torch.cuda.reset_peak_memory_stats, as the GPU benchmarks do after prepare): the peak
    # since is below the last one read, and its rise above what is held now is still a temporary's.
    assert device.peak_reading(stats, last_peak=500) == (170, 150)


def test_a_budget_the_cap_refuses_is_not_counted_for_the_next_models(monkeypatch):
    # CudaDevice.limit_memory: a prepare whose budget was refused while capping the allocator (no room beside what the
    # process holds outside it) left its budget among the live ones, and the next model's cap counted it.
    def refuse(index: int, total: int) -> None:
        raise ValueError("no room")

    class Owner:
        pass

    owner, other = Owner(), Owner()
    fake = type("Fake", (), {"torch_device": torch.device("cuda", 7), "total_bytes": lambda self: 1000})()
    monkeypatch.setattr(device, "_BUDGETS", {7: {other: (400, 0)}})
    monkeypatch.setattr(device, "_apply_cap", refuse)
    with pytest.raises(ValueError, match="no room"):
        device.CudaDevice.limit_memory(fake, owner, 900, 0)  # type: ignore[arg-type]
    assert device._BUDGETS[7] == {other: (400, 0)}
    with pytest.raises(ValueError, match="no room"):  # a budget changed and refused: the one before stays
        device.CudaDevice.limit_memory(fake, other, 900, 0)  # type: ignore[arg-type]
    assert device._BUDGETS[7] == {other: (400, 0)}


def test_a_copy_under_cuda_graph_capture_is_refused_with_what_to_do_instead(monkeypatch):
    # A graph would bake the copy streams, slot addresses and host buffers of one step into every replay.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"CUDA graph.*mode='reduce-overhead'.*default mode"):
        device.CudaDevice._copy(None, torch.empty(1), torch.empty(1), None, torch.empty(1))  # type: ignore[arg-type]
