"""Where chunkmem's overhead goes when the model fits: its per-step cost with each mechanism taken out.

    CHUNKMEM_SIM_CHECK=0 python -m benchmarks.overhead_parts --json benchmarks/results/overhead_parts_cpu_tiny.json

benchmarks/overhead.py measures chunkmem against plain PyTorch; this script says which of chunkmem's
mechanisms the difference pays for. Each row prepares one model per variant, everything fitting on the
device (so no chunk ever moves and every mechanism below can be taken out without changing where the data
is), and runs every step of that model, its warm-up included, with the variant's mechanisms replaced by
nothing:

  mode                  the torch-function mode around the forward: it catches parameters used outside
                        their module, casts BatchNorm's affine parameters, retries an op out of memory
  saved hooks           autograd's pack/unpack hooks: weights saved by chunk address, activations metered
                        (and offloaded when configured)
  per-op Python         the mode, the saved-tensor hooks and the module hooks' work together: what is left
                        is the module hooks' calls themselves, the gradient path and the optimizer
  resident              nothing patched: the steps after the warm-up run resident, as a fitting model's do
                        by default (runtime's Note on resident steps); every other variant, "full" included,
                        takes the full path every step, the path a model takes when chunks move
  resident, module      resident, with the modules' forward hooks kept on (they return at once), as before
  hooks kept            resident forwards took them off (Hooks._module_hooks): what taking them off gives back
                        is this row's extra less the resident row's
  resident, gradient    resident, with the parameters' gradient hooks kept on (each gradient taken into its
  hooks kept            chunk as autograd makes it), as before resident backwards took them off and took the
                        gradients at the backward's end (Hooks._grad_hooks)

Each round visits the variants in a shuffled order and times one plain step and one step of that
variant's model back to back, in a random order. "extra ms" is the median over rounds of the variant's time
less plain's in the same round; "saves ms" is the full chunkmem's extra less the variant's, what taking
those mechanisms out gives back. The knocked-out variants would not train correctly once chunks move
(fetches go missing); they are for timing.

With `--share` the model streams (a budget of its activation peak and that share of its model data, the host update
native and copies landing when waited for, as benchmarks/overhead.py's launch-bound rows) and forwards after the first
step on the plan run lean, as by default; the one mechanism taken out is the saved-tensor hooks ("lean, no saved
hooks"): no Python call per saved tensor in forward and backward, and no access per saved parameter in backward. That
variant cannot train once chunks move (a saved parameter keeps its evicted slot, arena.py's Note, so backward brings
nothing back and the device holds more than its budget), so what it saves is an upper bound on what a design without
those hooks could give back: one whose parameter chunks keep one storage on the device whose memory comes and goes
(FSDP's resize of its storage), fetched by a hook before each unit's backward rather than at each saved parameter.
"lean, units of one chunk" makes no unit of a module over two chunks (units.py's Note): its "saves" column is
negative by what such units give back. They are made only where two chunks are a small share of the budget, as a
1.16B LLaMA's 250 MiB chunks are of its GPU budget; this tiny model's default chunks are twice that share, and
`--chunk-size 65536` (its largest parameter) brings them to it.

    CHUNKMEM_SIM_CHECK=0 CHUNKMEM_SIM_MEMORY=0 python -m benchmarks.overhead_parts --layers 20 --vocab 1024 \
        --models llama --dtypes bf16 --as-cuda --cpu-time --share 0.5 --rounds 30 [--fused] [--chunk-size 65536]

The models are tiny by default, so that compute costs next to nothing and the figures are chunkmem's own
work in absolute terms: what each mechanism costs does not grow with the model's width, only with its
number of modules, ops and parameters. At benchmarks/overhead.py's sizes (`--width 256 --vocab 8192
--batch 4 --seq 128 --mlp-width 1024`) the parts are 1-4 ms of 60-160 ms steps, below the 3-6% by which
two twins of one model differ on this machine (benchmarks/overhead.py's A/A rows): the columns are noise
there. The gradient copy is not a variant: it costs nothing on tiny models, and at full size a trial
variant that skipped it measured slower than the full step, so it did not isolate the copy. Timed alone,
the copy is one pass over every gradient byte (the README's overhead section).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from benchmarks.common import table, timed, write_json
from benchmarks.overhead import (CLOCK, DTYPES, Step, add_model_arguments, chunk_step, loss_fn, models, plain_step,
                                 use_chunk_size, use_cpu_time, use_fused)
from chunkmem.runtime import hooks, units
from chunkmem.runtime import runtime as runtime_module
from chunkmem.runtime.runtime import Runtime


MODE = mock.patch.object(hooks, "FetchMode", lambda _runtime: contextlib.nullcontext())
SAVED = mock.patch.object(torch.autograd.graph, "saved_tensors_hooks", lambda *_: contextlib.nullcontext())
MODULE_WORK = mock.patch.multiple(Runtime, enter=lambda *_: None, leave=lambda *_: None)
_MODULE_HOOKS, _GRAD_HOOKS = hooks.Hooks._module_hooks, hooks.Hooks._grad_hooks
KEEP_HOOKS = mock.patch.object(hooks.Hooks, "_module_hooks", lambda self, _on: _MODULE_HOOKS(self, True))
KEEP_GRAD_HOOKS = mock.patch.object(hooks.Hooks, "_grad_hooks", lambda self, _on: _GRAD_HOOKS(self, True))
VARIANTS: dict[str, tuple[Any, ...]] = {
    "full": (),
    "no mode": (MODE,),
    "no saved hooks": (SAVED,),
    "no per-op Python": (MODE, SAVED, MODULE_WORK),
    "resident": (),
    "resident, module hooks kept": (KEEP_HOOKS,),
    "resident, gradient hooks kept": (KEEP_GRAD_HOOKS,),
}
RESIDENT = "resident"  # the variants whose steps run resident, as a fitting model's do by default
# With --share, chunks stream, forwards after the first step on the plan run lean (as by default), and what is taken out
# is the saved-tensor hooks: an upper bound on what a design without them could give back (the Note below).
STREAMING: dict[str, tuple[Any, ...]] = {"lean": (), "lean, no saved hooks": (SAVED,)}
# A unit over two chunks (units.py's Note) made one chunk at most, as before: what such units give back.
ONE_CHUNK_UNITS = mock.patch.object(runtime_module, "access_units",
                                    lambda module, chunk_of, span=1: units.access_units(module, chunk_of))
STREAMING["lean, units of one chunk"] = (ONE_CHUNK_UNITS,)


@contextlib.contextmanager
def _without(patches: tuple[Any, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _variant_step(make: Callable[[], torch.nn.Module], loss: Callable[[torch.nn.Module], torch.Tensor], dtype: str,
                  patches: tuple[Any, ...], resident: bool = False, as_cuda: bool = False,
                  memory: int | None = None) -> Step:
    """A chunkmem model whose every step, from its warm-up on, runs without the given mechanisms (and on the full
    path unless `resident`; `as_cuda`: benchmarks/overhead.py's --as-cuda; `memory`: Config.device_memory, the host
    update native and copies landing when waited for, as the launch-bound rows of benchmarks/overhead.py)."""
    native, landing = (True, "wait") if memory is not None else (None, None)
    with _without(patches):
        step, _ = chunk_step(make(), loss, dtype, memory, resident=resident, native=native, landing=landing,
                             as_cuda=as_cuda)

    def run() -> None:
        with _without(patches):
            step()
    for _ in range(2):  # warm-up, then the first step on the plan
        run()
    return run


def measure(make: Callable[[], torch.nn.Module], loss: Callable[[torch.nn.Module], torch.Tensor], dtype: str,
            rounds: int, order: random.Random, as_cuda: bool = False, share: float | None = None
            ) -> dict[str, list[float]]:
    """Per variant, its time less plain's in each round (seconds); "plain" holds plain's own times. With `share`, the
    STREAMING variants, under the activation peak plus that share of the model data (benchmarks/overhead.py's rows)."""
    if share is None:
        steps = {name: _variant_step(make, loss, dtype, patches, name.startswith(RESIDENT), as_cuda)
                 for name, patches in VARIANTS.items()}
    else:
        probe, wrapped = chunk_step(make(), loss, dtype, None, as_cuda=as_cuda)
        probe(), probe()  # warm-up, then the first step on the plan: the activation peak and the model data
        memory = int(wrapped.runtime.activations.peak + share * wrapped.memory_stats()["model_data_bytes"])
        steps = {name: _variant_step(make, loss, dtype, patches, True, as_cuda, memory)
                 for name, patches in STREAMING.items()}
    plain = plain_step(make(), loss, DTYPES[dtype])
    plain()
    extra: dict[str, list[float]] = {"plain": [], **{name: [] for name in steps}}
    for _ in range(rounds):
        for name in order.sample(list(steps), len(steps)):
            times = {}
            for side in order.sample(["plain", name], 2):
                times[side] = timed(plain if side == "plain" else steps[name], CLOCK[0])
            extra[name].append(times[name] - times["plain"])
            extra["plain"].append(times["plain"])
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, width=64, vocab=256, batch=1, seq=16, mlp_width=32)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--as-cuda", action="store_true", help="as benchmarks/overhead.py's")
    parser.add_argument("--cpu-time", action="store_true", help="as benchmarks/overhead.py's: this thread's CPU "
                        "time, torch computing on it alone (steady on a loaded machine)")
    parser.add_argument("--share", type=float, default=None, help="chunks stream: a budget of the activation peak "
                        "and this share of the model data (0.5: benchmarks/overhead.py's 50%% rows); the variants are "
                        "then the lean forward's, with and without the saved-tensor hooks")
    parser.add_argument("--fused", action="store_true", help="as benchmarks/overhead.py's: AdamW(fused=True) on both "
                        "sides, as the GPU speed issue's plain PyTorch")
    parser.add_argument("--chunk-size", type=int, default=None, help="Config.chunk_size (elements a chunk) for every "
                        "chunkmem model: chunks that are a smaller share of the budget, as a GPU's at its scale")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.cpu_time:
        use_cpu_time()
    if args.chunk_size is not None:
        use_chunk_size(args.chunk_size)
    if args.fused:
        use_fused()
    variants = VARIANTS if args.share is None else STREAMING
    first, *rest = variants  # the whole step, then what each variant takes out of it

    made = models(args)
    order = random.Random(0)
    rows, raw = [], {}
    for name in args.models:
        make, batch = made[name]
        for dtype in args.dtypes:
            loss = loss_fn(name, batch, DTYPES[dtype])
            extra = measure(make, loss, dtype, args.rounds, order, args.as_cuda, args.share)
            full = statistics.median(extra[first])
            row: dict[str, Any] = {"model": name, "dtype": dtype,
                                   "plain ms": round(1000 * statistics.median(extra["plain"]), 2)}
            for variant in variants:
                median = statistics.median(extra[variant])
                row[f"{variant}: extra ms"] = round(1000 * median, 2)
                if variant in rest:
                    row[f"{variant}: saves ms"] = round(1000 * (full - median), 2)
            rows.append(row)
            raw[f"{name} {dtype}"] = {k: [round(1000 * x, 3) for x in v] for k, v in extra.items()}
    print(f"{args.rounds} shuffled rounds; extra = the variant's step less plain PyTorch's, median ms")
    short = ["model", "dtype", "plain ms", f"{first}: extra ms", *(f"{v}: saves ms" for v in rest)]
    print(table(rows, short))
    write_json(args.json, {"benchmark": "overhead_parts", "args": vars(args), "rows": rows, "ms": raw})


if __name__ == "__main__":
    main()
