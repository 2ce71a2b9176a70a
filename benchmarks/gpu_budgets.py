"""Budgets on a GPU: the CUDA budgets issue's table, a transformers LLaMA (hidden 2048, 20 layers: 1.16B parameters)
in bf16 with AdamW, batch 4 x 1024, at budgets of what the process holds outside the allocator + 1.15 x the
activation peak of the same step in plain PyTorch + a fraction of the model data.

Each budget runs in a process of its own (the allocator's cap and cache are process-wide) and reports whether
`prepare` accepted it, the out-of-memory fallbacks, what the allocator reserved at most plus what NVML sees
outside it against the budget, and the median step time after the warm-up. `--simulate` runs the same on the CPU
simulation with its allocator model, scaled down 256 times (tests/test_budgets.py's case), where CI can.

    python -m benchmarks.gpu_budgets --json benchmarks/results/gpu_budgets_h100.json
    python -m benchmarks.gpu_budgets --simulate --json benchmarks/results/gpu_budgets_sim.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.common import write_json

SHAPES = {"cuda": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024),
          "cpu": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=20, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=2000, max_position_embeddings=128),
          # launch-bound (issue 36's other size): kernels cost next to nothing, so a GPU waits on the host
          "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=20, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)}
BATCH = {"cuda": (4, 1024), "cpu": (4, 64), "tiny": (1, 16)}
DIVISOR = 256  # the simulation's scale: its allocator's sizes too


def model(device: str, shape: str | None = None) -> torch.nn.Module:
    """The LLaMA of SHAPES[shape] (by default the one for `device`), built on `device`: a CUDA GPU draws the 1.16B
    random weights in a blink, where a CPU core takes half a minute, in each of the benchmark's processes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**SHAPES[shape or device]))


def host_model(device: str, shape: str | None = None) -> torch.nn.Module:
    """model(), on the host (what chunkmem.prepare and FSDP2's CPU offload take), none of it left on the device."""
    net = model(device, shape).cpu()
    if device == "cuda":
        torch.cuda.empty_cache()
    return net


def ids(device: str, shape: str | None = None) -> torch.Tensor:
    vocab = SHAPES[shape or device]["vocab_size"]
    return torch.randint(0, vocab, BATCH[shape or device], generator=torch.Generator().manual_seed(1))


def plain_peak(device: str, shape: str | None = None) -> dict[str, int]:
    """The activation peak of one plain bf16 step (gradients included) and the model data chunkmem keeps."""
    net = model(device, shape).to(torch.bfloat16)
    data = sum(p.numel() for p in net.parameters()) * (2 + 2 + 4 + 4 + 4)  # param, grad, fp32 master, 2 states
    batch = ids(device, shape)
    if device == "cuda":
        net = net.cuda()
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        net(batch.cuda(), labels=batch.cuda()).loss.backward()
        torch.cuda.synchronize()
        return {"activations": torch.cuda.max_memory_allocated() - static, "model_data": data}
    from chunkmem.memory.allocator import Sizes
    from chunkmem.memory.simmemory import use_simulated_memory

    memory = use_simulated_memory(Sizes.scaled(DIVISOR))
    for param in net.parameters():
        memory.charge(param.data)
    static = memory.allocator.allocated
    net(batch, labels=batch).loss.backward()
    return {"activations": memory.allocator.peak_allocated - static, "model_data": data}


def run_budget(device: str, budget: int, steps: int) -> dict[str, Any]:
    """One budget, in this process: train `steps` steps and read what the device really held."""
    import chunkmem
    from chunkmem.memory.gpu_memory import outside_bytes

    net = host_model(device)
    size = sum(p.numel() for p in net.parameters()) // 9 + 1  # 9 parameter chunks, as on the H100 (131M there)
    try:
        cm, opt = chunkmem.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-4), chunkmem.Config(
            device=device, dtype="bf16", device_memory=budget, chunk_size=size))
    except chunkmem.MemoryBudgetError as error:
        return {"accepted": False, "refusal": str(error)[:400]}
    memory = getattr(cm.runtime.device, "memory", None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, batch, error = [], ids(device).to(cm.runtime.device.torch_device), None
    try:
        for _ in range(steps):
            start = time.perf_counter()
            cm(batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as oom:  # what the budget issue saw: accepted, then out of memory
        error = str(oom)[:400]
    stats = cm.memory_stats()
    reserved = torch.cuda.max_memory_reserved() if device == "cuda" else memory.allocator.peak_reserved
    outside = outside_bytes(device)
    return {"accepted": True, "error": error, "steps": len(times), "oom_fallbacks": stats["oom_fallbacks"],
            "max_reserved": reserved, "outside_allocator": outside,
            "held_over_budget": round((reserved + outside) / budget, 4),
            "step_s": round(statistics.median(times[2:]), 4) if len(times) > 2 else None,
            "h2d_bytes_per_step": stats["h2d_bytes"] // max(1, len(times)), "homes": len(cm.runtime.placer.homes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate", action="store_true", help="the CPU simulation, scaled down 256 times")
    parser.add_argument("--fractions", default="1.0,0.5,0.25,0.1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", nargs=3, metavar=("DEVICE", "BUDGET", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        device, budget, steps = args.worker
        print(json.dumps(run_budget(device, int(budget), int(steps))))
        return
    device = "cpu" if args.simulate else "cuda"
    env = dict(os.environ, CHUNKMEM_SIM_MEMORY=f"scale:{DIVISOR}") if args.simulate else dict(os.environ)
    peak = plain_peak(device)
    outside = 0 if args.simulate else _outside_after_a_step()
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = int(outside + 1.15 * peak["activations"] + fraction * peak["model_data"])
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_budgets", "--worker", device, str(budget),
                               str(args.steps)], env=env, capture_output=True, text=True, timeout=1800)
        row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
            {"accepted": None, "crash": done.stderr[-800:]}
        rows.append({"fraction": fraction, "budget": budget, **row})
        print(f"{fraction:>5.2f} {budget / 2**30:7.2f} GiB  " + json.dumps(row), flush=True)
        write_json(args.json, {"benchmark": "gpu_budgets", "plain": peak, "outside_allocator": outside,
                               "device": "CPU simulation (scaled 1/256)" if args.simulate else
                               torch.cuda.get_device_name(), "rows": rows})  # each row as it comes: a time limit


def _outside_after_a_step() -> int:
    """What a process holds outside the allocator once a prepared model has trained (selftest.budget_for's way)."""
    from chunkmem.selftest import budget_for

    return budget_for("cuda", 0) or 0


if __name__ == "__main__":
    main()
