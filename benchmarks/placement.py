"""Bytes per steady step against the exact optimum: chunkmem's plan, LRU, Belady, the optimum and a bound.

    python -m benchmarks.placement --json benchmarks/results/placement_cpu.json

GPT-2 and LLaMA (transformers configs, 4 layers x 256, vocab 1024) and a 16 x 1024 MLP (`--models mlp`)
train in the CPU simulation, fp32 and bf16, at the default chunk size and at the smallest one allowed (the largest parameter's
elements), with device budgets of the activation peak plus 75/50/30/20% of the model data. Each run's
warm-up record (benchmarks/record.py) is the instance; every column counts the same bytes per steady
step: fetches, write-backs and streamed gradients.
  chunkmem: measured on the runtime, memory_stats() h2d + d2h over steady steps (d2h includes
            the streamed gradients).
  LRU, Belady: benchmarks/policies.py on the recorded step, with chunkmem's homes (Belady looks
            into the next step).
  optimum:  benchmarks/optimum.py's integer program, homes chosen too; "<=" marks the best found
            within --time-limit when not proven optimal.
  bound:    the program's linear relaxation, below any schedule.
`--accumulate K`: every step is K backward passes (gradient accumulation); a streamed group sends its gradients
in each. These are the rows where write-backs happen (a homed group's gradient chunk leaving between passes):

    python -m benchmarks.placement --accumulate 2 --json benchmarks/results/placement_cpu_accumulate2.json

Also: the optimum with chunkmem's homes (what eviction alone could save), how many groups each homed,
and the share of chunkmem's uploads sent ahead of the access that needs them (prefetched, so the copy
overlaps compute; the rest compute waits for). The JSON splits the optimum's bytes into fetched,
written back and streamed. Target (issue 14): chunkmem within 1.05x of the optimum on every row, and
never above LRU.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import chunkmem
from benchmarks.common import gpt2, table, write_json
from benchmarks.optimum import Solution, lower_bound, solve
from benchmarks.placement_problem import Instance, replay
from benchmarks.policies import simulate
from benchmarks.record import Recorded, record

MiB = 2**20


def llama(layers: int, width: int, vocab: int, positions: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3 // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=max(1, width // 64),
                         num_key_value_heads=max(1, width // 128), max_position_embeddings=positions,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def mlp(layers: int, width: int, vocab: int, positions: int) -> torch.nn.Module:
    """benchmarks/overhead.py's MLP: 16 Linear+GELU blocks, four times the transformers' width (1024 by
    default), one chunk group per layer. The layers, vocab and positions of the transformers do not apply."""
    from benchmarks.overhead import mlp as blocks

    return blocks(16, 4 * width)


MODELS: dict[str, Callable[[int, int, int, int], torch.nn.Module]] = {"gpt2": gpt2, "llama": llama, "mlp": mlp}


def loss_of(name: str, args: argparse.Namespace) -> Callable[[torch.nn.Module], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if name == "mlp":
        inputs = torch.randn(args.batch * 16, 4 * args.width, generator=gen)
        return lambda m: m(inputs.to(next(m.parameters()).dtype)).float().square().mean()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return lambda m: m(ids, labels=ids).loss


def measure(recorded: Recorded, time_limit: float) -> dict:
    """Every column of one row, in bytes per steady step."""
    instance, homes = recorded.instance, recorded.homes
    best = solve(instance, time_limit=time_limit)
    theirs = solve(instance, homes=homes, time_limit=time_limit)
    refs = {rule: simulate(instance, rule, homes) for rule in ("lru", "belady")}
    out = {"chunkmem": statistics.mean(recorded.measured), "chunkmem_steps": list(recorded.measured),
           "lru": refs["lru"].bytes, "belady": refs["belady"].bytes, "optimum": best.per_step,
           "optimum_proven": best.optimal, "optimum_bound": best.bound, "optimum_seconds": round(best.seconds, 2),
           "bound": lower_bound(instance), "optimum_chunkmem_homes": theirs.per_step,
           "h2d_bytes": recorded.uploaded, "prefetched_bytes": recorded.prefetched,
           "streamed_chunkmem": recorded.streamed, "streamed_optimum": instance.streamed(best.homes),
           "homes_chunkmem": sorted(homes), "homes_optimum": sorted(best.homes),
           "groups": len(instance.groups), "events": len(instance.accesses),
           "periods": {rule: ref.period for rule, ref in refs.items()}}
    cycles = {ref.period for ref in refs.values()} - {1}  # a reference that repeats every p steps
    out["optimum_per_period"] = {p: solve(instance, time_limit=time_limit, period=p).per_step for p in sorted(cycles)}
    return out | {"split_optimum": replay_cycle(instance, best)}


def replay_cycle(instance: Instance, best: Solution) -> dict:
    """The optimum's bytes per step split into fetched, written back and streamed."""
    once = replay(instance, best.homes, best.start, best.schedule)
    device = replay(instance, best.homes, best.start, best.schedule, once.dirty & best.start)
    return {"h2d": device.h2d, "d2h": device.d2h, "streamed": instance.streamed(best.homes)}


def display(row: dict) -> dict:
    mib = {k: f"{row[k] / MiB:.2f}" for k in ("chunkmem", "lru", "belady", "bound", "optimum_chunkmem_homes")}
    optimum = f"{row['optimum'] / MiB:.2f}" if row["optimum_proven"] else f"<={row['optimum'] / MiB:.2f}"
    return {"model": row["model"], "dtype": row["dtype"], "chunk": row["chunk"], "groups": row["groups"],
            "budget": f"{row['fraction']:.0%}", "chunkmem": mib["chunkmem"], "LRU": mib["lru"],
            "Belady": mib["belady"], "optimum": optimum, "bound": mib["bound"],
            "chunkmem/opt": f"{row['chunkmem'] / row['optimum']:.3f}" if row["optimum"] else "1.000",
            "opt, chunkmem's homes": mib["optimum_chunkmem_homes"],
            "homes chunkmem/opt": f"{len(row['homes_chunkmem'])}/{len(row['homes_optimum'])}",
            "prefetched": f"{row['prefetched_bytes'] / max(1, row['h2d_bytes']):.0%}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--chunks", nargs="+", default=["default", "small"], choices=["default", "small"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.75, 0.5, 0.3, 0.2])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--accumulate", type=int, default=1, help="backward passes per step")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per integer program")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = []
    for name in args.models:
        model, loss = MODELS[name](args.layers, args.width, args.vocab, args.seq), loss_of(name, args)
        smallest = max(p.numel() for p in model.parameters())
        for dtype in args.dtypes:
            for chunk in args.chunks:
                config = dict(device="cpu", dtype=dtype, chunk_size=smallest if chunk == "small" else None)
                probe = record(model, loss, chunkmem.Config(**config), steady_steps=1)
                for fraction in args.fractions:
                    budget = probe.activation_peak + int(probe.model_data * fraction)
                    recorded = record(model, loss, chunkmem.Config(**config, device_memory=budget),
                                      accumulate=args.accumulate)
                    row = {"model": name, "dtype": dtype, "accumulate": args.accumulate, "chunk": chunk if chunk == "default" else smallest,
                           "fraction": fraction, "device_memory": budget, "model_data": probe.model_data,
                           "activation_peak": probe.activation_peak} | measure(recorded, args.time_limit)
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in display(row).items()), flush=True)
    shown = [display(r) for r in rows]
    print(table(shown, list(shown[0])))
    worst = max(rows, key=lambda r: r["chunkmem"] / r["optimum"] if r["optimum"] else 1.0)
    print(f"worst chunkmem/optimum: {worst['chunkmem'] / worst['optimum']:.3f} ({worst['model']} {worst['dtype']} "
          f"chunk {worst['chunk']} at {worst['fraction']:.0%}); rows above LRU: "
          f"{sum(r['chunkmem'] > r['lru'] for r in rows)} of {len(rows)}")
    write_json(args.json, {"benchmark": "placement", "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
