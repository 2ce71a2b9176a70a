"""Communication volume per ZeRO step against the theoretical volume.

    python benchmarks/zero_comm.py --world 2 --json benchmarks/results/zero_comm_cpu.json

Spawns `--world` gloo ranks on this machine. Theory for one step: every parameter chunk group is
all-gathered once in forward and once in backward, and every gradient group reduce-scattered once
(bytes counted as the full buffer of world-size chunks each collective fills or reads). chunkmem
caches the two most recent gathered groups, so backward can reuse forward's last gathers (ratio
below 1), and re-gathers a group whose buffer was dropped between two of its backward uses (above 1).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import chunkmem
from benchmarks.common import free_port, gpt2, table, write_json


def measure(rank: int, world: int, args: argparse.Namespace, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = gpt2(args.layers, args.width, args.vocab, args.seq)
    model, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), chunkmem.Config(device="cpu"))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step(), step()
    before = model.memory_stats()
    step()
    after = model.memory_stats()
    store = model.runtime.store
    param_bytes = len(store.groups) * store.chunk_size * store.dtype.itemsize
    grad_bytes = sum(1 for g in store.groups if g.trainable) * store.chunk_size * store.dtype.itemsize
    if rank == 0:
        out.update(gathered=after["gathered_bytes"] - before["gathered_bytes"],
                   reduced=after["reduce_scatter_bytes"] - before["reduce_scatter_bytes"],
                   gather_theory=2 * param_bytes, reduce_theory=grad_bytes,
                   model_data_bytes=after["model_data_bytes"])
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = mp.Manager().dict()
    mp.spawn(measure, args=(args.world, args, free_port(), out), nprocs=args.world)
    row = {"world": args.world,
           "all_gather_MiB": round(out["gathered"] / 2**20, 2), "theory_MiB": round(out["gather_theory"] / 2**20, 2),
           "gather_ratio": round(out["gathered"] / out["gather_theory"], 3),
           "reduce_scatter_MiB": round(out["reduced"] / 2**20, 2), "rs_theory_MiB": round(out["reduce_theory"] / 2**20, 2),
           "rs_ratio": round(out["reduced"] / out["reduce_theory"], 3),
           "rank0_model_data_MiB": round(out["model_data_bytes"] / 2**20, 2)}
    print(f"GPT-2-style {args.layers}x{args.width}, vocab {args.vocab}, per-rank batch {args.batch}x{args.seq}")
    print(table([row], list(row)))
    write_json(args.json, {"benchmark": "zero_comm", "args": vars(args), "row": row})


if __name__ == "__main__":
    main()
