"""The launches users run: torchrun on one machine, and two "nodes" over loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "zero_torchrun.py"


def torchrun(*args: str, script: tuple[str, ...] = (str(EXAMPLE), "--steps", "3"),
             timeout: int = 60) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", CHUNKMEM_TIMEOUT=str(timeout),
               PYTHONPATH=str(EXAMPLE.parent.parent))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, *script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    return out


def losses(out: str) -> list[str]:
    return re.findall(r"step \d+ loss ([\d.]+)", out)


@pytest.mark.slow
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


FAILS_MID_STEP = """
import time
import torch
import torch.distributed as dist
import chunkmem

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
model, optimizer = chunkmem.prepare(model, torch.optim.AdamW(model.parameters()), chunkmem.Config(device="cpu"))
forwards = []


def fail_in_second_step(*_):
    forwards.append(1)
    if dist.get_rank() == 1 and len(forwards) == 2:
        print(f"failing at {time.time()}", flush=True)
        raise RuntimeError("rank 1 fails in the middle of step 2")


model.module[3].register_forward_hook(fail_in_second_step)
for step in range(3):
    model(torch.randn(4, 32)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.slow
def test_a_rank_raising_mid_step_ends_the_job_within_the_collective_timeout(tmp_path):
    script = tmp_path / "fails_mid_step.py"
    script.write_text(FAILS_MID_STEP)
    timeout = 20
    proc = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), script=(str(script),),
                    timeout=timeout)
    out, _ = proc.communicate(timeout=180)
    ended = time.time()
    assert proc.returncode != 0, out
    assert "RuntimeError: rank 1 fails in the middle of step 2" in out
    failed_at = float(re.search(r"failing at ([\d.]+)", out).group(1))
    assert ended - failed_at < timeout, "the peer waiting in a collective was stopped, not left to time out"


REFUSES_ITS_OPTIMIZER = """
import os, torch, chunkmem
model = torch.nn.Linear(8, 8)
kind = torch.optim.AdamW if os.environ["RANK"] == "0" else torch.optim.RMSprop  # rank 1's is not supported
chunkmem.prepare(model, kind(model.parameters()), chunkmem.Config(device="cpu"))
"""


def test_a_rank_that_refuses_its_optimizer_in_prepare_ends_its_peers_without_torchrun(tmp_path):
    """Launched by setting the environment alone (as mp.spawn or srun do), chunkmem makes the process group: rank 1's
    prepare must raise after joining it, not before, where rank 0 waited for it until the group's timeout."""
    script = tmp_path / "refuses.py"
    script.write_text(REFUSES_ITS_OPTIMIZER)
    port, timeout = free_port(), 120
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                       WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                                       CHUNKMEM_TIMEOUT=str(timeout)))
             for rank in (0, 1)]
    outs = [proc.communicate(timeout=timeout + 60)[0] for proc in procs]
    assert "TypeError" in outs[1] and "RMSprop" in outs[1], outs[1]
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    assert time.monotonic() - start < timeout / 2, "rank 0 waited out the group's timeout"
