"""One AdamW step over a host chunk: chunkmem's native kernel against torch.optim, and a memory-traffic floor.

    python -m benchmarks.cpu_adam --sizes 16M,64M --rounds 25 --json benchmarks/results/cpu_adam_cpu.json

Precisions: "fp32" (fp32 grads, no low-precision copy) and "bf16" (bf16 grads in, a bf16 copy of the
updated master out, as mixed-precision training needs). Every contender produces the same outputs:

  chunkmem        chunkmem.memory.native.adam_step: one pass, the casts included
  fused+casts     torch.optim.AdamW(fused=True), plus (bf16) grad.copy_(grad_bf16) before and
                  param_bf16.copy_(master) after: the same work done with stock PyTorch
  single+casts    torch.optim.AdamW(foreach=False), with the same casts
  deepspeed+casts DeepSpeedCPUAdam (adamw_mode), with the same casts: its step takes grads of the
                  parameter's dtype and writes no low-precision copy. Only if `import deepspeed` works
                  (`pip install deepspeed==0.19.8`; it builds its CPU op on first use, -march=native)
  floor           benchmarks/adam_floor.cpp: every byte Adam moves (grad in; master, exp_avg,
                  exp_avg_sq in and out; the bf16 copy out) and no arithmetic, built with the kernel's
                  flags, OpenMP team, block schedule and vector width. 28 B/param in both precisions
                  (fp32: 4 + 24; bf16: 2 + 24 + 2)

Each round times every contender once, in a fresh random order, so that a shared machine's load falls
on all of them alike; "x floor" is the ratio to the floor in the same round, reported as min/median/max
over rounds, as are the times. "floor A/A" is the floor again on buffers of its own, timed as a contender:
its "x floor" is the spread this machine gives a ratio of two equal steps. The load average is recorded
before and after.

"x floor (best)" compares the best times, what a quiet machine gives. "arithmetic / floor" (chunkmem's row)
is the kernel's time per parameter on a chunk that stays in cache, where memory costs little, over the
floor's per parameter at this size: near 1, the arithmetic alone (two divisions and a square root per
element, which bit-identity with torch.optim keeps) takes as long as the traffic, and the step can only
approach the floor as far as the two overlap.

Targets: bf16 >= 1.25x faster than fused+casts (issue 4); chunkmem within 1.05x of the floor (issue 14).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks import adam_floor
from benchmarks.common import table, write_json
from chunkmem.memory import native

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LOWP = {"fp32": None, "bf16": torch.bfloat16}
Step = Callable[[], None]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def grad_dtype(precision: str) -> torch.dtype:
    return LOWP[precision] or torch.float32


Streams = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def chunk_streams(n: int, precision: str) -> Streams:
    """master, grad, exp_avg, exp_avg_sq and the low-precision copy (None in fp32), as chunkmem holds them."""
    lowp = LOWP[precision]
    out = None if lowp is None else torch.empty(n, dtype=lowp)
    return torch.randn(n), torch.randn(n).to(grad_dtype(precision)), torch.zeros(n), torch.zeros(n), out


def chunkmem_step(n: int, precision: str) -> Step:
    master, grad, exp_avg, exp_avg_sq, out = chunk_streams(n, precision)
    count = [0]

    def step() -> None:
        count[0] += 1
        native.adam_step(master, grad, exp_avg, exp_avg_sq, out, lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"],
                         eps=HP["eps"], weight_decay=HP["weight_decay"], decoupled=True, step=count[0])
    return step


def floor_step(n: int, precision: str) -> Step:
    master, grad, exp_avg, exp_avg_sq, out = chunk_streams(n, precision)
    return lambda: adam_floor.adam_traffic(master, grad, exp_avg, exp_avg_sq, out)


def with_casts(opt_step: Step, param: torch.nn.Parameter, precision: str) -> Step:
    """For bf16: upcast the bf16 grad into the fp32 grad before the step, write the bf16 copy after."""
    if precision == "fp32":
        return opt_step
    n = param.numel()
    grad_lowp, out = torch.randn(n).to(grad_dtype(precision)), torch.empty(n, dtype=LOWP[precision])
    assert param.grad is not None

    def step() -> None:
        param.grad.copy_(grad_lowp)  # type: ignore[union-attr]
        opt_step()
        out.copy_(param.detach())
    return step


def torch_step(n: int, precision: str, **flags: bool) -> Step:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **flags)
    return with_casts(opt.step, param, precision)


def deepspeed_step(n: int, precision: str) -> Step | None:
    try:
        from deepspeed.ops.adam import \
            DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # not installed, or installed without its CPU op
        return None
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                           weight_decay=HP["weight_decay"], adamw_mode=True)
    return with_casts(opt.step, param, precision)


def time_ms(fn: Step) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def spread(values: list[float], digits: int) -> str:
    """min / median / max."""
    return " / ".join(f"{v:.{digits}f}" for v in (min(values), statistics.median(values), max(values)))


@functools.cache
def arithmetic_ns(precision: str, n: int = 1 << 16, repeats: int = 200) -> float:
    """chunkmem's step per parameter on a chunk that stays in cache (64K parameters, 1.75 MiB): what its
    arithmetic costs with hardly any memory traffic; best of five runs of `repeats` steps."""
    step, best = chunkmem_step(n, precision), float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        best = min(best, (time.perf_counter() - start) / repeats / n * 1e9)
    return best


def measure(n: int, precision: str, rounds: int, rng: random.Random) -> list[dict]:
    contenders: dict[str, Step | None] = {
        "chunkmem": chunkmem_step(n, precision),
        "fused+casts": torch_step(n, precision, fused=True),
        "single+casts": torch_step(n, precision, foreach=False),
        "deepspeed+casts": deepspeed_step(n, precision),
        "floor": floor_step(n, precision),
        "floor A/A": floor_step(n, precision),  # the floor again, on its own buffers: a ratio's spread at no cost
    }
    runs = {name: fn for name, fn in contenders.items() if fn is not None}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up: optimizer state allocation, page faults, JIT builds
        fn()
    names = list(runs)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            times[name].append(time_ms(runs[name]))
    bytes_moved = adam_floor.bytes_per_param(grad_dtype(precision), LOWP[precision]) * n
    floor_ns = min(times["floor"]) * 1e6 / n
    arithmetic = arithmetic_ns(precision)
    rows = []
    for name in runs:
        x_floor = [t / f for t, f in zip(times[name], times["floor"])]
        speedup = [f / t for t, f in zip(times[name], times["fused+casts"])]
        best = min(times[name])
        rows.append({"precision": precision, "params": f"{n / 2**20:.0f}M", "method": name,
                     "ms min/med/max": spread(times[name], 1), "x floor min/med/max": spread(x_floor, 2),
                     "vs fused (med)": f"{statistics.median(speedup):.2f}",
                     "GB/s (best)": f"{bytes_moved / (best * 1e-3) / 1e9:.1f}",
                     "x floor (best)": f"{best / min(times['floor']):.2f}",
                     "arithmetic / floor": f"{arithmetic / floor_ns:.2f}" if name == "chunkmem" else "",
                     "x_floor_median": round(statistics.median(x_floor), 4),
                     "all_ms": [round(t, 2) for t in times[name]]})
    return rows


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M", help="parameters per chunk, comma-separated")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=25, help="shuffled rounds, each timing every contender")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the rounds")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if native.load() is None:
        raise SystemExit("the native kernel is unavailable (see the warning above); nothing to compare")
    rng = random.Random(args.seed)
    load_before = os.getloadavg()
    rows = []
    for size in args.sizes.split(","):
        for precision in args.precisions.split(","):
            measured = measure(parse_size(size), precision, args.rounds, rng)
            print(table(measured, [c for c in measured[0] if c not in ("all_ms", "x_floor_median")]), "\n",
                  flush=True)
            rows += measured
    machine = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "isa": native.supported_isas()[-1], "torch": torch.__version__,
               "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print(f"load average (1, 5, 15 min): before {load_before}, after {machine['loadavg_after']}")
    write_json(args.json, {"benchmark": "cpu_adam", "machine": machine, "rounds": args.rounds, "seed": args.seed,
                           "rows": rows})


if __name__ == "__main__":
    main()
