"""benchmarks/gpu_offload.py in the CPU simulation: the table a GPU session will fill, each row what its run did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_offload import chunkmem_run
from chunkmem.runtime.speeds import SIM_WEIGHT


@pytest.mark.slow
def test_the_speed_table_has_plain_and_a_streaming_row_with_its_bound(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu_offload", "--simulate", "--shares", "0.5,0.5+bytes",
                    "--steps", "3", "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    rows = {row["run"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "50%", "50% bytes"}
    # Homes by time (the native kernel's default), and by bytes alone in the row that asks for it.
    assert (rows["50%"]["raw"]["host_weight"], rows["50% bytes"]["raw"]["host_weight"]) == (SIM_WEIGHT, 0.0)
    plain, streamed = rows["plain"], rows["50%"]
    stages = streamed["raw"]["stages"]
    assert streamed["step s"] == pytest.approx(sum(stages.values()), abs=1e-4)
    assert streamed["raw"]["h2d_per_step"] > 0, "half of the model data on the device: chunks move"
    assert streamed["bound s"] >= plain["step s"] and streamed["vs plain"].endswith("x")
    assert streamed["raw"]["host_update_s"] > 0, "some groups updated on the host and the kernel was timed on them"
    assert streamed["raw"]["oom_fallbacks"] == 0 and 0 < streamed["raw"]["held_over_budget"] <= 1.0, \
        "the budgets columns: the simulated allocator's most reserved bytes within the budget"
    assert streamed["raw"]["replans"] in (0, 1), "its one timed step planned anew at its end, or not"


def test_a_share_names_its_row_its_worker_and_its_budget() -> None:
    peak = {"activations": 100, "model_data": 1000}
    assert chunkmem_run("0.25", 10, peak) == ("25%", "chunkmem", 10 + 115 + 250)
    assert chunkmem_run("0.5+ahead", 0, peak) == ("50% ahead", "chunkmem-ahead", 615)
    assert chunkmem_run("0.1+bytes", 0, peak) == ("10% bytes", "chunkmem-bytes", 215)
    assert chunkmem_run("none", 10, peak) == ("none", "chunkmem", -1)
    with pytest.raises(SystemExit, match="'0.5\\+fast'.*\\+ahead or \\+bytes"):
        chunkmem_run("0.5+fast", 0, peak)
