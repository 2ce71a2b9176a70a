"""`chunkmem selftest` as far as it runs without a GPU: the simulation's check, the table and the JSON,
GPU checks reported as skipped, and the arithmetic of the overlap measurement."""

from __future__ import annotations

import json

import pytest
import torch

from chunkmem import cli, selftest
from chunkmem.chunks.chunk import Chunk

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the selftest itself")


def test_without_a_gpu_the_simulation_runs_and_the_gpu_checks_say_they_need_one(tmp_path, capsys):
    assert cli.main(["selftest", "--json", str(tmp_path / "report.json")]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {row["check"]: row for row in report["checks"]}
    assert rows["simulation"]["status"] == "pass"
    assert all(f["bit_identical"] for f in rows["simulation"]["figures"].values())
    gpu = [name for name, needs_gpu, _ in selftest.CHECKS if needs_gpu]
    assert gpu and all(rows[name]["status"] == "skipped" and rows[name]["detail"] == selftest.NEEDS_GPU for name in gpu)
    assert report["machine"]["torch"] == torch.__version__ and "selftest" in report["command"]
    assert "no CUDA GPU here: 6 checks need one" in capsys.readouterr().out


def test_require_gpu_fails_without_one_and_unknown_checks_are_named():
    assert cli.main(["selftest", "--only", "simulation", "--require-gpu"]) == 0
    assert cli.main(["selftest", "--only", "nccl", "--require-gpu"]) == 1
    assert cli.main(["selftest", "--only", "warp drive"]) == 2
    # A --json path it cannot write is refused before the checks run (it raised once they had all run: minutes on a GPU)
    for path in ("/no/such/folder/report.json", "/tmp"):
        assert cli.main(["selftest", "--only", "nccl", "--json", path]) == 2


def test_the_simulation_check_fails_when_a_fence_is_missing(monkeypatch):
    monkeypatch.setattr(Chunk, "fence", lambda self: self._device)  # compute skips every upload's wait
    row = next(selftest.run_checks(["simulation"]))
    assert row.status == "fail" and "HazardError" in row.detail


def test_overlap_is_the_share_of_copy_time_under_some_kernel():
    kernels = selftest._union([(0, 10), (5, 20), (30, 40)])
    assert kernels == [(0, 20), (30, 40)]
    assert selftest._overlap((15, 35), kernels) == 5 + 5
    assert selftest._overlap((20, 30), kernels) == 0


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_the_reserved_memory_checks_worker_holds_its_budget_in_the_simulation(sim_memory, fraction):
    # The GPU check's own set-up, in the simulated allocator (CUDA's sizes): a broken construction shows here.
    sim_memory(1)
    figures = selftest.budget_worker(fraction, "cpu")
    assert figures["oom_fallbacks"] == 0 and figures["h2d_bytes"] > 0, "it trains, and chunks move"
    assert 0.5 < selftest.reserved_over_budget(figures) <= 1.0, figures


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_the_parity_checks_budgets_train_and_stream_in_the_simulation(sim_memory, fraction):
    # The lent H200 ran out of memory here at 0.5: a 1 MiB block took a 20 MiB segment the budget had no room for.
    sim_memory(1)
    reference, data = selftest.parity_setup()
    cm, losses = selftest.parity_run(reference, fraction, "cpu", data)
    stats = cm.memory_stats()
    assert len(losses) == len(data) and stats["oom_fallbacks"] == 0
    assert stats["lean_forwards"] > 0 and stats["h2d_bytes"] > 0, "it streams"
