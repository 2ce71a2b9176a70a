"""Steady-step time under chunkmem against plain PyTorch, with many prepared models in one process.

    python -m benchmarks.overhead --json benchmarks/results/overhead_cpu.json

Rows: GPT-2 and LLaMA (transformers) and a 16x1024 MLP, in fp32 and bf16, at chunk budgets that are shares
of the model data (parameters, gradients, master weights and optimizer states): all of it ("fits"), 50%
and 25%, on top of the activation peak. Every row's chunkmem model and its plain twin are built before
timing, so all of them live in the process at once, as several models do in a user's process.

Each round visits the rows in a shuffled order and times one plain and one chunkmem step back to back, in
a random order; a row's ratio is paired per round (chunkmem / plain of the same round), and the table
shows min/median/max over rounds, so drift on a noisy machine hits both sides of every ratio. The "A/A"
row of each model and dtype times two plain twins against each other the same way: the spread a ratio
shows here when there is no overhead at all. "faults" are the minor page faults of one step (median, the
process's count), chunkmem's / plain's: fresh memory the host allocator took from the kernel.

Plain PyTorch: fp32 is the model and `torch.optim.AdamW`. bf16 is the same mixed-precision algorithm
chunkmem runs, written as a user would: bf16 parameters for forward and backward, fp32 master weights
and AdamW states, gradients cast up, the master cast down after the step.
Targets (issue 14): within 1.05x when the model fits, 1.10x at 50%. "extra ms" is the median of
chunkmem's time less plain's in the same round; "extra ms fwd / bwd / opt" splits it by phase (the forward
and loss, the backward, the optimizer's step and zero_grad: the median of each phase's difference, so they
need not add up to the whole), and "copies ms fwd / bwd / opt" is the simulation's copies within each phase
(below): the copies backward issues land when the step waits for them. On models so small that compute
costs next to nothing, "extra ms" is what chunkmem's own work costs a step in absolute terms:

    python -m benchmarks.overhead --width 64 --vocab 256 --batch 1 --seq 16 --mlp-width 32

On a loaded machine wall time counts waits for other processes too; `--cpu-time` times the CPU the timing
thread itself spends (torch then computes on that thread alone): the host work of each side's step.

When the model fits, steps after the warm-up run resident (runtime's Note on resident steps); when chunks
move, forwards after the first step run lean (runtime's Note on lean forwards). `--full-path` adds, fitting and
at 50%, rows whose chunkmem model takes the full path every step, timed against the same plain step in the same
rounds: what resident steps and lean forwards save.

`--native` adds, at 50% and 25%, rows whose chunkmem model updates its streamed groups on the host with the
native kernel (csrc/cpu_optim.cpp, one pass), as it does by default on CUDA; the simulation's default is
torch.optim's functions, which give plain PyTorch's bits. Plain PyTorch's side is the same (torch.optim), so
these rows time a faster host update, not less bookkeeping: they say how much of a streaming row is the host
update of its streamed groups.

`--as-cuda` runs resident steps as CUDA does, without saved-tensor hooks (runtime's Note on resident steps): the
simulation without its memory model reads no allocator, so its activations are metered through the hooks, which
cost the launch-bound rows several milliseconds a step that a GPU's host does not spend.

`--fused` runs both sides' AdamW with fused=True, as the GPU speed issue's plain PyTorch does: on a CPU torch.optim
otherwise loops over the parameters, one call each, which a chunk group's update over its packed range does not, so
the default flatters chunkmem's optimizer phase. A launch-bound model has as many chunk groups as the issue's 1.16B
LLaMA (9) when its embedding is to a layer as that model's is (about 1.3 layers): `--vocab 1024` at width 64; at
`--vocab 256` it has 42, each a call of chunkmem's optimizer that the 1.16B model does not make.

`--copied` adds, fitting and at 50%, rows whose chunkmem model copies each gradient into its chunk on the
device instead of lending the chunk autograd's tensor (chunk's Note on lent ranges), timed against the same
plain step in the same rounds: what lending saves.

On the CPU simulation the chunks' copies are memcpy on the two cores that also compute, where a GPU's copy
engines run them beside compute. The simulation lands them on a copy thread of idle priority (sim.py's
background landing), which only gets a core that compute leaves idle, and the compute thread lands any copy it
needs that the thread has not: "copies %" is the median share of the chunkmem step the compute thread spent
landing copies or waiting for them (the simulated device's own clock), and "median less copies" the paired
ratio with that time taken out, what the step costs when every copy overlaps (an upper bound on what overlap
can give; only a GPU shows it). `--waited` adds, at 50% and 25%, rows whose copies all land on the compute
thread when it waits for them (CHUNKMEM_SIM_LANDING=wait, the test suite's landing), against the same plain
step in the same rounds: what landing beside compute saves.

The host allocator weighs on both sides: plain PyTorch allocates its gradients and the optimizer's
temporaries afresh every step, and glibc serves them from fresh (page-faulting) mappings or from its heap
depending on what the process did before. `--models`/`--dtypes` run fewer rows (fewer models in the
process); with glibc told to keep what is freed, as CUDA's caching allocator does, the rows show what the
step costs when allocating is free on both sides:

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 python -m benchmarks.overhead --models mlp --dtypes fp32
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

import chunkmem
from benchmarks.common import gpt2, table, write_json
from benchmarks.placement import llama

Lap = Callable[[], None]  # marks the end of a step's phase: its forward (and loss), then its backward
Step = Callable[..., None]  # one training step; it takes a Lap, called after each phase but the last
PHASES = ("fwd", "bwd", "opt")  # forward and loss, backward, the optimizer's step and zero_grad
SHARES = {"fits": 1.0, "50%": 0.5, "25%": 0.25}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLOCK = [time.perf_counter]  # what timed_phases reads: wall time, or with --cpu-time this thread's CPU time
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
CONFIG: dict[str, Any] = {}  # chunkmem.Config's other fields, as the command line sets them


def use_fused() -> None:
    """--fused: AdamW(fused=True) on both sides, torch's one-pass kernel, as the GPU speed issue's plain PyTorch."""
    global ADAMW
    ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)


def use_chunk_size(size: int) -> None:
    """--chunk-size: chunkmem's Config.chunk_size, elements a chunk (the default: the size that wastes least)."""
    CONFIG["chunk_size"] = size


def use_cpu_time() -> None:
    """--cpu-time: CLOCK reads this thread's CPU time, and torch computes on this thread alone."""
    CLOCK[0] = time.thread_time
    torch.set_num_threads(1)


def _nothing() -> None:
    pass


def _forward_backward(model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor], lap: Lap) -> None:
    """The loss and its backward, each followed by a lap."""
    value = loss(model)
    lap()
    value.backward()
    lap()


def mlp(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*blocks)


def loss_fn(name: str, batch: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.nn.Module], torch.Tensor]:
    if name == "mlp":
        inputs = batch.to(dtype)
        return lambda model: model(inputs).float().square().mean()
    return lambda model: model(batch, labels=batch).loss


def plain_step(model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor], dtype: torch.dtype,
               make_optimizer: Callable[[list], torch.optim.Optimizer] | None = None) -> Step:
    """One plain PyTorch training step; in bf16 with fp32 master weights and states beside the bf16 model."""
    make_optimizer = make_optimizer or ADAMW
    if dtype == torch.float32:
        optimizer = make_optimizer(list(model.parameters()))

        def step(lap: Lap = _nothing) -> None:
            _forward_backward(model, loss, lap)
            optimizer.step()
            optimizer.zero_grad()
        return step
    low = [p for p in model.parameters()]
    master = [p.detach().float().clone().requires_grad_() for p in low]
    optimizer = make_optimizer(master)
    for param in low:  # buffers keep their precision, as under chunkmem (LLaMA's rotary frequencies stay fp32)
        param.data = param.data.to(dtype)

    def mixed(lap: Lap = _nothing) -> None:
        _forward_backward(model, loss, lap)
        for m, p in zip(master, low):  # a parameter without a gradient (frozen, unused) is not stepped
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            torch._foreach_copy_(low, master)
    return mixed


def chunk_step(model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor], dtype: str,
               memory: int | None, lend: bool = True, resident: bool = True,
               native: bool | None = None, landing: str | None = None, as_cuda: bool = False
               ) -> tuple[Step, torch.nn.Module]:
    """A chunkmem training step; with `lend` off, gradients are copied into their chunks on the device instead of
    lent to them (chunk's Note on lent ranges), as before lending was built; with `resident` off, every step takes
    the full path (no resident steps nor lean forwards: runtime's Notes on them), as before they were built;
    `native` is Config.native_optimizer; `landing` the simulation's CHUNKMEM_SIM_LANDING (None: as the
    environment says); `as_cuda`: resident steps run without saved-tensor hooks, as where the allocator is read."""
    config = chunkmem.Config(dtype=dtype, device_memory=memory, native_optimizer=native, **CONFIG)
    with mock.patch.dict(os.environ, {"CHUNKMEM_SIM_LANDING": landing} if landing else {}):
        wrapped, optimizer = chunkmem.prepare(model, ADAMW(list(model.parameters())), config)
    wrapped.runtime.resident_allowed = resident
    wrapped.runtime.device.reads_memory |= as_cuda  # its non-model bytes then read 0 in resident steps: shapes stay
    for group in wrapped.runtime.groups():
        group.chunks["grad"].lends = lend

    def step(lap: Lap = _nothing) -> None:
        _forward_backward(wrapped, loss, lap)
        optimizer.step()
        optimizer.zero_grad()
    return step, wrapped


def add_model_arguments(parser: argparse.ArgumentParser, width: int = 256, vocab: int = 8192, batch: int = 4,
                        seq: int = 128, mlp_width: int = 1024) -> None:
    """The models' sizes (the defaults are this benchmark's) and which models and dtypes to run."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--mlp-width", type=int, default=mlp_width, help="the MLP's width (16 layers)")
    parser.add_argument("--models", nargs="+", choices=("gpt2", "llama", "mlp"), default=["gpt2", "llama", "mlp"],
                        help="fewer models: fewer in the process, whose allocator state weighs on both sides")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))


def models(args: argparse.Namespace) -> dict[str, tuple[Callable[[], torch.nn.Module], torch.Tensor]]:
    """Each model's constructor and its batch, by name, at the sizes `args` gives."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return {"gpt2": (lambda: gpt2(args.layers, args.width, args.vocab, args.seq), tokens),
            "llama": (lambda: llama(args.layers, args.width, args.vocab, args.seq), tokens),
            "mlp": (lambda: mlp(16, args.mlp_width), torch.randn(args.batch * 16, args.mlp_width, generator=gen))}


def build(args: argparse.Namespace) -> list[dict]:
    made = models(args)
    rows = []
    for name, (make, batch) in ((n, made[n]) for n in args.models):
        for dtype in args.dtypes:
            torch_dtype = DTYPES[dtype]
            loss = loss_fn(name, batch, torch_dtype)
            fits = None  # the row where everything fits gives the activation peak and the model data
            for label, share in SHARES.items():
                memory = None if fits is None else int(fits[0] + share * fits[1])
                chunk, wrapped = chunk_step(make(), loss, dtype, memory, as_cuda=args.as_cuda)
                chunk(), chunk()  # warm-up, then the first step on the plan
                fits = fits or (wrapped.runtime.activations.peak, wrapped.memory_stats()["model_data_bytes"])
                plain = plain_step(make(), loss, torch_dtype)
                plain()
                rows.append(_row(name, dtype, label, plain, chunk, wrapped))
                if args.copied and label != "25%":
                    copied, unlent = chunk_step(make(), loss, dtype, memory, lend=False)
                    copied(), copied()
                    rows.append(_row(name, dtype, f"{label}, copied", plain, copied, unlent))
                if args.native and label != "fits":
                    native, wrapped = chunk_step(make(), loss, dtype, memory, native=True)
                    native(), native()
                    rows.append(_row(name, dtype, f"{label}, native", plain, native, wrapped))
                if args.waited and label != "fits":
                    waited, wrapped = chunk_step(make(), loss, dtype, memory, landing="wait")
                    waited(), waited()
                    rows.append(_row(name, dtype, f"{label}, waited", plain, waited, wrapped))
                if args.full_path and label != "25%":
                    full, wrapped = chunk_step(make(), loss, dtype, memory, resident=False)
                    full(), full()
                    rows.append(_row(name, dtype, f"{label}, full path", plain, full, wrapped))
            first, twin = plain_step(make(), loss, torch_dtype), plain_step(make(), loss, torch_dtype)
            first(), twin()  # warmed up alike (the optimizer's state is made in the first step)
            rows.append(_row(name, dtype, "A/A", first, twin, None))  # plain against its own twin
    return rows


def _row(model: str, dtype: str, budget: str, plain: Step, chunk: Step, wrapped: torch.nn.Module | None) -> dict:
    return {"model": model, "dtype": dtype, "budget": budget, "plain": plain, "chunkmem": chunk, "wrapped": wrapped,
            "before": wrapped.memory_stats() if wrapped is not None else None, "ratios": [], "plain_s": [],
            "extra_s": [], "less_copies": [], "copy_share": [], "phase_extra": [], "phase_copies": [],
            "faults": {"plain": [], "chunkmem": []}}


def timed_phases(step: Step, device: object) -> tuple[list[float], list[float], int]:
    """Seconds of each of one step's PHASES, the seconds `device` (a simulated one; none: zero) spent on copies
    in each, and the step's minor page faults."""
    marks = []

    def lap() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        marks.append((CLOCK[0](), getattr(device, "copy_seconds", 0.0)))

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    lap()
    step(lap)
    lap()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    seconds, copies = ([b[i] - a[i] for a, b in zip(marks, marks[1:])] for i in (0, 1))
    return seconds, copies, faults


def _medians_ms(rounds: list[list[float]]) -> str:
    """Per phase, the median over rounds, in ms: "fwd / bwd / opt"."""
    return " / ".join(f"{1000 * statistics.median(phase):.1f}" for phase in zip(*rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--copied", action="store_true",
                        help="also time, fitting and at 50%%, the same model with its gradients copied into their chunks "
                             "rather than lent to them, against the same plain step")
    parser.add_argument("--full-path", action="store_true",
                        help="also time, fitting and at 50%%, the same model taking the full path every step (no "
                             "resident steps nor lean forwards) against the same plain step")
    parser.add_argument("--native", action="store_true",
                        help="also time, at 50%% and 25%%, the same model with its streamed groups updated on the host by "
                             "the native kernel (Config.native_optimizer: CUDA's default, within 1e-6 of torch.optim, "
                             "not its bits), against the same plain step")
    parser.add_argument("--waited", action="store_true",
                        help="also time, at 50%% and 25%%, the same model whose simulated copies land only when the "
                             "compute thread waits for them (CHUNKMEM_SIM_LANDING=wait), against the same plain step")
    parser.add_argument("--as-cuda", action="store_true",
                        help="resident steps without saved-tensor hooks, as on CUDA (runtime's Note on resident steps)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the CPU the timing thread spends (time.thread_time), with torch computing on that "
                             "thread alone: the host work of a step, steady on a loaded machine, where wall time "
                             "also counts waits for other processes (the simulation's copy thread is not counted: a "
                             "GPU's copy engines move those bytes)")
    parser.add_argument("--fused", action="store_true",
                        help="AdamW(fused=True) on both sides, as the GPU speed issue's plain PyTorch (the default: "
                             "torch.optim's own choice, its per-parameter loop on a CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.cpu_time:
        use_cpu_time()
    if args.fused:
        use_fused()

    rows = build(args)
    order = random.Random(0)
    for _ in range(args.rounds):
        for row in order.sample(rows, len(rows)):
            phases, copies = {}, {}
            for side in order.sample(["plain", "chunkmem"], 2):
                device = row["wrapped"].runtime.device if side == "chunkmem" and row["wrapped"] is not None else None
                phases[side], copies[side], faults = timed_phases(row[side], device)
                row["faults"][side].append(faults)
            times = {side: sum(seconds) for side, seconds in phases.items()}
            copied = sum(copies["chunkmem"])
            row["phase_extra"].append([c - p for c, p in zip(phases["chunkmem"], phases["plain"])])
            row["phase_copies"].append(copies["chunkmem"])
            row["ratios"].append(times["chunkmem"] / times["plain"])
            row["less_copies"].append((times["chunkmem"] - copied) / times["plain"])
            row["copy_share"].append(copied / times["chunkmem"])
            row["plain_s"].append(times["plain"])
            row["extra_s"].append(times["chunkmem"] - times["plain"])
    results = []
    for row in rows:
        moved = 0.0
        if row["wrapped"] is not None:
            stats, before = row["wrapped"].memory_stats(), row["before"]
            moved = sum(stats[k] - before[k] for k in ("h2d_bytes", "d2h_bytes")) / 2**20 / args.rounds
        faulted = {side: round(statistics.median(counts)) for side, counts in row["faults"].items()}
        results.append({"model": row["model"], "dtype": row["dtype"], "budget": row["budget"],
                        "plain ms": round(1000 * statistics.median(row["plain_s"]), 1),
                        "extra ms": round(1000 * statistics.median(row["extra_s"]), 2),
                        "min": round(min(row["ratios"]), 3), "median": round(statistics.median(row["ratios"]), 3),
                        "max": round(max(row["ratios"]), 3),
                        "copies %": round(100 * statistics.median(row["copy_share"]), 1),
                        "median less copies": round(statistics.median(row["less_copies"]), 3),
                        "extra ms " + " / ".join(PHASES): _medians_ms(row["phase_extra"]),
                        "copies ms " + " / ".join(PHASES): _medians_ms(row["phase_copies"]),
                        "moved MiB/step": round(moved, 1), "faults": f"{faulted['chunkmem']} / {faulted['plain']}"})
    print(f"{len(rows)} rows, {args.rounds} shuffled rounds; chunkmem / plain PyTorch per round")
    print(table(results, list(results[0])))
    write_json(args.json, {"benchmark": "overhead", "args": vars(args), "rows": results,
                           "ratios": {f"{r['model']} {r['dtype']} {r['budget']}": r["ratios"] for r in rows}})


if __name__ == "__main__":
    main()
