"""`chunkmem selftest`: the checks a GPU owner runs once, in a few minutes, to see chunkmem's CUDA path hold.

Why: the CUDA path is the one CI cannot run (it has no GPU), so whoever first runs chunkmem on a GPU
should learn in one command whether copies, fences, the memory budget and NCCL behave there, with
figures to report. Each check returns a `Row`; a check that needs a GPU says so and is skipped
without one, so the command runs anywhere (the simulation's check runs everywhere). Checks that
change process-wide state (the sanitizer, the allocator cap, a process group) run in a subprocess
of their own: `python -m chunkmem.selftest CHECK ARGS_JSON` prints one JSON object.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import chunkmem
from chunkmem.memory.device import collect_garbage
from chunkmem.memory.gpu_memory import outside_bytes

MiB = 1 << 20
SEGMENTS = 4 * MiB  # budget_for's: two of the caching allocator's small segments
LARGE_SEGMENT = 20 * MiB  # the caching allocator's segment for a block of 1 to 10 MiB
NEEDS_GPU = "needs a CUDA GPU: skipped"
OVERLAP_TARGET = 0.8  # of copy time hidden behind compute (the GPU speed issue's target)
RESIDENT_FORWARD_TARGET = 1.05  # a resident forward against plain PyTorch's


@dataclasses.dataclass
class Row:
    check: str
    status: str  # "pass" | "fail" | "skipped"
    detail: str
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


def mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


def batches(width: int, rows: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)) for _ in range(steps)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list, device: torch.device) -> list[float]:
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x.to(device)).float(), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def budget_for(device: str, nbytes: int | None) -> int | None:
    """A `device_memory` that leaves `nbytes` for model data and activations on `device`. On CUDA the budget
    counts everything the process holds there (gpu_memory's Note): what the allocator has reserved (cuBLAS's
    workspaces among it), and what the process holds outside the allocator, read once a prepared model has
    trained (the copy engine, its streams and the kernels of a step loaded); and the allocator reserves in
    segments, so a few KiB of model data take two new ones of 2 MiB (SEGMENTS), one for chunks and one for
    activations. The simulation counts the same when it models the allocator (CHUNKMEM_SIM_MEMORY)."""
    from chunkmem.memory.simmemory import simulated_memory

    if nbytes is None:
        return None
    collect_garbage()  # models dropped before, kept by reference cycles, hold device memory no longer
    if device == "cpu":
        memory = simulated_memory()
        if memory is None or not memory.models_budget:
            return nbytes
        memory.allocator.empty_cache()
        return nbytes + SEGMENTS + memory.reserved
    warm = mlp(64, 2)
    cm, opt = chunkmem.prepare(warm, torch.optim.AdamW(warm.parameters()), chunkmem.Config(device=device))
    train(cm, opt, batches(64, 4, 2), torch.device(device))
    del warm, cm, opt
    collect_garbage()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return nbytes + SEGMENTS + torch.cuda.memory_reserved(device) + outside_bytes(device)


def model_data_bytes(model: nn.Module) -> int:
    """fp32 AdamW: parameter, gradient and two states per element (the runtime's layout adds padding)."""
    return 4 * sum(p.numel() * 4 for p in model.parameters())


# -- checks that run everywhere ---------------------------------------------------------------------------

def check_simulation() -> Row:
    """The strict simulation (late copies at random moments, the happens-before checker) against PyTorch."""
    from chunkmem.memory import sim

    data, reference = batches(64, 8, 4), mlp(64, 6)
    ref = copy.deepcopy(reference)
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data, torch.device("cpu"))
    figures: dict[str, Any] = {}
    with sim.checking(), _environment(CHUNKMEM_SIM_LANDING="random:7"):  # copies land at random later moments
        for fraction in (1.0, 0.5, 0.25):
            model = copy.deepcopy(reference)
            cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), chunkmem.Config(
                device="cpu", device_memory=int(model_data_bytes(model) * fraction), chunk_size=64 * 64 + 64))
            same = train(cm, opt, data, torch.device("cpu")) == ref_losses and all(
                torch.equal(v, ref.state_dict()[k]) for k, v in cm.state_dict().items())
            figures[f"{fraction:.0%} of model data"] = {"bit_identical": same, "h2d_bytes": cm.memory_stats()["h2d_bytes"]}
    ok = all(f["bit_identical"] for f in figures.values())
    return Row("simulation", "pass" if ok else "fail",
               "fp32 bit-identical to PyTorch with copies landing late" if ok else "differs from PyTorch", figures)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


# -- checks that need a GPU -----------------------------------------------------------------------------------

def _time(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Seconds per call, after one warm-up call, with the device idle before and after."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def check_bandwidth(sizes_mib: tuple[int, ...] = (4, 16, 64, 256)) -> Row:
    """Pinned copies both ways and both at once: the copy engine against plain cudaMemcpyAsync (torch's
    non-blocking copy on a side stream)."""
    from chunkmem.memory.device import CudaDevice

    device = CudaDevice("cuda")
    engine = device.engine
    after = torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    figures: dict[str, Any] = {}
    worst = float("inf")
    for size in sizes_mib:
        numel = size * MiB // 4
        host_in, host_out = device.host_alloc(numel, torch.float32), device.host_alloc(numel, torch.float32)
        dev_in, dev_out = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")

        def torch_copy(up: bool, down: bool) -> None:
            with torch.cuda.stream(side):
                if up:
                    dev_in.copy_(host_in, non_blocking=True)
                if down:
                    host_out.copy_(dev_out, non_blocking=True)

        def engine_copy(up: bool, down: bool) -> None:
            # No wait per call: torch's copies get none either, and _time's device synchronise covers both.
            # (With a wait per call, the lent H100's 4 MiB copies came out at 0.88-0.98x of torch's.)
            if up:
                engine.copy([dev_in], [host_in], after)
            if down:
                engine.copy([host_out], [dev_out], after)

        row: dict[str, float] = {}
        for name, up, down in (("h2d", True, False), ("d2h", False, True), ("both", True, True)):
            moved = size * MiB * (up + down) / 1e9
            row[f"torch_{name}_GBps"] = round(moved / _time(lambda: torch_copy(up, down)), 2)
            if engine is not None:
                row[f"engine_{name}_GBps"] = round(moved / _time(lambda: engine_copy(up, down)), 2)
                worst = min(worst, row[f"engine_{name}_GBps"] / row[f"torch_{name}_GBps"])
        figures[f"{size} MiB"] = row
    if engine is None:
        return Row("copy bandwidth", "skipped", "the copy engine is not built (see `chunkmem env`): torch's copies only",
                   figures)
    ok = worst >= 0.9
    return Row("copy bandwidth", "pass" if ok else "fail",
               f"the copy engine reaches {worst:.2f}x of cudaMemcpyAsync at worst (want >= 0.90)", figures)


def check_parity() -> Row:
    """fp32 on CUDA against plain PyTorch on CUDA (bit for bit when every group steps on the device, with the
    native optimizer off) and against the CPU simulation (same model, budget and seed)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    reference, data = parity_setup()
    plain = copy.deepcopy(reference).cuda()
    ref_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), data, torch.device("cuda"))
    ref_state = {k: v.cpu() for k, v in plain.state_dict().items()}
    figures: dict[str, Any] = {}
    ok = True
    for fraction in (None, 0.5, 0.25):
        runs, resident, lean = {}, {}, {}
        for device in ("cuda", "cpu"):
            cm, losses = parity_run(reference, fraction, device, data)
            runs[device] = (losses, cm.state_dict())
            resident[device] = cm.memory_stats()["resident_steps"]
            lean[device] = cm.memory_stats()["lean_forwards"]
        worst = {d: max(((s[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in ref_state.items())
                 for d, (_, s) in runs.items()}
        exact = runs["cuda"][0] == ref_losses and worst["cuda"] == 0.0
        name = "everything on the device" if fraction is None else f"{fraction:.0%} of model data"
        figures[name] = {"bit_identical_to_plain_cuda": exact, "max_rel_diff_cuda": worst["cuda"],
                         "max_rel_diff_simulation": worst["cpu"], "resident_steps_cuda": resident["cuda"],
                         "lean_forwards_cuda": lean["cuda"], "lean_forwards_simulation": lean["cpu"]}
        # Everything fitting, the steps after the warm-up run resident; streaming, some forwards run lean (runtime's
        # Notes on them).
        modeless = resident["cuda"] == resident["cpu"] == len(data) - 1 if fraction is None else lean["cuda"] > 0
        ok = ok and (exact if fraction is None else worst["cuda"] <= 1e-4) and worst["cpu"] <= 1e-3 and modeless
    torch.use_deterministic_algorithms(False)
    return Row("cuda vs plain and simulation", "pass" if ok else "fail",
               "bit-identical when everything fits (steps after the warm-up resident); streamed groups step on the "
               "host, within 1e-4 (forwards lean)", figures)


def parity_setup() -> tuple[nn.Module, list]:
    """check_parity's model and batches."""
    return mlp(1024, 8), batches(1024, 32, 4)


def parity_run(reference: nn.Module, fraction: float | None, device: str,
               data: list) -> tuple[chunkmem.ChunkedModel, list[float]]:
    """check_parity's run of a copy of `reference` on `device` with room for `fraction` of its model data (None: no
    budget), and its losses. The room has a large segment more than the share: a chunk or a weight's gradient of 1 to
    10 MiB (this model's are 4 MiB) takes one of 20 MiB, which budget_for's small segments do not cover (the lent
    H200 ran out of memory at 0.5 without it, and so does the simulation of CUDA's allocator)."""
    model = copy.deepcopy(reference)
    room = None if fraction is None else int(model_data_bytes(model) * fraction) + LARGE_SEGMENT
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), chunkmem.Config(
        device=device, device_memory=budget_for(device, room), native_optimizer=False))
    return cm, train(cm, opt, data, cm.runtime.device.torch_device)


def budget_worker(fraction: float, device: str = "cuda") -> dict[str, Any]:
    """In a fresh process: train under a budget of `fraction` of the model data (plus activations) and read
    what the process really took from the device (on "cpu", from the simulated allocator: CI's twin)."""
    model = mlp(1024, 12)
    twin = copy.deepcopy(model)  # one step of it unbudgeted first: the kernels it needs load before the reading
    cm, opt = chunkmem.prepare(twin, torch.optim.AdamW(twin.parameters()), chunkmem.Config(device=device))
    train(cm, opt, batches(1024, 64, 1), cm.runtime.device.torch_device)
    del twin, cm, opt
    limit = budget_for(device, int(model_data_bytes(model) * fraction) + 64 * MiB)
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               chunkmem.Config(device=device, device_memory=limit))
    allocator = cm.runtime.device.memory.allocator if device == "cpu" else None  # type: ignore[attr-defined]
    reserved_at_prepare = allocator.reserved if allocator else torch.cuda.memory_reserved()
    if allocator:
        allocator.peak_reserved = allocator.reserved
    else:
        torch.cuda.reset_peak_memory_stats()
    steps = []  # per step: the most reserved so far and what the cap took as outside the allocator
    for batch in batches(1024, 64, 6):
        train(cm, opt, [batch], cm.runtime.device.torch_device)
        steps.append((allocator.peak_reserved if allocator else torch.cuda.max_memory_reserved(),
                      cm.runtime.capped_outside))
    outside = cm.runtime.gpu_memory.outside_allocator() if cm.runtime.gpu_memory is not None else 0
    stats = cm.memory_stats()
    return {"budget": limit, "max_reserved": steps[-1][0], "outside_allocator": outside,
            "reserved_at_prepare": reserved_at_prepare, "first_outside": cm.runtime.first_outside,
            "reserved_and_capped_outside_per_step": steps,
            "groups_homed": len(cm.runtime.placer.homes), "groups": len(cm.runtime.placer.groups),
            "h2d_bytes": stats["h2d_bytes"], "oom_fallbacks": stats["oom_fallbacks"]}


def reserved_over_budget(figures: dict[str, Any]) -> float:
    """A budget worker's most reserved bytes plus what the process held outside the allocator, over its budget."""
    return (figures["max_reserved"] + figures["outside_allocator"]) / figures["budget"]


def check_reserved() -> Row:
    figures = {f"{f:.0%}": run_worker("budget", f) for f in (1.0, 0.5, 0.25)}
    ratios = {k: reserved_over_budget(v) for k, v in figures.items()}
    for key, ratio in ratios.items():
        figures[key]["reserved_plus_outside_over_budget"] = round(ratio, 3)
    fallbacks = sum(v["oom_fallbacks"] for v in figures.values())
    ok = max(ratios.values()) <= 1.0 and fallbacks == 0
    return Row("reserved memory vs budget", "pass" if ok else "fail",
               f"max_memory_reserved + memory outside the allocator is at most {max(ratios.values()):.2f}x "
               f"device_memory (want <= 1), with {fallbacks} out-of-memory fallbacks (want 0)", figures)


SANITIZED = "TORCH_CUDA_SANITIZER"


def sanitizer_worker() -> dict[str, Any]:
    """Runs with TORCH_CUDA_SANITIZER=1 and CHUNKMEM_NO_NATIVE=1 (the sanitizer sees torch's copies only):
    a race raises here and the process fails."""
    for fraction in (None, 0.5, 0.25):
        model = mlp(256, 6)
        room = None if fraction is None else int(model_data_bytes(model) * fraction)
        cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   chunkmem.Config(device="cuda", device_memory=budget_for("cuda", room)))
        train(cm, opt, batches(256, 16, 3), cm.runtime.device.torch_device)
        cm.state_dict()
    torch.cuda.synchronize()
    return {"sanitizer": os.environ.get(SANITIZED)}


def check_sanitizer() -> Row:
    try:
        run_worker("sanitizer", env={SANITIZED: "1", "CHUNKMEM_NO_NATIVE": "1"})
    except RuntimeError as error:
        return Row("cuda sanitizer", "fail", str(error)[-2000:])
    return Row("cuda sanitizer", "pass", "training at 100/50/25% budgets ran under TORCH_CUDA_SANITIZER=1 with no race")


def nccl_worker(rank: int = 0, world: int = 1, port: int = 0) -> dict[str, Any]:
    """One rank of an NCCL group: the collectives chunkmem uses, then ZeRO training (world > 1)."""
    import torch.distributed as dist

    from chunkmem.zero.collectives import ALL_GATHER, REDUCE_SCATTER, single_tensor_collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        out = torch.empty(world * 4, device=device)
        ALL_GATHER(out, torch.full((4,), float(rank), device=device))
        share = torch.empty(4, device=device)
        REDUCE_SCATTER(share, torch.ones(world * 4, device=device))
        result: dict[str, Any] = {"single_tensor": single_tensor_collectives(dist.group.WORLD, device),
                                  "all_gather": out.tolist(), "reduce_scatter": share.tolist()}
        if world > 1:
            model = mlp(256, 4)
            cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       chunkmem.Config(device="cuda", native_optimizer=False))
            local = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(256, 16, 3)]
            result["losses"] = train(cm, opt, local, device)
            result["weights"] = {k: v.sum().item() for k, v in cm.state_dict().items()}
        return result
    finally:
        dist.destroy_process_group()


def check_nccl() -> Row:
    figures = {"world 1": run_worker("nccl", 0, 1, _free_port())}
    ok = figures["world 1"]["single_tensor"] and figures["world 1"]["reduce_scatter"] == [1.0] * 4
    if torch.cuda.device_count() >= 2:
        port = _free_port()
        procs = [_start_worker("nccl", rank, 2, port) for rank in range(2)]
        ranks = [_finish_worker(p) for p in procs]
        plain = mlp(256, 4).cuda()
        ref_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), batches(256, 16, 3), torch.device("cuda"))
        ref_weights = {k: v.sum().item() for k, v in plain.state_dict().items()}
        mean_losses = [sum(r["losses"][i] for r in ranks) / 2 for i in range(len(ref_losses))]
        close = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(mean_losses, ref_losses)) and all(
            abs(ranks[0]["weights"][k] - v) <= 1e-3 * max(1.0, abs(v)) for k, v in ref_weights.items())
        figures["world 2 (ZeRO)"] = {"losses": mean_losses, "plain_losses": ref_losses, "matches_one_process": close}
        ok = ok and close
    detail = "NCCL collectives chunkmem uses work" + ("; 2-rank ZeRO matches one process" if len(figures) > 1
                                                       else "; one GPU: the 2-rank run needs two")
    return Row("nccl", "pass" if ok else "fail", detail, figures)


OVERLAP_WIDTH = 2048  # the overlap check's MLP


def overlap_worker() -> dict[str, Any]:
    """In a fresh process (the allocator's cap is process-wide, and earlier checks leave memory behind): the copy
    and kernel times of steady streamed steps on the profiler's GPU timeline, and a resident forward's time beside
    plain PyTorch's."""
    from torch.profiler import ProfilerActivity, profile

    width = OVERLAP_WIDTH
    model = mlp(width, 16)
    x = torch.randn(64, width, device="cuda")  # the plain twin first: under the prepared model's cap it would not fit
    plain = mlp(width, 16).cuda()
    limit = budget_for("cuda", int(model_data_bytes(model) * 0.3))
    cm, opt = chunkmem.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                               chunkmem.Config(device="cuda", device_memory=limit))
    data = batches(width, 256, 5)
    train(cm, opt, data[:2], cm.runtime.device.torch_device)  # warm-up and the first planned step
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(cm, opt, data[2:], cm.runtime.device.torch_device)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as handle:
            events = json.load(handle)["traceEvents"]
    kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"])
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy"]
    copy_time = sum(b - a for a, b in copies)
    hidden = sum(_overlap(c, kernels) for c in copies)
    fraction = hidden / copy_time if copy_time else 0.0
    with torch.no_grad():
        ours, theirs = _time(lambda: cm(x)), _time(lambda: plain(x))
    return {"copy_ms": round(copy_time / 1e3, 2), "overlapped_fraction": round(fraction, 3),
            "forward_ms_chunkmem": round(ours * 1e3, 3), "forward_ms_plain": round(theirs * 1e3, 3),
            "forward_ratio": round(ours / theirs, 3)}


def check_overlap() -> Row:
    """What share of copy time overlapped compute in steady streamed steps, and what the per-op interception costs
    on a GPU-sized forward (overlap_worker)."""
    figures = run_worker("overlap")
    fraction, ratio = figures["overlapped_fraction"], figures["forward_ratio"]
    ok = fraction >= OVERLAP_TARGET and ratio <= RESIDENT_FORWARD_TARGET
    return Row("copy/compute overlap", "pass" if ok else "fail",
               f"{fraction:.0%} of copy time overlapped compute (want >= {OVERLAP_TARGET:.0%}); a 16-layer "
               f"{OVERLAP_WIDTH}-wide forward (everything resident) costs {ratio:.2f}x plain PyTorch (want <= "
               f"{RESIDENT_FORWARD_TARGET})", figures)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(interval[1], b) - max(interval[0], a)) for a, b in union)


# -- running checks -------------------------------------------------------------------------------------

WORKERS: dict[str, Callable[..., dict[str, Any]]] = {"budget": budget_worker, "sanitizer": sanitizer_worker,
                                                    "nccl": nccl_worker, "overlap": overlap_worker}
CHECKS: list[tuple[str, bool, Callable[[], Row]]] = [
    ("simulation", False, check_simulation), ("copy bandwidth", True, check_bandwidth),
    ("cuda sanitizer", True, check_sanitizer), ("cuda vs plain and simulation", True, check_parity),
    ("reserved memory vs budget", True, check_reserved), ("nccl", True, check_nccl),
    ("copy/compute overlap", True, check_overlap)]


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_worker(name: str, *args: Any, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chunkmem.selftest", name, json.dumps(args)],
                            env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish_worker(process: subprocess.Popen, timeout: float = 600) -> dict[str, Any]:
    out, err = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"worker {process.args!r} failed with status {process.returncode}: {err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_worker(name: str, *args: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
    return _finish_worker(_start_worker(name, *args, env=env))


def run_checks(only: list[str] | None = None) -> Iterator[Row]:
    gpu = torch.cuda.is_available()
    for name, needs_gpu, check in CHECKS:
        if only and name not in only:
            continue
        if needs_gpu and not gpu:
            yield Row(name, "skipped", NEEDS_GPU)
            continue
        try:
            yield check()
        except Exception as error:  # a check that breaks is a failed check, and the others still run
            yield Row(name, "fail", f"{type(error).__name__}: {error}"[-2000:])


def describe_machine() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "chunkmem": chunkmem.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["devices"] = torch.cuda.device_count()
    return info


if __name__ == "__main__":
    print(json.dumps(WORKERS[sys.argv[1]](*json.loads(sys.argv[2]))))
