"""Pipeline throughput in the CPU simulation: K = 2 and 4 chunk-managed stages against one stage.

    python -m benchmarks.pipeline --width 1024 --batch 256 --microbatches 4 --stages 2 \
        --schedules 1f1b,2bw,interleaved,zero-bubble --json benchmarks/results/pipeline_cpu_schedules.json

    python -m benchmarks.pipeline --device-memory 4MiB --json benchmarks/results/pipeline_cpu.json
    python -m benchmarks.pipeline --width 1024 --batch 256 --microbatches 4 \
        --json benchmarks/results/pipeline_cpu_compute_bound.json

Every stage is one process (gloo) with one thread; the baseline is one process with one thread
holding the whole model, prepared by chunkmem, stepping on the whole batch. In the simulation all
stages share the machine's CPU cores (2 here), so K=4 oversubscribes them and no configuration can
show the speed-up K devices would give. The first command is overhead-bound (8-row micro-batches,
and a budget below each stage's model data, so every micro-batch streams its stage's chunks again);
the second is compute-bound (64-row micro-batches, no budget), where stages overlap for real.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import chunkmem
from benchmarks.common import free_port, table, write_json


def build(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())],
                         nn.Linear(width, 16))


def data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, 16, generator=gen)


def config(args: argparse.Namespace) -> chunkmem.Config:
    return chunkmem.Config(device="cpu", device_memory=args.device_memory)


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - any iterable of parameters
    return torch.optim.AdamW(params, lr=1e-3)


def one_stage(args: argparse.Namespace) -> float:
    model = build(args.width, args.depth)
    cm, opt = chunkmem.prepare(model, optimizer(model.parameters()), config(args), group=chunkmem.LOCAL)
    x, y = data(args)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            begin = time.perf_counter()
        nn.functional.mse_loss(cm(x), y).backward()
        opt.step()
        opt.zero_grad()
    return args.steps * args.batch / (time.perf_counter() - begin)


def stage_worker(rank: int, world: int, port: int, args: argparse.Namespace, schedule: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    pipe = chunkmem.pipeline(build(args.width, args.depth), optimizer, nn.functional.mse_loss,
                             n_microbatches=args.microbatches, schedule=schedule, config=config(args))
    x, y = data(args)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            begin = time.perf_counter()
        pipe.step(x, y)
    pipe.flush()  # 2BW: the last mini-batches' backwards and updates are part of the work (else a no-op)
    dist.barrier()
    if rank == 0:
        out["samples_per_s"] = args.steps * args.batch / (time.perf_counter() - begin)
        out["balance"] = pipe.balance
    dist.destroy_process_group()


def pipelined(args: argparse.Namespace, stages: int, schedule: str) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=stage_worker, args=(r, stages, port, args, schedule, out)) for r in range(stages)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=600)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a stage failed: exit codes {[p.exitcode for p in procs]}")
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device-memory", default=None, help="each stage's device budget, e.g. 4MiB")
    parser.add_argument("--stages", default="2,4", help="pipeline depths, e.g. 2,4")
    parser.add_argument("--schedules", default="gpipe,1f1b,2bw", help="any of chunkmem.pipeline's schedules")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [{"stages": 1, "schedule": "-", "balance": [2 * args.depth + 1],
             "samples_per_s": round(one_stage(args), 1)}]
    for stages in map(int, args.stages.split(",")):
        for schedule in args.schedules.split(","):
            result = pipelined(args, stages, schedule)
            rows.append({"stages": stages, "schedule": schedule, "balance": result["balance"],
                         "samples_per_s": round(result["samples_per_s"], 1)})
    for row in rows:
        row["vs_one_stage"] = round(row["samples_per_s"] / rows[0]["samples_per_s"], 2)
    print(table(rows, ["stages", "schedule", "balance", "samples_per_s", "vs_one_stage"]))
    write_json(args.json, {"benchmark": "pipeline", "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
