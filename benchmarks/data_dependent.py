"""Bytes per step for models whose modules depend on the data, against LRU on the same steps.

    python -m benchmarks.data_dependent --json benchmarks/results/data_dependent_cpu.json

A SwitchTransformers mixture of experts (a module per expert, called only for the experts its router
picks) and a BART with layer drop (layers skipped at random) train in the CPU simulation under a device
budget of half their parameter bytes. Steps access different chunks from one step to the next; chunkmem
follows each with a plan made from the step before (chunkmem/chunks/placement.py, Note on following).
Per step, in MiB: chunkmem as measured (h2d + d2h, streamed gradients included), and LRU replayed on that
step's own recorded accesses with chunkmem's homes, in its steady state (benchmarks/policies.py, apart
from chunkmem's planner), so LRU sees each step as if it repeated: a reference it cannot do worse than
for lack of a record. Also: how many steps re-planned, and whether any fell back to the warm-up's
conservative placement.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import chunkmem
import chunkmem.chunks.placement
from benchmarks.common import table, write_json
from benchmarks.placement_problem import Instance
from benchmarks.policies import simulate
from tests import zoo

MiB = 2**20


def run(arch: zoo.Arch, steps: int, fraction: float) -> dict:
    model = arch.build()
    budget = int(sum(p.numel() * p.element_size() for p in model.parameters()) * fraction)
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               chunkmem.Config(device="cpu", device_memory=budget))
    placer = cm.runtime.placer
    recorded: list[list] = []
    done = placer.step_done

    def step_done() -> None:  # keep each step's events, which the placer hands over at its end
        recorded.append(list(placer.events))
        done()

    placer.step_done = step_done  # type: ignore[method-assign]
    rows, phases = [], []
    for i, batch in enumerate(arch.batches(steps)):
        torch.manual_seed(i)
        before = cm.memory_stats()
        phases.append(placer.phase.value)
        zoo.loss(cm, batch).backward()
        opt.step()
        opt.zero_grad()
        after = cm.memory_stats()
        moved = sum(after[k] - before[k] for k in ("h2d_bytes", "d2h_bytes"))
        if i == 0:
            continue  # the warm-up step
        store = cm.runtime.store
        streamed = {g.index: sum(r.param.numel() for r in g.members) * store.dtype.itemsize
                    for g in store.trainable_groups()}
        instance = Instance.from_events(recorded[-1], placer.sizes, placer.groups, budget, streamed=streamed)
        rows.append({"step": i, "chunkmem": moved, "lru": simulate(instance, "lru", placer.homes).bytes})
    return {"model": arch.name, "device_memory": budget, "steps": rows, "phases": phases,
            "replans": placer.replans, "fell_back": "record" in phases[1:] or "diverged" in phases[1:],
            "chunkmem_mean": statistics.mean(r["chunkmem"] for r in rows),
            "lru_mean": statistics.mean(r["lru"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fraction", type=float, default=0.5, help="device budget, of the parameter bytes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = [run(arch, args.steps, args.fraction) for arch in zoo.DATA_DEPENDENT]
    shown = [{"model": r["model"], "steps": len(r["steps"]), "re-planned": r["replans"],
              "fell back": "yes" if r["fell_back"] else "no", "chunkmem MiB/step": f"{r['chunkmem_mean'] / MiB:.3f}",
              "LRU MiB/step": f"{r['lru_mean'] / MiB:.3f}",
              "chunkmem/LRU": f"{r['chunkmem_mean'] / r['lru_mean']:.3f}",
              "steps above LRU": sum(s["chunkmem"] > s["lru"] for s in r["steps"])} for r in results]
    print(table(shown, list(shown[0])))
    write_json(args.json, {"benchmark": "data_dependent", "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
