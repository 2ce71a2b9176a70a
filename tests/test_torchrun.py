"""The launches users run: torchrun on one machine, and two "nodes" over loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.multiproc import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "zero_torchrun.py"


def torchrun(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", CHUNKMEM_TIMEOUT="60",
               PYTHONPATH=str(EXAMPLE.parent.parent))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(EXAMPLE), "--steps", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    return out


def losses(out: str) -> list[str]:
    return re.findall(r"step \d+ loss ([\d.]+)", out)


def test_two_nodes_on_loopback_train_like_one_node_with_two_processes():
    port = free_port()
    nodes = [torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                      "--master-addr", "127.0.0.1", "--master-port", str(port)) for rank in (0, 1)]
    outputs = [finish(node) for node in nodes]
    single = finish(torchrun("--nproc-per-node", "2", "--master-port", str(free_port())))
    assert len(losses(outputs[0])) == 3
    assert losses(outputs[0]) == losses(single)
    shares = re.findall(r"rank (\d)/2: model data (\d+) bytes", "".join(outputs))
    assert sorted(r for r, _ in shares) == ["0", "1"]
