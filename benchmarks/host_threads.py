"""How fast the native host update runs by thread count, alone and beside a thread that launches work.

    python -m benchmarks.host_threads --json host_threads.json

On a GPU machine the host update of streamed groups shares the CPU with the thread that runs forward and backward,
whose kernel launches the GPU waits for (with Config.overlap_update the update runs during backward; runtime/
ahead.py leaves one of torch's threads to it). Each row times the native Adam kernel (runtime/speeds.py's
update_speed: bytes of parameters, gradients, master and states updated a second, best of 3) on a team of that
many OpenMP threads: alone, and while another Python thread runs small torch ops in a loop, as a backward issuing
launches does; "launches kept" is that thread's rate beside the update against its rate alone. chunkmem updates
on torch's thread count (torch.get_num_threads(), the cores torch found), one fewer when made ahead.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from benchmarks.common import table, write_json
from chunkmem.memory import native
from chunkmem.runtime.speeds import update_speed


def launch_rate(stop: threading.Event, counted: list[int]) -> None:
    """Small ops in a loop until `stop`, counting them: a stand-in for the thread that launches kernels."""
    a, b = torch.ones(16), torch.ones(16)
    while not stop.is_set():
        torch.add(a, b)
        counted[0] += 1


def launches_per_s(seconds: float) -> float:
    stop, counted = threading.Event(), [0]
    thread = threading.Thread(target=launch_rate, args=(stop, counted))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return counted[0] / seconds


def beside_launches(threads: int, elements: int) -> tuple[float, float]:
    """The update's speed while a thread launches, and that thread's launches a second meanwhile."""
    stop, counted = threading.Event(), [0]
    thread = threading.Thread(target=launch_rate, args=(stop, counted))
    start = time.perf_counter()
    thread.start()
    speed = update_speed(threads, elements)
    stop.set()
    thread.join()
    return speed, counted[0] / (time.perf_counter() - start)


def thread_counts(cores: int) -> list[int]:
    counts = {1, cores - 1, cores, torch.get_num_threads()}
    counts |= {2 ** k for k in range(1, cores.bit_length()) if 2 ** k < cores}
    return sorted(c for c in counts if c >= 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 24, help="elements a timed update steps (16 bytes each)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if native.load() is None:
        raise SystemExit(f"the native kernel could not be built: {native.missing()}")
    cores = os.cpu_count() or 1
    alone_rate = launches_per_s(0.5)
    rows = []
    for threads in thread_counts(cores):
        alone = update_speed(threads, args.elements)
        beside, rate = beside_launches(threads, args.elements)
        rows.append({"threads": threads, "GB/s alone": round(alone / 1e9, 2), "GB/s beside launches":
                     round(beside / 1e9, 2), "launches kept": f"{rate / alone_rate:.0%}",
                     "torch's": "yes" if threads == torch.get_num_threads() else ""})
    print(f"{cores} CPUs, torch uses {torch.get_num_threads()} threads; {args.elements} elements an update; "
          f"a launching thread alone: {alone_rate:.0f} ops/s")
    columns = ["threads", "GB/s alone", "GB/s beside launches", "launches kept", "torch's"]
    print(table(rows, columns))
    write_json(args.json, {"benchmark": "host_threads", "args": vars(args), "cpus": cores,
                           "torch_threads": torch.get_num_threads(), "launches_alone": alone_rate, "rows": rows})


if __name__ == "__main__":
    main()
