"""Several models, one budget: one shared plan against the same memory split between the models by hand.

    CHUNKMEM_SIM_MEMORY=0 python -m benchmarks.several_models --json benchmarks/results/several_models_cpu.json

The DPO scenario of examples/dpo.py (a trained policy, AdamW, and a frozen reference: two tiny LLaMA models, 8 x 128,
transformers configs) in the CPU simulation, with device budgets of the policy's activation peak plus 50% and
25% of both models' data. Per steady step (two warm-up steps first):
  shared: one chunkmem.Manager, one budget and one plan for both models.
  split:  each model under its own runtime (a manager of its own), the policy getting its activations and a
          share s of the model-data room, the reference the rest; s searched over a grid of --splits points
          (a split whose budget a model cannot work in is refused at prepare and skipped). The best split's
          bytes are the reference: what a user who splits the device by hand gets at best.
Bytes are uploads plus downloads (streamed gradients included) summed over the runtimes; step times are wall
clock in the simulation (CPU kernels: the host-side cost, not a GPU's). Target (issue 37): shared moves fewer
bytes than the best split at every budget.

Also the host work other prepared models add to a step: a bf16 MLP of 16 x 64 that fits (tiny tensors: a GPU
would wait on the host), its instructions per step counted by callgrind alone and with two other prepared models
in the process (prepared and stepped once, idle after), the simulation's memory model on (the default).
Target: at most 1.05x the model alone.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import chunkmem
from benchmarks.common import table, write_json

MiB = 2**20
DPO = Path(__file__).resolve().parent.parent / "examples" / "dpo.py"


def load_dpo() -> object:
    """examples/dpo.py as a module: the scenario's models, data and loss are the example's own."""
    spec = importlib.util.spec_from_file_location("dpo_example", DPO)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Run:
    """Two models trained by DPO, under one manager (`split` None) or one manager each."""

    def __init__(self, dpo: object, policy: nn.Module, reference: nn.Module, config: chunkmem.Config,
                 split: tuple[int, int] | None = None) -> None:
        policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
        if split is None:
            shared = chunkmem.Manager(config)
            self.managers = [shared]
            self.policy, self.optimizer = shared.prepare(policy, optimizer)
            self.reference = shared.prepare(reference)
        else:
            own, other = (chunkmem.Manager(_with_budget(config, b)) for b in split)
            self.managers = [own, other]
            self.policy, self.optimizer = own.prepare(policy, optimizer)
            self.reference = other.prepare(reference)
        self.dpo = dpo

    def step(self, pair: tuple[torch.Tensor, torch.Tensor], prompt: int) -> float:
        start = time.perf_counter()
        self.dpo.dpo_loss(self.policy, self.reference, *pair, prompt).backward()  # type: ignore[attr-defined]
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start

    def moved(self) -> int:
        return sum(s["h2d_bytes"] + s["d2h_bytes"] for s in (m.memory_stats() for m in self.managers))


def _with_budget(config: chunkmem.Config, budget: int) -> chunkmem.Config:
    return dataclasses.replace(config, device_memory=budget)


def measure(make: Callable[[], Run], pairs: list, prompt: int, warmup: int = 2) -> dict | None:
    """Bytes and seconds per steady step of a run, or None when prepare refuses its budget."""
    try:
        run = make()
    except chunkmem.MemoryBudgetError:
        return None
    for pair in pairs[:warmup]:
        run.step(pair, prompt)
    before = run.moved()
    seconds = [run.step(pair, prompt) for pair in pairs[warmup:]]
    return {"bytes": (run.moved() - before) / len(seconds), "seconds": statistics.median(seconds)}


def mlp(seed: int, width: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(16)])


def probe(others: int, steps: int) -> None:
    """A bf16 MLP of 16 x 64 (tiny tensors: host work is the step, as on a GPU), prepared and trained `steps`
    steps, with `others` other prepared models in the process (each stepped once, idle after)."""
    config = chunkmem.Config(device="cpu", dtype="bf16")
    x = torch.randn(8, 64)
    prepared = [chunkmem.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-4), config)
                for m in (mlp(seed, 64) for seed in range(1 + others))]
    for model, optimizer in prepared[1:] + prepared[:1] * (3 + steps):  # the others once; the model warms up 3 steps
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def others_overhead(short: int = 10, long: int = 110) -> dict:
    """Instructions per step of the probe's model alone and beside two other prepared models, counted by
    callgrind (repeatable however loaded the machine is): the difference of a long and a short run, so that
    start-up and preparation cancel out. Start-up itself varied by 120M of 19G instructions between two runs
    with Python's hash randomization on, about 4M a step over a difference of 30 steps (12% of one): the hash
    seed is fixed, and the difference is 100 steps."""
    def instructions(others: int, steps: int) -> int:
        command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-m",
                   "benchmarks.several_models", "--probe", str(others), str(steps)]
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONHASHSEED="0"))
        return int(re.findall(r"Collected : (\d+)", done.stderr)[-1])

    per_step = {others: (instructions(others, long) - instructions(others, short)) / (long - short)
                for others in (0, 2)}
    return {"alone_instructions": per_step[0], "with_two_others_instructions": per_step[2],
            "ratio": per_step[2] / per_step[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0.5,0.25", help="shares of both models' data beside activations")
    parser.add_argument("--splits", type=int, default=9, help="grid points of the policy's share in a split")
    parser.add_argument("--steps", type=int, default=5, help="steady steps measured per run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument("--probe", type=int, nargs=2, metavar=("OTHERS", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe(*args.probe)
    if os.environ.get("CHUNKMEM_SIM_MEMORY") != "0":
        raise SystemExit("run with CHUNKMEM_SIM_MEMORY=0: budgets here count chunk bytes and saved activations")

    dpo = load_dpo()
    policy = dpo.tiny_llama(0, layers=args.layers, width=args.width)  # type: ignore[attr-defined]
    reference = copy.deepcopy(policy)
    prompt = 32
    pairs = dpo.preference_pairs(2 + args.steps, 4, prompt, 64)  # type: ignore[attr-defined]
    base = chunkmem.Config(device="cpu", dtype="fp32", chunk_size=dpo.CHUNK)  # type: ignore[attr-defined]
    data = dpo.models_data_bytes(policy, reference, torch.float32)  # type: ignore[attr-defined]
    unbudgeted = Run(dpo, policy, reference, base)
    unbudgeted.step(pairs[0], prompt)
    activations = unbudgeted.policy.runtime.activations.peak
    rows = []
    for share in (float(s) for s in args.budgets.split(",")):
        room = int(share * data)
        budget = activations + room
        shared = measure(lambda: Run(dpo, policy, reference, _with_budget(base, budget)), pairs, prompt)
        splits = {}
        for i in range(1, args.splits + 1):
            s = i / (args.splits + 1)
            split = (activations + int(s * room), room - int(s * room))
            splits[round(s, 3)] = measure(lambda: Run(dpo, policy, reference, base, split), pairs, prompt)
        ran = {s: m for s, m in splits.items() if m is not None}
        best = min(ran, key=lambda s: ran[s]["bytes"]) if ran else None
        row = {"budget": f"{share:.0%}", "budget_mib": round(budget / MiB, 2),
               "shared_mib": round(shared["bytes"] / MiB, 2) if shared else "refused",
               "best_split_mib": round(ran[best]["bytes"] / MiB, 2) if best is not None else "none ran",
               "best_split": best, "splits_refused": len(splits) - len(ran),
               "shared_ms": round(1e3 * shared["seconds"], 1) if shared else "-",
               "best_split_ms": round(1e3 * ran[best]["seconds"], 1) if best is not None else "-"}
        row["shared/best"] = round(shared["bytes"] / ran[best]["bytes"], 3) \
            if shared and best is not None and ran[best]["bytes"] else "-"
        rows.append(row | {"splits": {str(s): m for s, m in splits.items()}})
        print(table([rows[-1]], [c for c in row if c != "splits"]), flush=True)
    overhead = others_overhead()
    print(f"bf16 MLP 16 x 64 step alone {overhead['alone_instructions'] / 1e6:.1f} M instructions, beside two other "
          f"prepared models {overhead['with_two_others_instructions'] / 1e6:.1f} M: {overhead['ratio']:.3f}x")
    write_json(args.json, {"benchmark": "several_models", "args": vars(args), "model_data_bytes": data,
                           "activation_peak_bytes": activations, "rows": rows, "others_overhead": overhead})


if __name__ == "__main__":
    main()
