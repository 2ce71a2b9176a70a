"""benchmarks/host_threads.py: the thread counts it times, and its table on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.host_threads import thread_counts
from chunkmem.memory import native


def test_the_counts_timed_are_one_the_powers_of_two_the_cores_less_one_the_cores_and_torchs(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 12)
    assert thread_counts(16) == [1, 2, 4, 8, 12, 15, 16]
    assert thread_counts(1) == [1, 12]


def test_each_count_gets_a_row_with_both_speeds(tmp_path: Path) -> None:
    if native.load() is None:
        pytest.skip("the native extension could not be built here")
    out = tmp_path / "threads.json"
    subprocess.run([sys.executable, "-m", "benchmarks.host_threads", "--elements", "100000", "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    got = json.loads(out.read_text())
    assert [row["threads"] for row in got["rows"]] == thread_counts(got["cpus"])
    assert all(row["GB/s alone"] > 0 and row["GB/s beside launches"] > 0 for row in got["rows"])
