"""Does a budget `prepare` accepts train at every step? The zoo swept over budgets, dtypes and chunk sizes.

    CHUNKMEM_SIM_LANDING=wait python -m benchmarks.budget_sweep --json benchmarks/results/budget_sweep_cpu.json

Every tiny architecture of tests/zoo.py (decoders, encoders, seq2seq, vision, BatchNorm, mixture of experts) trains
six steps in the CPU simulation with CUDA's caching allocator modelled (chunkmem/memory/simmemory.py), its sizes
scaled as the model's data is to the 1.16B LLaMA's, under the H100 issue's budget rule: 1.15 x plain PyTorch's
activation peak (measured under the same allocator model, apart from chunkmem) plus a share of the model data. Each
run ends one way: trains (reserved memory within the budget: else "over budget"; and no out-of-memory fallback
after the warm-up step: else "trains, falling back after the warm-up", which the contract forbids), refused (a
MemoryBudgetError, at prepare or in a step: the contract allows it at prepare; in a step it names what to raise),
CUDA's out-of-memory error in a step (what the contract forbids: the user gets the allocator's message, from inside
a phase nothing falls back in), or another error (a bug).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
from collections.abc import Callable

import torch

import chunkmem
from benchmarks.common import table, write_json
from chunkmem.memory.simmemory import SimulatedMemory, Sizes, use_simulated_memory
from tests import zoo

LLAMA_MODEL_DATA = 17.6 * 2**30  # the 1.16B LLaMA's, in fp32 with AdamW: what the allocator's sizes scale against


def plain_activation_peak(model: torch.nn.Module, batch: dict, memory: SimulatedMemory) -> int:
    """What plain PyTorch allocates for one step beyond its parameters (gradients included), under `memory`."""
    plain = copy.deepcopy(model)
    for param in plain.parameters():
        memory.charge(param.data)
    static = memory.allocator.allocated
    memory.allocator.peak_allocated = static
    zoo.loss(plain, batch).backward()
    return memory.allocator.peak_allocated - static


def h100_rule(model: torch.nn.Module, batch: dict, share: float,
              memory_for: Callable[[float], SimulatedMemory]) -> tuple[int, float]:
    """The H100 issue's budget for `model` at `share` of its model data (fp32 parameter, gradient and two AdamW
    states), and the divisor of the allocator's sizes that scales them as its model data is to the 1.16B LLaMA's.
    `memory_for(divisor)`: a fresh allocator model of sizes divided by it (tests: their `sim_memory`)."""
    data = sum(p.numel() for p in model.parameters()) * 16
    divisor = LLAMA_MODEL_DATA / data
    return int(1.15 * plain_activation_peak(model, batch, memory_for(divisor)) + share * data), divisor


def _fresh_memory(divisor: float) -> SimulatedMemory:
    return use_simulated_memory(Sizes.scaled(divisor))


def run(arch: zoo.Arch, dtype: str, share: float, coarse: bool, steps: int) -> dict:
    model, batches = arch.build(), arch.batches(3)
    budget, divisor = h100_rule(model, batches[0], share, _fresh_memory)
    memory = _fresh_memory(divisor)
    chunk = 3 * max(p.numel() for p in model.parameters()) + 1 if coarse else None
    row = {"model": arch.name, "dtype": dtype, "share": share, "chunk": "3 x largest" if coarse else "default",
           "budget KiB": round(budget / 1024, 1)}
    step, phase, warm_up = -1, "prepare", 0
    try:
        cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   chunkmem.Config(device="cpu", device_memory=budget, dtype=dtype, chunk_size=chunk))
        for step in range(steps):
            phase = "forward"
            loss = zoo.loss(cm, batches[step % len(batches)])
            phase = "backward"
            loss.backward()
            phase = "optimizer"
            opt.step()
            opt.zero_grad()
            warm_up = warm_up if step else cm.memory_stats()["oom_fallbacks"]
        stats = cm.memory_stats()
        steady = stats["oom_fallbacks"] - warm_up
        outcome = "over budget" if memory.allocator.peak_reserved > budget else \
            "trains, falling back after the warm-up" if steady else "trains"
        row |= {"fallbacks": stats["oom_fallbacks"], "after warm-up": steady,
                "updates on host": stats["updates_moved_to_host"]}
    except chunkmem.MemoryBudgetError:
        outcome = "refused at prepare" if step < 0 else f"refused in step {step} ({phase})"
    except torch.OutOfMemoryError:
        outcome = f"CUDA OOM in step {step} ({phase})"
    except Exception as error:  # noqa: BLE001 - what the sweep is for: every other ending is a bug to report
        outcome = f"error in step {step} ({phase}): {type(error).__name__}: {error}"[:160]
    reserved = round(memory.allocator.peak_reserved / 1024, 1)
    unknown = {"fallbacks": "-", "after warm-up": "-", "updates on host": "-"}
    return unknown | row | {"outcome": outcome, "reserved KiB": reserved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="all", help="comma-separated tests/zoo.py names, or all")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--shares", default="0.05,0.1,0.25,0.5", help="shares of the model data beside activations")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ["CHUNKMEM_SIM_MEMORY"] = "cuda"  # devices model the allocator (run() gives it each model's sizes)
    archs = zoo.available() if args.models == "all" else [zoo.by_name(n) for n in args.models.split(",")]
    rows = []
    for arch in archs:
        for dtype in args.dtypes.split(","):
            for share in map(float, args.shares.split(",")):
                for coarse in (False, True):
                    rows.append(run(arch, dtype, share, coarse, args.steps))
                    print(f"{arch.name} {dtype} {share} {rows[-1]['chunk']}: {rows[-1]['outcome']}", flush=True)
    columns = ["model", "dtype", "share", "chunk", "budget KiB", "reserved KiB", "fallbacks", "after warm-up",
               "updates on host", "outcome"]
    print(table(rows, columns))
    kinds = collections.Counter(r["outcome"].split(" in step")[0].split(":")[0] for r in rows)
    by_share = {share: collections.Counter(r["outcome"].split(" in step")[0] for r in rows if r["share"] == share)
                for share in map(float, args.shares.split(","))}
    print("outcomes:", dict(kinds))
    for share, counts in by_share.items():
        print(f"  share {share}: {dict(counts)}")
    write_json(args.json, {"benchmark": "budget_sweep", "args": vars(args), "rows": rows, "outcomes": dict(kinds),
                           "by_share": {str(k): dict(v) for k, v in by_share.items()}})


if __name__ == "__main__":
    main()
