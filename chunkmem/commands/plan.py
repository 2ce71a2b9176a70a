"""`chunkmem plan MODEL`: will it fit, what binds, and what to change (see chunkmem/trace/planner.py).

MODEL is a local Hugging Face directory or config.json, or the size is given with
--layers/--hidden/--vocab (a GPT-2 of that size; --params alone picks the hidden size for
--layers). Exit status: 0 fits or tight, 1 does not fit (or, with --simulate, a simulated step ran out of
the budget), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from chunkmem.commands import json_output
from chunkmem.config import DEFAULT_DTYPE

VERDICTS = ("fits", "tight", "does not fit")
HELP = "will a model fit: model data per device and host, activations, verdict and ranked fixes"
MAX_PARAMS = 1e15  # a quadrillion: far beyond any model, short of the sizes whose arithmetic overflows
DEFAULT_SEQ_LEN = 1024  # --seq-len's default, or MODEL's maximum if less
DEFAULT_VOCAB = 50257  # --vocab's default: GPT-2's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="local Hugging Face directory or config.json")
    size = parser.add_argument_group("size without a config (a GPT-2 of that size)")
    size.add_argument("--params", type=float, help="parameter count, e.g. 1.3e9 (with --layers)")
    size.add_argument("--layers", type=int)
    size.add_argument("--hidden", type=int)
    size.add_argument("--vocab", type=int, help=f"vocabulary size (default {DEFAULT_VOCAB}, GPT-2's)")
    run_ = parser.add_argument_group("the run")
    run_.add_argument("--device-memory", default="24GiB", help="device budget")
    run_.add_argument("--host-memory", default="64GiB", help="host memory for chunks")
    run_.add_argument("--batch-size", type=int, default=8)
    run_.add_argument("--seq-len", type=int, help=f"tokens per sample (default {DEFAULT_SEQ_LEN}, or MODEL's maximum "
                      "if less)")
    run_.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["fp32", "bf16", "fp16"],
                      help="compute dtype (as chunkmem finetune and chunkmem.Config use)")
    run_.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    run_.add_argument("--offload-activations", action="store_true")
    run_.add_argument("--world-size", type=int, default=1, help="ranks sharing model data (ZeRO)")
    run_.add_argument("--ranks-per-host", type=int, help="ranks on one machine, sharing its --host-memory "
                      "(default: all of --world-size, one machine)")
    run_.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                      help="cuda: keep margins for the CUDA context and host libraries (default); cpu: plan a "
                           "run in the CPU simulation (Config(device='cpu')), as --simulate does")
    run_.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd-momentum"])
    run_.add_argument("--overlap-update", action="store_true", help="the time model with host updates made ahead of "
                      "step(), overlapping backward (Config(overlap_update=True))")
    run_.add_argument("--disk", action="store_true", help="with a disk tier (Config(disk=DIR)): master weights and "
                      "optimizer states that host memory cannot hold go to disk")
    run_.add_argument("--attention", choices=["math", "fused"],
                      help="math: PyTorch's unfused path (CPU, eager); fused: flash/memory-efficient "
                           "(default: fused on CUDA, math with --device cpu or --simulate)")
    run_.add_argument("--gpus", type=int, help="rank parallel layouts (data parallel x pipeline stages x "
                      "micro-batch size x schedule) of this many GPUs on one machine; --batch-size is the mini-batch")
    parser.add_argument("--simulate", action="store_true", help="also run one real step in the CPU simulation "
                        "with this budget and compare")
    parser.add_argument("--chunk-sizes", action="store_true", help="with --simulate: also simulate a few other chunk "
                        "sizes (finer and coarser than the default) and rank them all by the time model's predicted "
                        "step, for Config(chunk_size=...) or `chunkmem finetune --chunk-size`; each takes as long as "
                        "the first simulation")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _error(message: str) -> int:
    print(f"chunkmem plan: {message}", file=sys.stderr)
    return 2


def _budget(field: str, value: str | None) -> int:
    """A memory budget in bytes. The parser gives each flag a default; None comes only from a
    Namespace built by hand, and the planner needs a number."""
    from chunkmem.config import parse_size

    size = parse_size(field, value)
    if size is None:
        raise ValueError(f"Config.{field}={value!r}: expected a size like '24GiB'")
    return size


def _config(args: argparse.Namespace) -> Any:
    from chunkmem.finetune.hf import max_positions, resolve
    from chunkmem.trace.planner import gpt2_config

    if args.model:
        sizes = {"--layers": args.layers, "--hidden": args.hidden, "--params": args.params, "--vocab": args.vocab}
        given = [flag for flag, value in sizes.items() if value is not None]
        if given:
            raise ValueError(f"MODEL {args.model} with {' and '.join(given)}: the model's config gives its size; pass "
                             "one or the other")
        config = resolve(args.model).config
        limit = max_positions(config)
        if args.seq_len is None:  # the default, within what the model takes
            args.seq_len = min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN)
        elif limit is not None and args.seq_len > limit:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's maximum of {limit} positions "
                             f"(config of {args.model}): use --seq-len {limit} or less")
        return config
    args.seq_len = args.seq_len or DEFAULT_SEQ_LEN
    layers, hidden = args.layers, args.hidden
    if hidden is None and args.params and layers:
        hidden = int(math.sqrt(args.params / (12 * layers)) / 64 + 0.5) * 64 or 64  # 12*h^2 per GPT-2 layer
    if not layers or not hidden:
        sizes = {"layers": layers, "hidden": hidden, "params": args.params}
        got = " ".join(f"--{name} {value:g}" for name, value in sizes.items() if value)
        raise ValueError(f"{f'got {got}: ' if got else ''}give MODEL (a Hugging Face directory or config.json), or "
                         "--layers with --hidden or with --params, e.g. `chunkmem plan --layers 24 --hidden 2048` or "
                         "`chunkmem plan --layers 24 --params 1.3e9`")
    return gpt2_config(layers, hidden, args.vocab or DEFAULT_VOCAB, max(args.seq_len, 1024))


def run(args: argparse.Namespace) -> int:
    with json_output(args.json) as stdout:
        return _run(args, stdout)


def _run(args: argparse.Namespace, stdout: Any, shown: int = 5) -> int:
    from chunkmem.finetune.hf import InputError
    from chunkmem.trace.planner import Request, fixes, plan, spec_from_config
    from chunkmem.trace.search import HOST_UPDATE, PCIE, options, step_seconds

    for name in ("batch_size", "seq_len", "world_size", "ranks_per_host", "layers", "hidden", "vocab", "gpus"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            return _error(f"--{name.replace('_', '-')} {value}: expected a positive whole number")
    if args.params is not None and not 0 < args.params <= MAX_PARAMS:
        return _error(f"--params {args.params}: expected a positive parameter count up to {MAX_PARAMS:g}, e.g. 1.3e9")
    if args.chunk_sizes and not args.simulate:
        return _error("--chunk-sizes ranks chunk sizes by simulating each: add --simulate")
    if args.overlap_update and (args.dtype == "fp32" or args.optimizer != "adam"):
        return _error(f"--overlap-update with --dtype {args.dtype} --optimizer {args.optimizer}: host updates are made "
                      "ahead of step() for Adam in bf16 or fp16 only (chunkmem/runtime/ahead.py)")
    try:
        device_memory = _budget("device_memory", args.device_memory)
        host_memory = _budget("host_memory", args.host_memory)
        config = _config(args)
    except (ValueError, InputError) as error:
        return _error(str(error).replace("Config.", "--").replace("_memory", "-memory"))
    attention = args.attention or ("math" if args.simulate or args.device == "cpu" else "fused")
    request = Request(device_memory, host_memory, args.batch_size, args.seq_len, args.dtype, args.grad_ckpt,
                      args.offload_activations, args.world_size, args.optimizer, attention,
                      cuda=args.device == "cuda" and not args.simulate, ranks_per_host=args.ranks_per_host,
                      disk=args.disk)
    if args.gpus:
        return _layouts(config, args.gpus, request, args.json, stdout)
    try:
        spec = spec_from_config(config, getattr(config, "model_type", "model"))
    except ValueError as error:  # a config transformers reads but cannot build (heads that do not divide the width)
        return _error(f"{args.model}: transformers cannot build a causal LM from it: {error}")
    estimate = plan(spec, request)
    found = options(spec, request)
    better = [o for o in found if VERDICTS.index(o.estimate.verdict) < VERDICTS.index(estimate.verdict)]
    result: dict[str, Any] = {**estimate.to_json(), "model": args.model or "synthetic GPT-2",
                              "seconds": step_seconds(spec, estimate, request.batch_size * request.seq_len),
                              "combinations": [o.to_json() for o in better[:shown]],
                              "fixes": [{"fix": label, "verdict": e.verdict, "device_need": e.device_need,
                                         "host_need": e.host_need, "host_need_per_host": e.host_need_per_host,
                                         "disk_bytes": e.disk_bytes,
                                         "request": e.request.to_json()} for label, e in fixes(spec, request)]}
    if args.simulate:
        import torch

        from chunkmem.errors import MemoryBudgetError
        from chunkmem.trace.simulate import simulate

        try:
            # Homes as a GPU machine at the time model's typical speeds would choose them (the native kernel is on
            # with CUDA): by time (chunks/planning.py's Note on homes by time).
            measured = simulate(config, request, estimate, record=True, host_weight=PCIE / HOST_UPDATE)
        except MemoryError as error:
            return _error(str(error))
        except (MemoryBudgetError, torch.OutOfMemoryError) as error:
            # A budget the estimate accepted that a simulated step outgrew (CUDA's own error where nothing falls back).
            result["time_model"] = {"failure": str(error)}
        else:
            result["simulated"] = dict(measured.to_json(), estimate_error=estimate.activation_forward_bytes /
                                       max(1, measured.activation_peak) - 1)
            result["time_model"] = _time_model(spec, request, measured.recorded, args.overlap_update)
            if args.chunk_sizes:
                result["chunk_sizes"] = _chunk_sizes(config, spec, request, estimate, measured, args.overlap_update)
    print(json.dumps(result, indent=1) if args.json else _text(result), file=stdout)
    return 1 if estimate.verdict == "does not fit" or "failure" in result.get("time_model", {}) else 0


def _time_model(spec: Any, request: Any, recorded: Any, overlap: bool) -> dict[str, Any]:
    """The simulated step replayed at typical GPU speeds (trace/timing.py): predicted seconds, by stage, the copies'
    share hidden behind compute, and the step's lower bound (plain's compute and device update, the host update
    alone, or the bytes moved over PCIe). `overlap`: with host updates made ahead of step()."""
    from chunkmem.trace.search import typical_speeds
    from chunkmem.trace.timing import predict

    speeds = typical_speeds(spec, request, recorded)
    got = predict(recorded, speeds, overlap)
    plain = sum(speeds.compute.values()) + sum(recorded.sizes.values()) / speeds.device_update
    return {"step_s": got.step_s, "stage_s": got.stage_s, "h2d_bytes": got.h2d_bytes, "d2h_bytes": got.d2h_bytes,
            "overlap": got.overlap, "host_update_s": got.host_update_s, "bound_s": got.bound(plain, speeds)}


def _chunk_sizes(config: Any, spec: Any, request: Any, estimate: Any, measured: Any,
                 overlap: bool) -> list[dict[str, Any]]:
    """The default chunk size (`measured`'s) and each band's (chunks/layout.py's chunk_size_bands) simulated and
    replayed by the time model, fastest first; a size whose budget did not hold, last, with why."""
    import torch
    from transformers import AutoModelForCausalLM

    from chunkmem.chunks.layout import chunk_size_bands
    from chunkmem.errors import MemoryBudgetError
    from chunkmem.trace.search import HOST_UPDATE, PCIE
    from chunkmem.trace.simulate import simulate

    with torch.device("meta"):
        named = [(n, p.numel()) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]

    def row(run: Any, default: bool) -> dict[str, Any]:
        return {"chunk_size": run.chunk_size, "default": default, "model_data_bytes": run.model_data_bytes,
                **_time_model(spec, request, run.recorded, overlap)}

    rows = [row(measured, True)]
    for size in chunk_size_bands(named, besides=measured.chunk_size):
        try:
            rows.append(row(simulate(config, request, estimate, record=True, host_weight=PCIE / HOST_UPDATE,
                                     chunk_size=size), False))
        except (MemoryBudgetError, torch.OutOfMemoryError) as error:
            rows.append({"chunk_size": size, "default": False, "failure": str(error)})
    return sorted(rows, key=lambda r: r.get("step_s", math.inf))


def _layouts(config: Any, gpus: int, request: Any, as_json: bool, stdout: Any, shown: int = 10) -> int:
    """`--gpus N`: the layouts ranked (chunkmem/pipeline/planner.py); exit status 1 when none fits."""
    from chunkmem.pipeline.planner import rank_layouts, why

    ranked = rank_layouts(config, gpus, request)
    if as_json:
        print(json.dumps({"gpus": gpus, "request": request.to_json(), "why": why(ranked),
                          "layouts": [c.to_json() for c in ranked]}, indent=1), file=stdout)
    else:
        print(f"{gpus} GPUs of {_gib(request.device_memory).strip()}, host {_gib(request.host_memory).strip()}, "
              f"mini-batch {request.batch_size} x {request.seq_len} tokens, {request.dtype}")
        for i, c in enumerate(ranked[:shown], 1):
            print(f"  {i:2}. {c.name}: {c.verdict}, {c.seconds:.3g} s/mini-batch (predicted), device "
                  f"{_gib(c.device_need).strip()}, host {_gib(c.host_need_per_host).strip()}, bubble {c.bubble:.0%}")
        print(why(ranked))
    return 0 if ranked and ranked[0].verdict == "fits" else 1


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB" if n >= 2**30 else f"{n / 2**20:8.2f} MiB"


def _host(per_rank: int, per_host: int, ranks: int) -> str:
    """Host memory per rank and, when ranks share a machine, per machine: the figure to hold against RAM."""
    if ranks == 1:
        return _gib(per_rank)
    return f"{_gib(per_rank).strip()} per rank, {_gib(per_host).strip()} per host ({ranks} ranks)"


def _needs(option: dict[str, Any]) -> str:
    host = _host(option["host_need"], option["host_need_per_host"], option["request"]["hosted_ranks"]).strip()
    disk = f", disk {_gib(option['disk_bytes']).strip()}" if option["disk_bytes"] else ""
    return f" (device {_gib(option['device_need']).strip()}, host {host}{disk})"


def _text(r: dict[str, Any]) -> str:
    q = r["request"]
    lines = [f"model {r['model']}: {r['trainable_chunks']} + {r['frozen_chunks']} frozen chunks of {r['chunk_size']} "
             f"elements; batch {q['batch_size']} x {q['seq_len']} tokens, {q['dtype']}"
             f"{', checkpointing' if q['checkpointing'] else ''}, world {q['world_size']}",
             f"  model data per rank  {_gib(r['model_data_bytes'])}  "
             + ", ".join(f"{k} {_gib(v).strip()}" for k, v in r["model_data_by_kind"].items()),
             f"  activations (peak)   {_gib(r['activation_bytes'])}",
             f"  device working set   {_gib(r['working_set_bytes'])}   margins {_gib(r['margin_bytes'])}",
             f"  device need          {_gib(r['device_need'])} of {_gib(q['device_memory'])} "
             f"(all chunks resident: {_gib(r['device_all_resident'])})",
             f"  host need            {_host(r['host_need'], r['host_need_per_host'], r['request']['hosted_ranks'])}"
             f" of {_gib(q['host_memory'])} (pinned {_gib(r['pinned_bytes']).strip()} per rank)",
             f"verdict: {r['verdict']} (binding: {r['binding']})"]
    if r["disk_bytes"]:
        lines.insert(-1, f"  disk tier            {_gib(r['disk_bytes'])} per rank on disk, about that read and "
                         "written back each step")
    lines.append(f"predicted step as asked: {r['seconds']:.3g} s "
                 "(a bound from typical GPU speeds: chunkmem/trace/search.py)")
    if r["verdict"] != "fits" and r["combinations"]:
        best, *others = r["combinations"]
        lines.append(f"cheapest change that fits: {' + '.join(best['changes'])}: {best['verdict']}, "
                     f"{best['seconds']:.3g} s a step predicted{_needs(best)}")
        lines += [f"  or {' + '.join(o['changes'])}: {o['seconds']:.3g} s{_needs(o)}" for o in others[:2]]
    else:
        if r["verdict"] != "fits":
            lines.append("no combination of dtype, checkpointing, activation offload, disk tier, micro-batch and "
                         "LoRA does better; one change at a time:")
        lines += [f"  {i}. {fix['fix']}: {fix['verdict']}{_needs(fix)}" for i, fix in enumerate(r["fixes"], 1)]
    if "simulated" in r:
        s = r["simulated"]
        lines.append(f"simulated: activation peak {_gib(s['activation_peak'])} vs estimate "
                     f"{_gib(r['activation_forward_bytes'])} ({s['estimate_error']:+.1%}); model data "
                     f"{_gib(s['model_data_bytes'])}; step {s['seconds']:.2f}s")
    t = r.get("time_model")
    if t is not None and "failure" in t:
        lines.append(f"simulated steps: FAILED, the budget did not hold: {t['failure']}")
    elif t is not None:
        lines.append(f"time model of that step on a GPU: {t['step_s']:.3g} s predicted (forward / backward / optimizer "
                     + " / ".join(f"{t['stage_s'][k] * 1000:.3g}" for k in ("fwd", "bwd", "optim"))
                     + f" ms), {_gib(t['h2d_bytes']).strip()} up and {_gib(t['d2h_bytes']).strip()} down, "
                     f"{t['overlap']:.0%} of copy time hidden, bound {t['bound_s']:.3g} s (chunkmem/trace/timing.py)")
    if "chunk_sizes" in r:
        lines.append("chunk sizes by the time model's predicted step:")
        lines += [f"  {c['chunk_size']:>12} elements{' (default)' if c['default'] else '          '}  "
                  + (f"{c['step_s']:.3g} s, {_gib(c['h2d_bytes']).strip()} up, {_gib(c['d2h_bytes']).strip()} down"
                     if "step_s" in c else f"the budget did not hold: {c['failure']}") for c in r["chunk_sizes"]]
        best, default = r["chunk_sizes"][0], next(c for c in r["chunk_sizes"] if c["default"])
        if not best["default"] and "step_s" in best:
            lines.append(f"fastest: Config(chunk_size={best['chunk_size']}) or --chunk-size {best['chunk_size']}, "
                         f"{1 - best['step_s'] / default['step_s']:.0%} shorter than the default's predicted step")
        elif best["default"]:
            lines.append("fastest: the default")
    return "\n".join(lines)
