"""The disk tier at scale on this machine: model data well over the host memory allowed, a few steps, peak RSS
against the cap, and each step's time against the disk's own bandwidth for the bytes that step moved.

    CHUNKMEM_SIM_CHECK=0 python -m benchmarks.disk_tier --dir /var/tmp/chunkmem-disk \
        --json benchmarks/results/disk_tier_cpu.json

The model is a stack of square Linear layers with a Tanh between them, built on the meta device so that
nothing but chunkmem's chunks ever holds its data, trained in bf16 on the simulated device with AdamW
through the native one-pass kernel (csrc/, as chunkmem uses on CUDA): parameters and gradients stay in
host memory, fp32 master weights and both Adam states go to disk.

The floor is the disk's, not ours: before and after training, as many bytes as a step writes (the tier's
file) are written then read with plain O_DIRECT `pwritev`/`preadv` of 16 MiB blocks on a scratch file in
the same directory (none of chunkmem's code), with 1 and with 4 threads; the fastest of the eight sets
the bandwidth each way (the disk is shared, so its speed varies; the best is the strictest floor). Floor = read bytes / read bandwidth + written bytes / written bandwidth (no overlap
of reads with writes assumed); score = floor / step time (1.0: as fast as the disk allows). Once the host room is full of what the next
optimizer step reads first, forward and backward leave the disk idle, so their time counts against the
score; "I/O wait" is the time compute waited for the disk (the rest of the step is compute). The load
average is recorded: the machine is shared, and other processes' CPU use lengthens compute.

Peak RSS is the kernel's (ru_maxrss). The simulated device's buffers live in this process too, so the
stated margin over `host_memory` is: device_memory + the process's RSS before any model data + 512 MiB.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import chunkmem
from benchmarks.common import table, write_json

GIB, MIB = 2**30, 2**20
BLOCK = 16 * MIB
SLACK = 512 * MIB


def build(width: int, layers: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def initialise(model: Any) -> None:
    """Random values one parameter at a time (a full state dict would not fit the host budget)."""
    data = model.runtime.data
    gen = torch.Generator().manual_seed(0)
    for record in model.runtime.store.records.values():
        data.set_value(record, (torch.rand(record.shape, generator=gen) * 2 - 1) / record.shape[-1] ** 0.5)


def disk_bandwidth(directory: Path, nbytes: int) -> dict[str, float]:
    """Bytes per second of plain O_DIRECT I/O (16 MiB blocks) on a scratch file in `directory`: `nbytes` written,
    then read back, then read again while as many are written elsewhere in the file ("mixed": both counted);
    each with 1 and with 4 threads a direction."""
    path = directory / "bandwidth-probe.bin"
    blocks = -(-nbytes // BLOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 2 * blocks * BLOCK)
        out: dict[str, float] = {}
        for threads in (1, 4):
            for name, jobs in (("write", [(os.pwritev, 0)]), ("read", [(os.preadv, 0)]),
                               ("mixed", [(os.preadv, 0), (os.pwritev, blocks)])):
                work = [(call, base, first) for call, base in jobs for first in range(threads)]
                start = time.perf_counter()
                with ThreadPoolExecutor(len(work)) as pool:
                    list(pool.map(lambda job: _blocks(fd, job[0], job[1], job[2], blocks, threads), work))
                out[f"{name}_bytes_per_s_{threads}_threads"] = len(jobs) * blocks * BLOCK / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return out


def _blocks(fd: int, call: Any, base: int, first: int, blocks: int, stride: int) -> None:
    """Blocks base + first, base + first + stride, ... below base + blocks, through one page-aligned buffer."""
    buffer = mmap.mmap(-1, BLOCK)  # O_DIRECT needs aligned memory; mmap's is page-aligned
    for block in range(base + first, base + blocks, stride):
        if call(fd, [buffer], block * BLOCK) != BLOCK:
            raise OSError(f"short I/O at block {block} of the bandwidth probe")


def probe(directory: Path, nbytes: int) -> dict[str, float]:
    """disk_bandwidth in a process of its own."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.disk_tier", "--dir", str(directory), "--probe", str(nbytes)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def fastest(*probes: dict[str, float]) -> dict[str, float]:
    """The disk's best bandwidth of each kind over the probes (the strictest floor)."""
    return {f"{kind}_bytes_per_s": max(v for p in probes for k, v in p.items() if k.startswith(kind))
            for kind in ("read", "write", "mixed")}


def floor_seconds(read: float, written: float, disk: dict[str, float]) -> float:
    """The least time the disk took to move these bytes: one way then the other, or both at once."""
    return min(read / disk["read_bytes_per_s"] + written / disk["write_bytes_per_s"],
               (read + written) / disk["mixed_bytes_per_s"])


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[float, float]:
    """Seconds of forward and backward, and of the optimizer."""
    start = time.perf_counter()
    model(batch).float().pow(2).mean().backward()
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    return middle - start, time.perf_counter() - middle


KEYS = ("disk_read_bytes", "disk_write_bytes", "disk_on_demand_bytes", "disk_stall_seconds", "disk_wait_seconds")


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    # The simulated device's copies land when waited for (its default, the strictest test of fences), so
    # autograd's gradients would stay alive until the optimizer reads them; on a GPU they land on their own,
    # and freeing them is the GPU's memory, not the host's. Copies that land as they go are the closer model.
    os.environ.setdefault("CHUNKMEM_SIM_LANDING", "random:0")
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    baseline = psutil.Process().memory_info().rss  # torch and Python, before any model data
    module = build(args.width, args.layers)
    config = chunkmem.Config(device="cpu", dtype="bf16", device_memory=args.device_memory, host_memory=args.host_memory,
                             chunk_size=args.width * (args.width + 1), disk=str(directory), native_optimizer=True)
    model, optimizer = chunkmem.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-4), config)
    if model.runtime.host_cache is None:  # type: ignore[union-attr]
        raise SystemExit("host_memory holds all the model data: lower --host-memory to exercise the disk tier")
    initialise(model)
    nbytes = model.memory_stats()["disk_bytes"]  # what a step writes
    probes = [probe(directory, nbytes)]
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    rows = []
    for index in range(args.steps + 1):  # the first is the warm-up
        before = model.memory_stats()
        forward_backward, optimizing = step(model, optimizer, batch)
        after = model.memory_stats()
        rows.append({"step": index, "seconds": round(forward_backward + optimizing, 2),
                     "forward_backward_seconds": round(forward_backward, 2), "optimizer_seconds": round(optimizing, 2),
                     **{k: after[k] - before[k] for k in KEYS}, "load_average": round(os.getloadavg()[0], 2)})
        probes.append(probe(directory, nbytes))
    final = model.memory_stats()
    model.runtime.host_cache.close()  # type: ignore[union-attr]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this process: the probes ran apart
    steady = rows[1:]
    bandwidth = fastest(*probes)
    for row in rows:
        row["floor_seconds"] = round(floor_seconds(row["disk_read_bytes"], row["disk_write_bytes"], bandwidth), 2)
        row["of_floor"] = round(row["floor_seconds"] / row["seconds"], 3)
    margin = args.device_memory + baseline + SLACK
    return {"benchmark": "disk_tier", "args": vars(args), "params": sum(p.numel() for p in module.parameters()),
            "model_data_bytes": final["model_data_bytes"],
            "model_data_over_host_memory": round(final["model_data_bytes"] / args.host_memory, 2),
            "disk_bytes": final["disk_bytes"], "host_cache_capacity_bytes": final["host_cache_capacity_bytes"],
            "host_cache_bytes_peak": final["host_cache_bytes_peak"], "steps": rows,
            "disk": bandwidth | {"probes": probes},
            "peak_rss_bytes": peak, "baseline_rss_bytes": baseline, "rss_margin_bytes": margin,
            "rss_within_cap_plus_margin": peak <= args.host_memory + margin,
            "steady_of_floor_mean": round(sum(r["of_floor"] for r in steady) / len(steady), 3),
            "steady_of_floor_min": min(r["of_floor"] for r in steady)}


def show(result: dict) -> None:
    gib = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    print(table([{"step": r["step"] or "warm-up", "s": r["seconds"], "fwd+bwd s": r["forward_backward_seconds"],
                  "read GiB": gib(r["disk_read_bytes"]),
                  "written GiB": gib(r["disk_write_bytes"]), "on-demand GiB": gib(r["disk_on_demand_bytes"]),
                  "I/O wait s": round(r["disk_wait_seconds"], 2), "floor s": r["floor_seconds"],
                  "of floor": r["of_floor"], "load": r["load_average"]} for r in result["steps"]],
                ["step", "s", "fwd+bwd s", "read GiB", "written GiB", "on-demand GiB", "I/O wait s", "floor s", "of floor",
                 "load"]))
    disk, args = result["disk"], result["args"]
    print(f"disk (plain O_DIRECT, best of 1 and 4 threads over {len(disk['probes'])} probes): read "
          f"{disk['read_bytes_per_s'] / GIB:.2f} GiB/s, write {disk['write_bytes_per_s'] / GIB:.2f} GiB/s, "
          f"both at once {disk['mixed_bytes_per_s'] / GIB:.2f} GiB/s")
    print(f"model data {gib(result['model_data_bytes'])} GiB = {result['model_data_over_host_memory']}x host_memory "
          f"{gib(args['host_memory'])} GiB; disk tier file {gib(result['disk_bytes'])} GiB")
    print(f"peak RSS {gib(result['peak_rss_bytes'])} GiB against host_memory + margin "
          f"{gib(args['host_memory'] + result['rss_margin_bytes'])} GiB (margin: device_memory "
          f"{gib(args['device_memory'])} + baseline {gib(result['baseline_rss_bytes'])} + {gib(SLACK)}): "
          f"{'within' if result['rss_within_cap_plus_margin'] else 'OVER'}")
    print(f"steady steps at {result['steady_of_floor_mean']:.0%} of the disk's floor on average "
          f"(worst {result['steady_of_floor_min']:.0%}; target 70%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="disk tier directory on a disk file system (removed afterwards)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--host-memory", type=int, default=7 * GIB // 2)
    parser.add_argument("--device-memory", type=int, default=GIB)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json")
    parser.add_argument("--probe", type=int, help="only measure the disk with this many bytes (JSON on stdout)")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(disk_bandwidth(Path(args.dir), args.probe)))
        return
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    try:
        result = run(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    show(result)
    write_json(args.json, result | {"tree_clean": not dirty})


if __name__ == "__main__":
    main()
