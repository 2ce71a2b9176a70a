"""GPU speed (issue 36) and budgets (issue 34): plain PyTorch, chunkmem without a budget and at shares of the model
data, FSDP2's CPU offload and chunkmem in the memory FSDP2 held, side by side in one run on one GPU, with each row's
stages, its lower bound, its out-of-memory fallbacks and what the device held (the allocator's most reserved bytes
plus what NVML sees outside it) against its budget. Bytes moved are the timed steps' (after the warm-up and the
first step on the plan). `--shape tiny` runs a launch-bound LLaMA (20 layers, 64 wide, 1 x 16 tokens) instead.

    python -m benchmarks.gpu_offload --json benchmarks/results/gpu_offload_h100.json   # on a GPU
    python -m benchmarks.gpu_offload --simulate                                        # the CPU simulation

The model and batch are benchmarks/gpu_budgets.py's (LLaMA 1.16B, bf16 AdamW, 4 x 1024 on CUDA; its 256x smaller
twin in the simulation), and so are the budgets: outside the allocator + 1.15 x plain's activation peak + a share
of the model data. plain: fp32 weights under autocast(bfloat16); AdamW(fused=True) on CUDA, for both. Each run takes
--steps steps, the first two warm-up; the median of the rest, with forward, backward and optimizer timed apart
(the device synchronized between them, which costs the overlap across stages a step would have).

A row's lower bound (issue 36, target 2): the longest of the plain step, the host update alone and the bytes moved
at the copy bandwidth. The host update alone is the native kernel timed on the chunk groups that updated on the
host in the row's last step (their sizes, fresh tensors, this process's threads); the bandwidth is a pinned
256 MiB copy each way, measured here. Each run is a process of its own (the allocator's cap is process-wide).
Not measured here: the overlap of copies with compute (the time model predicts it: benchmarks/time_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import table, write_json
from benchmarks.gpu_budgets import DIVISOR, held_after_a_step, host_model, ids, model, plain_peak
from chunkmem.memory.gpu_memory import outside_bytes

STAGES = ("fwd", "bwd", "optim")


def timed(step: Callable[[str], None], steps: int, device: str, warmup: int = 2) -> dict[str, float]:
    """Median seconds per stage over the steps after `warmup` ones; `step(stage)` runs one stage."""
    laps: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for _ in range(steps):
        for stage in STAGES:
            start = time.perf_counter()
            step(stage)
            if device == "cuda":
                torch.cuda.synchronize()
            laps[stage].append(time.perf_counter() - start)
    return {stage: statistics.median(values[warmup:] or values) for stage, values in laps.items()}


def stages_of(forward: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[str], None]:
    """One stage of a training step at a time: the loss, its backward, the optimizer's step."""
    state: dict[str, torch.Tensor] = {}

    def step(stage: str) -> None:
        if stage == "fwd":
            state["loss"] = forward()
        elif stage == "bwd":
            state.pop("loss").backward()
        else:
            optimizer.step()
            optimizer.zero_grad()
    return step


def run_plain(device: str, steps: int, shape: str | None) -> dict[str, Any]:
    net = model(device, shape).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device == "cuda")
    batch = ids(device, shape).to(device)

    def forward() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            return net(batch, labels=batch).loss
    return {"stages": timed(stages_of(forward, optimizer), steps, device)}


def run_chunkmem(device: str, budget: int | None, steps: int, shape: str | None, ahead: bool = False,
                 by_bytes: bool = False) -> dict[str, Any]:
    """The speed figures, and the CUDA budgets issue's: what the device held at most (the allocator's reserved
    bytes, or the simulated allocator's, plus what NVML sees outside it) against the budget. `ahead`: host updates
    made ahead of step() (Config.overlap_update, with the native kernel). `by_bytes`: homes chosen by bytes moved
    alone, as before they were chosen by time (chunks/planning.py's Note on homes by time)."""
    import chunkmem

    net = host_model(device, shape)
    size = sum(p.numel() for p in net.parameters()) // 9 + 1  # 9 parameter chunks, as on the H100 (131M there)
    adamw = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device == "cuda")  # as plain's
    try:
        # The native host update on CUDA is the default; in the simulation too, so that rows with and without updates
        # made ahead (which need it) compare.
        cm, optimizer = chunkmem.prepare(net, adamw, chunkmem.Config(device=device, dtype="bf16", device_memory=budget,
                                                                     chunk_size=size, native_optimizer=True,
                                                                     overlap_update=ahead))
    except chunkmem.MemoryBudgetError as error:
        return {"refused": str(error)[:300]}
    if by_bytes:
        cm.runtime.placer.host_weight = 0.0
    batch = ids(device, shape).to(cm.runtime.device.torch_device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step, timed_steps, before = stages_of(lambda: cm(batch, labels=batch).loss, optimizer), max(1, steps - 2), None
    try:
        timed(step, 2, device, warmup=0)  # the warm-up and the first step on its plan
        before, worker, replans = cm.memory_stats(), cm.runtime.ahead, cm.runtime.placer.replans
        worked = (worker.busy_s, worker.hidden_s) if worker is not None else (0.0, 0.0)
        got: dict[str, Any] = {"stages": timed(step, timed_steps, device, warmup=0)}
        if worker is not None:  # the share of the worker's host updates that ran before backward ended
            busy = worker.busy_s - worked[0]
            got["ahead_hidden_share"] = (worker.hidden_s - worked[1]) / busy if busy else None
            got["ahead_busy_s"] = busy / timed_steps  # a step's: its updates, and its waits for their downloads
    except torch.OutOfMemoryError as error:  # what the budgets issue saw: accepted, then out of memory
        got = {"error": str(error)[:300], "where": traceback.format_exc(limit=-4)[-1500:]}
    stats, placer, memory = cm.memory_stats(), cm.runtime.placer, getattr(cm.runtime.device, "memory", None)
    if before:  # timed steps planned anew at their end (a Python pass over every access): the allocator's readings
        got["replans"] = placer.replans - replans  # moved beyond the margin, or the accesses changed
    moved = {key: (stats[key] - before[key]) / timed_steps if before else None for key in ("h2d_bytes", "d2h_bytes")}
    reserved = torch.cuda.max_memory_reserved() if device == "cuda" else memory.allocator.peak_reserved if memory \
        else 0
    hosted = [sum(r.slot.numel for r in g.members) for g in cm.runtime.store.trainable_groups()
              if not placer.homed(g.index)]
    held = reserved + outside_bytes(device)
    return got | {"h2d_per_step": moved["h2d_bytes"], "d2h_per_step": moved["d2h_bytes"],
                  "oom_fallbacks": stats["oom_fallbacks"], "host_update_s": host_update_alone(hosted, size),
                  "max_reserved": reserved, "held": held, "held_over_budget": held / budget if budget else None,
                  "homes": len(placer.homes), "groups": len(hosted) + len(placer.homes),
                  "host_weight": placer.host_weight,  # the planner's (planning's Note on homes by time)
                  "ahead_adopted": stats["ahead_adopted"], "ahead_redone": stats["ahead_redone"],
                  "ahead_rested": stats["ahead_rested"]}


def host_update_alone(sizes: list[int], chunk: int) -> float:
    """Seconds the native AdamW kernel takes over chunks of these groups (fp32 master and states, bf16 gradient
    and parameter out), on fresh host tensors, with this process's threads; 0 without the native kernel."""
    from chunkmem.memory import native

    if not sizes or native.load() is None:
        return 0.0
    master, first, second = (torch.zeros(chunk) for _ in range(3))
    grad, out = torch.zeros(chunk, dtype=torch.bfloat16), torch.zeros(chunk, dtype=torch.bfloat16)
    start = time.perf_counter()
    for numel in sizes:
        native.adam_step(master[:numel], grad[:numel], first[:numel], second[:numel], out[:numel], lr=1e-4,
                         beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, step=1)
    return time.perf_counter() - start


def run_fsdp2(device: str, steps: int, shape: str | None) -> dict[str, Any]:
    """FSDP2 `fully_shard` with CPUOffloadPolicy(pin_memory=True) on one rank: the peer at equal memory."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("FSDP_PORT", "29533"))
    dist.init_process_group("nccl", rank=0, world_size=1)
    net = host_model(device, shape)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in net.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=policy)
    fully_shard(net, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=policy)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    batch = ids(device, shape).to(device)
    torch.cuda.reset_peak_memory_stats()
    stages = timed(stages_of(lambda: net(batch, labels=batch).loss, optimizer), steps, device)
    return {"stages": stages, "holds": torch.cuda.max_memory_reserved() + outside_bytes(device)}


def bandwidth(device: str) -> float:
    """Bytes per second of a pinned 256 MiB copy, the slower way (the simulation: a nominal 25 GB/s)."""
    if device != "cuda":
        return 25e9
    host = torch.empty(2**28, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    speeds = []
    for copy in (lambda: dev.copy_(host, non_blocking=True), lambda: host.copy_(dev, non_blocking=True)):
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        speeds.append(host.numel() / (time.perf_counter() - start))
    return min(speeds)


def worker(kind: str, device: str, budget: int, steps: int, shape: str | None) -> dict[str, Any]:
    if kind == "plain":
        return run_plain(device, steps, shape)
    if kind == "fsdp2":
        return run_fsdp2(device, steps, shape)
    return run_chunkmem(device, budget if budget >= 0 else None, steps, shape, ahead=kind == "chunkmem-ahead",
                        by_bytes=kind == "chunkmem-bytes")


VARIANTS = {"": "chunkmem", "ahead": "chunkmem-ahead", "bytes": "chunkmem-bytes"}  # a share's suffix after '+'


def chunkmem_run(share: str, outside: int, peak: dict[str, int]) -> tuple[str, str, int]:
    """The row a --shares entry asks for: its name, its worker's kind and its budget (-1: none)."""
    base, _, variant = share.partition("+")
    if variant not in VARIANTS:
        raise SystemExit(f"--shares entry {share!r}: expected a share, optionally followed by +ahead or +bytes")
    if base == "none":
        return "none", VARIANTS[variant], -1
    budget = int(outside + 1.15 * peak["activations"] + float(base) * peak["model_data"])
    return f"{float(base):.0%}{' ' * bool(variant)}{variant}", VARIANTS[variant], budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulate", action="store_true", help="the CPU simulation, scaled down 256 times")
    parser.add_argument("--shares", default="none,0.5,0.25,0.1",
                        help="'none' or shares of the model data; a share ending in '+ahead' runs with host updates "
                             "made ahead of step() (Config.overlap_update), one ending in '+bytes' with homes chosen "
                             "by bytes alone rather than by time")
    parser.add_argument("--shape", choices=("tiny",), default=None,
                        help="tiny: a launch-bound LLaMA (20 layers 64 wide, 1 x 16 tokens) instead of the 1.16B one")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=5, metavar=("KIND", "DEVICE", "BUDGET", "STEPS", "SHAPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, device, budget, steps, shape = args.worker
        print(json.dumps(worker(kind, device, int(budget), int(steps), None if shape == "-" else shape)))
        return
    device = "cpu" if args.simulate else "cuda"
    env = dict(os.environ, CHUNKMEM_SIM_MEMORY=f"scale:{DIVISOR}") if args.simulate else dict(os.environ)
    peak = plain_peak(device, args.shape)
    outside = 0 if args.simulate else held_after_a_step()
    runs = [("plain", "plain", -1)] + [chunkmem_run(share, outside, peak) for share in args.shares.split(",")] + \
        ([] if args.simulate or args.shape else [("FSDP2 offload", "fsdp2", -1)])
    speed, rows = bandwidth(device), []
    columns = ["run", "budget GiB", "step s", "vs plain", "fwd / bwd / opt ms", "GB up / down", "oom", "held/budget",
               "bound s", "vs bound", "note"]
    while runs:  # each row as it comes, and the JSON rewritten after it: a time limit keeps the rows done
        name, kind, budget = runs.pop(0)
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_offload", "--worker", kind, device, str(budget),
                               str(args.steps), args.shape or "-"], env=env, capture_output=True, text=True,
                              timeout=1800)
        got = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"crash": done.stderr[-600:]}
        rows.append(_row(name, budget, got, rows[0] if rows else None, speed))
        print(table(rows[-1:], columns), flush=True)
        if "holds" in got:  # FSDP2's: issue 36's target 3 runs chunkmem in the memory FSDP2 held
            runs.append(("at FSDP2's memory", "chunkmem", got["holds"]))
        if args.json:
            write_json(args.json, {"benchmark": "gpu_offload", "args": vars(args), "plain": peak, "bandwidth": speed,
                                    "outside_allocator": outside, "device": "CPU simulation (scaled 1/256)"
                                    if args.simulate else torch.cuda.get_device_name(), "rows": rows})
    print(table(rows, columns))


def _row(name: str, budget: int, got: dict[str, Any], plain: dict[str, Any] | None, speed: float) -> dict[str, Any]:
    row: dict[str, Any] = {"run": name, "budget GiB": round(budget / 2**30, 2) if budget >= 0 else "-", "step s": "-",
                           "vs plain": "-", "fwd / bwd / opt ms": "-", "GB up / down": "-", "oom": "-",
                           "held/budget": "-", "bound s": "-", "vs bound": "-", "note": ""}
    if got.get("held_over_budget") is not None:
        row |= {"held/budget": round(got["held_over_budget"], 3), "oom": got["oom_fallbacks"]}
    if "stages" not in got:
        return row | {"note": (got.get("refused") or got.get("error") or got.get("crash") or "")[:120], "raw": got}
    stages = got["stages"]
    step = sum(stages.values())
    row |= {"step s": round(step, 4), "fwd / bwd / opt ms": " / ".join(f"{stages[s] * 1000:.1f}" for s in STAGES),
            "raw": got}
    if plain is not None and isinstance(plain["step s"], float):
        row["vs plain"] = f"{step / plain['step s']:.2f}x"
    if "h2d_per_step" in got and plain is not None and isinstance(plain["step s"], float):
        moved = max(got["h2d_per_step"], got["d2h_per_step"]) / speed
        bound = max(plain["step s"], got["host_update_s"], moved)
        row |= {"GB up / down": f"{got['h2d_per_step'] / 1e9:.2f} / {got['d2h_per_step'] / 1e9:.2f}",
                "oom": got["oom_fallbacks"], "bound s": round(bound, 4), "vs bound": f"{step / bound:.2f}x"}
    if "holds" in got:
        row["note"] = f"holds {got['holds'] / 2**30:.1f} GiB"
    if got.get("ahead_hidden_share") is not None:
        row["note"] = (f"ahead: {got['ahead_adopted']} adopted, {got['ahead_redone']} redone, "
                       f"{got['ahead_rested']} steps rested, {got['ahead_busy_s'] * 1000:.0f} ms a step, "
                       f"{got['ahead_hidden_share']:.0%} before backward ended")
    return row


if __name__ == "__main__":
    main()
