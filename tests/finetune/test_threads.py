"""CPU threads: one pool for torch and chunkmem's kernel, one less than the CPUs by default.

Figures behind the default: `python -m benchmarks.threads` (issue 15, item 10).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chunkmem.finetune.threads import cpu_threads, torch_threads
from chunkmem.memory import native

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_leaves_one_cpu_and_respects_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads(None) == 1 and cpu_threads(2) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cpu_threads(None) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_threads(None) == 15
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice, as torch read it at start-up
    assert cpu_threads(None) == torch.get_num_threads()


def test_threads_are_put_back() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("a run that fails")
    assert torch.get_num_threads() == before


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_the_kernel_runs_in_torchs_pool_not_a_second_one() -> None:
    """The kernel's OpenMP team is sized from torch's thread count and lives in torch's OpenMP runtime,
    so it adds no threads to torch's: measured in a fresh process, where no pool exists yet."""
    if native.load() is None:
        pytest.skip("the native kernel is not built here")
    script = """
import os, torch
torch.set_num_threads(1)
from chunkmem.memory import native
def threads(): return len(os.listdir("/proc/self/task"))
n = 1 << 20
master, grad, a, b = (torch.randn(n) for _ in range(4))
a.zero_(); b.zero_()
before = threads()
native.adam_step(master, grad, a, b, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 decoupled=True, step=1)
gomp = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
print(threads() - before, len(gomp))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    added, runtimes = map(int, done.stdout.split()[-2:])
    assert added == 0 and runtimes == 1
