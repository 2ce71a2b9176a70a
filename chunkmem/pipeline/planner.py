"""Which parallel layout to train a causal LM on N GPUs of one machine: data-parallel width D x pipeline
depth K (D * K = N) x micro-batch size x schedule, ranked by predicted throughput under the memory limits.

Memory comes from trace/planner.py, the runtime's own chunk layout on a meta model: a stage is the model
with ceil(L / K) of its L layers (embeddings and head included, so it bounds the first and the last stage),
its model data sharded over the D ranks that run it (ZeRO), activations for one micro-batch of the stage,
and the micro-batches a rank keeps in flight (schedule.in_flight: K for the first stage under 1F1B and 2BW)
saved beside them. 2BW adds the older weights version (the stage's parameter bytes, on the host when the
device is short), and runs with D = 1 only, as chunkmem.pipeline does.

[Note: the throughput model]
Seconds per mini-batch on the slowest rank, nothing overlapped (a bound, not a measurement):
  compute  6 * params * tokens / (N * FLOPS * efficiency), stretched by 1 / (1 - bubble) (the unit-cost
           simulator's bubble, schedule.bubble); efficiency = rows / (rows + HALF_ROWS) for a micro-batch
           of `rows` tokens (small GEMMs run below peak)
  streamed the share of a stage's model data the device cannot keep, read in again by each micro-batch's
           forward and backward, its gradient sent down once, over PCIE
  gathered under ZeRO (D > 1), the stage's parameters gathered for each forward and backward, its
           gradients reduced once, over LINK
FLOPS, PCIE and LINK are typical of one recent GPU, not measured: the ranking, not the seconds, is the point.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from chunkmem.pipeline.schedule import bubble, in_flight
from chunkmem.pipeline.scheduled import check_layout
from chunkmem.trace.planner import ModelSpec, Request, plan, shape_of
from chunkmem.trace.search import FLOPS, HALF_ROWS, PCIE

LINK = 100e9  # device <-> device bytes per second (NVLink class)
SCHEDULES = ("1f1b", "2bw", "interleaved", "zero-bubble")
VIRTUAL = 2  # stages per rank for the interleaved schedules
VIRTUAL_SCHEDULES = ("interleaved", "zero-bubble", "zbv")


@dataclasses.dataclass(frozen=True)
class Candidate:
    data_parallel: int
    stages: int
    microbatch: int  # sequences per micro-batch
    n_microbatches: int  # per pipeline and mini-batch
    schedule: str
    model_data_bytes: int  # per rank, the older 2BW version included
    device_need: int
    host_need_per_host: int
    verdict: str  # "fits" | "does not fit"
    bubble: float
    streamed_bytes: int  # per rank and mini-batch
    gathered_bytes: int
    seconds: float  # predicted per mini-batch

    @property
    def name(self) -> str:
        what = self.schedule if self.stages > 1 else "no pipeline"  # micro-batches accumulate gradients
        return f"D={self.data_parallel} x K={self.stages}, {self.microbatch}-sequence micro-batches, {what}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"name": self.name}


def stage_config(config: Any, stages: int) -> Any:
    """The model's config with the layers of its largest stage (embeddings and head kept)."""
    out = copy.deepcopy(config)
    field = "n_layer" if hasattr(out, "n_layer") else "num_hidden_layers"
    setattr(out, field, math.ceil(getattr(config, field) / stages))
    return out


def rank_layouts(config: Any, gpus: int, request: Request, schedules: tuple[str, ...] = SCHEDULES) -> list[Candidate]:
    """Every layout of `gpus` ranks for a mini-batch of `request.batch_size` sequences, best first: those
    that fit by predicted seconds, then the rest by how far past the device budget they are."""
    from chunkmem.trace.planner import meta_module

    specs: dict[int, ModelSpec] = {}

    def spec(k: int) -> ModelSpec:
        if k not in specs:
            specs[k] = ModelSpec(meta_module(stage_config(config, k)), shape_of(stage_config(config, k)), f"1/{k}")
        return specs[k]
    params = sum(p.numel() for p in meta_module(config).parameters())
    layers = shape_of(config).layers
    out = []
    for k in (k for k in range(1, gpus + 1) if gpus % k == 0 and k <= layers):
        d = gpus // k
        for rows in _divisors(request.batch_size // d) if request.batch_size % d == 0 else []:
            m = request.batch_size // (d * rows)
            for name in schedules if k > 1 else ("1f1b",):
                if _runs(name, k, m, d):
                    out.append(_candidate(spec(k), params, d, k, rows, m, name, request))
    return sorted(out, key=lambda c: (c.verdict != "fits", c.seconds if c.verdict == "fits" else c.device_need))


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _runs(name: str, k: int, m: int, d: int) -> bool:
    """Whether chunkmem.pipeline runs `name` so: the runner's own check, and a micro-batch per stage at least,
    which torch's schedules want (2BW, chunkmem's own, one fewer)."""
    try:
        check_layout(name, k, m, VIRTUAL if name in VIRTUAL_SCHEDULES else 1, d)
    except ValueError:
        return False
    return name == "2bw" or m >= k


def _candidate(spec: ModelSpec, params: int, d: int, k: int, rows: int, m: int, name: str,
               request: Request) -> Candidate:
    stage = plan(spec, dataclasses.replace(request, batch_size=rows, world_size=d))
    v = VIRTUAL if name in VIRTUAL_SCHEDULES else 1
    flights = in_flight(name, k, m, v)
    held = max(sum(n for s, n in flights.items() if s % k == r) for r in range(k)) / v  # micro-batches a rank holds
    stale = stage.model_data_by_kind["param"] if name == "2bw" else 0
    device_need = stage.device_need + int((held - 1) * stage.activation_forward_bytes)
    model_data = stage.model_data_bytes + stale
    per_host = (stage.host_need + stale) * d * k
    fits = device_need <= request.device_memory and per_host <= request.host_memory
    room = max(0, request.device_memory - (device_need - stage.working_set_bytes))  # what chunks may hold
    spill = max(0.0, 1 - room / model_data)
    param = stage.model_data_by_kind["param"]
    streamed = int(spill * (2 * m * param + stage.model_data_by_kind.get("grad", 0) + stale))
    gathered = int((2 * m + 1) * param * (d - 1)) if d > 1 else 0  # a rank's share is 1/D of the stage
    tokens = rows * request.seq_len
    compute = 6 * params * request.batch_size * request.seq_len / (d * k * FLOPS * tokens / (tokens + HALF_ROWS))
    share = bubble(name, k, m, v) if k > 1 else 0.0
    seconds = compute / (1 - share) + streamed / PCIE + gathered / LINK
    return Candidate(d, k, rows, m, name, model_data, device_need, per_host, "fits" if fits else "does not fit",
                     share, streamed, gathered, seconds)


def why(ranked: list[Candidate]) -> str:
    """Why the first layout wins over the best one of another shape or schedule."""
    if not ranked or ranked[0].verdict != "fits":
        return "no layout fits: more GPUs, more host memory, or activation checkpointing (--grad-ckpt)"
    best = ranked[0]
    fitting = [c for c in ranked[1:] if c.verdict == "fits"]
    shape = (best.data_parallel, best.stages, best.schedule)
    other = next((c for c in fitting if (c.data_parallel, c.stages, c.schedule) != shape), None) or \
        next(iter(fitting), None)
    if other is None:
        return f"{best.name} is the only layout that fits"
    gib = 2**30
    return (f"{best.name} wins, {other.seconds / best.seconds:.2f}x the next ({other.name}): bubble "
            f"{best.bubble:.0%} vs {other.bubble:.0%}, streamed {best.streamed_bytes / gib:.1f} vs "
            f"{other.streamed_bytes / gib:.1f} GiB and ZeRO-gathered {best.gathered_bytes / gib:.1f} vs "
            f"{other.gathered_bytes / gib:.1f} GiB per rank and mini-batch")
