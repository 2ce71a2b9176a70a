"""One AdamW step over a host chunk: chunkmem's native kernel against torch.optim, and a bandwidth floor.

    python benchmarks/cpu_adam.py --sizes 16M,64M --repeats 7 --json benchmarks/results/cpu_adam_cpu.json

Precisions: "fp32" (fp32 grads, no low-precision copy) and "bf16" (bf16 grads in, a bf16 copy of the
updated master out, as mixed-precision training needs). Contenders, alternated within each repeat so
that drift on a shared machine hits all of them alike:

  chunkmem        chunkmem.memory.native.adam_step: one pass, the casts included
  fused+casts     torch.optim.AdamW(fused=True), plus (bf16) grad.copy_(grad_bf16) before and
                  param_bf16.copy_(master) after: the same work done with stock PyTorch
  single+casts    torch.optim.AdamW(foreach=False), with the same casts
  deepspeed       DeepSpeedCPUAdam, only if `import deepspeed` works
  floor           a read-modify-write sweep (torch add_ in place) over a buffer sized so that it reads
                  and writes as many bytes as the step must: master, exp_avg, exp_avg_sq read and
                  written (24 B/param) plus the grad read and, for bf16, the copy written
                  (fp32: 24 + 4, bf16: 24 + 2 + 2, so 28 B/param both). No step can move less.

Targets (issue 4): bf16 >= 1.25x faster than fused+casts; fp32 no slower than fused; within 1.15x of
the floor.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import table, write_json
from chunkmem.memory import native

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BYTES_PER_PARAM = {"fp32": 28, "bf16": 28}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def chunkmem_step(n: int, precision: str) -> Callable[[], None]:
    master, exp_avg, exp_avg_sq = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad = torch.randn(n).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    out = torch.empty(n, dtype=torch.bfloat16) if precision == "bf16" else None
    count = [0]

    def step() -> None:
        count[0] += 1
        native.adam_step(master, grad, exp_avg, exp_avg_sq, out, decoupled=True, step=count[0], **HP)
    return step


def torch_step(n: int, precision: str, **flags: bool) -> Callable[[], None]:
    """torch.optim.AdamW on an fp32 master; for bf16 also the two casts around it."""
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], **flags)
    if precision == "fp32":
        return opt.step
    grad_bf16, out = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)

    def step() -> None:
        param.grad.copy_(grad_bf16)
        opt.step()
        out.copy_(param.detach())
    return step


def deepspeed_step(n: int, precision: str) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # not installed, or installed without its CPU op
        return None
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([param], lr=HP["lr"], weight_decay=HP["weight_decay"], adamw_mode=True)
    if precision == "fp32":
        return opt.step
    grad_bf16 = torch.randn(n).to(torch.bfloat16)

    def step() -> None:  # DeepSpeed takes fp32 grads; the bf16 copy-out is part of its step call
        param.grad.copy_(grad_bf16)
        opt.step()
    return step


def floor_step(n: int, precision: str) -> Callable[[], None]:
    # Half the bytes are read and the same bytes written back: 4-byte floats, BYTES/2 bytes per param.
    buffer = torch.zeros(n * BYTES_PER_PARAM[precision] // 8)
    return lambda: buffer.add_(1.0)


def time_ms(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(n: int, precision: str, repeats: int) -> list[dict]:
    contenders: dict[str, Callable[[], None] | None] = {
        "chunkmem": chunkmem_step(n, precision),
        "fused+casts": torch_step(n, precision, fused=True),
        "single+casts": torch_step(n, precision, foreach=False),
        "deepspeed": deepspeed_step(n, precision),
        "floor": floor_step(n, precision),
    }
    runs = {name: fn for name, fn in contenders.items() if fn is not None}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up: optimizer state allocation, page faults, the JIT build
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(time_ms(fn))
    ms = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for name in runs:
        gbps = BYTES_PER_PARAM[precision] * n / (ms[name] * 1e-3) / 1e9
        rows.append({"precision": precision, "params": f"{n / 2**20:.0f}M", "method": name,
                     "ms/step": f"{ms[name]:.1f}", "Mparam/s": f"{n / ms[name] / 1e3:.0f}",
                     "GB/s": f"{gbps:.1f}", "x floor": f"{ms[name] / ms['floor']:.2f}",
                     "speedup vs fused": f"{ms['fused+casts'] / ms[name]:.2f}",
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
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if native.load() is None:
        raise SystemExit("the native kernel is unavailable (see the warning above); nothing to compare")
    rows = []
    for size in args.sizes.split(","):
        for precision in args.precisions.split(","):
            measured = measure(parse_size(size), precision, args.repeats)
            print(table(measured, [c for c in measured[0] if c != "all_ms"]), "\n", flush=True)
            rows += measured
    machine = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "isa": native.supported_isas()[-1], "torch": torch.__version__}
    write_json(args.json, {"benchmark": "cpu_adam", "machine": machine, "bytes_per_param": BYTES_PER_PARAM,
                           "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
