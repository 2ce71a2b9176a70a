"""Communication volume per ZeRO step against the theoretical volume.

    PYTHONPATH=. python benchmarks/zero_comm.py --world 2 3 --json benchmarks/results/zero_comm_cpu.json

Spawns gloo ranks on this machine for each world size and measures one steady step (the third).
Volumes count the full buffer each collective fills (all-gather) or reads (reduce-scatter), so they
do not depend on the world size. Theory for one step, from the parameter counts: every parameter is
all-gathered once in forward and once in backward, every trainable one reduce-scattered once
(parameter bytes, tied weights once). The "padded" ratios divide by the same theory counted in
chunks (every chunk of every group, padding included), which separates the cost of padding from
that of the gather schedule: chunkmem caches the most recent gathered groups, so backward reuses
forward's last gathers (below 1), and re-gathers a group whose buffer was dropped between two of its
backward uses (above 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess

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
    params = list(model.parameters())  # tied weights once
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
    itemsize = store.dtype.itemsize
    if rank == 0:
        out.update(gathered=after["gathered_bytes"] - before["gathered_bytes"],
                   reduced=after["reduce_scatter_bytes"] - before["reduce_scatter_bytes"],
                   gather_theory=2 * sum(p.numel() for p in params) * itemsize,
                   reduce_theory=sum(p.numel() for p in params if p.requires_grad) * itemsize,
                   gather_padded=2 * len(store.groups) * store.chunk_size * itemsize,
                   reduce_padded=sum(1 for g in store.groups if g.trainable) * store.chunk_size * itemsize,
                   model_data_bytes=after["model_data_bytes"], gathered_peak=after["gathered_bytes_peak"])
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


def row(world: int, out: dict) -> dict:
    mib = 2**20
    return {"world": world,
            "all_gather_MiB": round(out["gathered"] / mib, 2), "theory_MiB": round(out["gather_theory"] / mib, 2),
            "gather_ratio": round(out["gathered"] / out["gather_theory"], 3),
            "gather_ratio_padded": round(out["gathered"] / out["gather_padded"], 3),
            "reduce_scatter_MiB": round(out["reduced"] / mib, 2), "rs_theory_MiB": round(out["reduce_theory"] / mib, 2),
            "rs_ratio": round(out["reduced"] / out["reduce_theory"], 3),
            "rs_ratio_padded": round(out["reduced"] / out["reduce_padded"], 3),
            "gathered_peak_MiB": round(out["gathered_peak"] / mib, 2),
            "rank0_model_data_MiB": round(out["model_data_bytes"] / mib, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for world in args.world:
        out = mp.Manager().dict()
        mp.spawn(measure, args=(world, args, free_port(), out), nprocs=world)
        rows.append(row(world, out))
    print(f"GPT-2-style {args.layers}x{args.width}, vocab {args.vocab}, per-rank batch {args.batch}x{args.seq}")
    print(table(rows, list(rows[0])))
    changed = subprocess.run(["git", "status", "--porcelain", "chunkmem"], capture_output=True, text=True).stdout
    write_json(args.json, {"benchmark": "zero_comm", "args": vars(args), "rows": rows,
                           "uncommitted_changes_in_chunkmem": bool(changed.strip())})


if __name__ == "__main__":
    main()
