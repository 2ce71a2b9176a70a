"""Step time under chunkmem (everything fitting) against plain PyTorch, and bytes moved per budget.

    python benchmarks/overhead.py --json benchmarks/results/overhead_cpu.json

Runs alternate chunkmem and plain steps in one process so that drift on a noisy machine hits both.
Traffic is measured on a steady-state step with device_memory = activation peak + a share of the
parameter bytes, so the share is what chunks get.
Target (issue 2): at most 1.10x plain PyTorch in the CPU simulation.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import chunkmem
from benchmarks.common import gpt2, table, timed, write_json


def step_fn(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor):
    def step() -> None:
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    base = gpt2(args.layers, args.width, args.vocab, args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    param_bytes = sum(p.numel() * 4 for p in base.parameters())

    plain = copy.deepcopy(base).to(args.device)
    plain_step = step_fn(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4), ids.to(args.device))
    wrapped = copy.deepcopy(base)
    wrapped, opt = chunkmem.prepare(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4),
                                    chunkmem.Config(device=args.device))
    chunk_step = step_fn(wrapped, opt, ids)
    plain_step(), chunk_step()  # warm-up: allocator, first-touch, chunkmem's first iteration
    plain_times, chunk_times = [], []
    for _ in range(args.steps):
        plain_times.append(timed(plain_step))
        chunk_times.append(timed(chunk_step))
    ratio = statistics.median(chunk_times) / statistics.median(plain_times)

    # device_memory covers chunks and non-model data: budgets are the activation peak plus a share of params.
    activations = wrapped.runtime.activations.peak
    traffic = []
    for fraction in (1.0, 0.5, 0.25):
        model = copy.deepcopy(base)
        model, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), chunkmem.Config(
            device=args.device, device_memory=activations + int(param_bytes * fraction)))
        step = step_fn(model, opt, ids)
        step(), step()  # warm-up, then the first step on the plan
        before = model.memory_stats()
        step_time = timed(step)
        after = model.memory_stats()
        traffic.append({"chunk budget": f"{fraction:.0%} of params", "device_memory": activations + int(param_bytes * fraction),
                        "h2d_MiB_per_step": round((after["h2d_bytes"] - before["h2d_bytes"]) / 2**20, 2),
                        "d2h_MiB_per_step": round((after["d2h_bytes"] - before["d2h_bytes"]) / 2**20, 2),
                        "step_s": round(step_time, 3),
                        "peak_within_limit": after["device_chunk_bytes_peak"] <= after["device_limit_bytes"]})

    print(f"GPT-2-style {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, "
          f"{param_bytes / 2**20:.0f} MiB of fp32 parameters, activation peak {activations / 2**20:.0f} MiB, "
          f"device {args.device}")
    print(f"median step: plain {statistics.median(plain_times):.3f}s, chunkmem {statistics.median(chunk_times):.3f}s,"
          f" ratio {ratio:.3f} (target <= 1.10)")
    print(table(traffic, list(traffic[0])))
    write_json(args.json, {"benchmark": "overhead", "args": vars(args), "plain_s": plain_times,
                           "chunkmem_s": chunk_times, "ratio_median": ratio, "traffic": traffic})


if __name__ == "__main__":
    main()
