"""The largest model one device fine-tunes: chunkmem against plain PyTorch (issue 7).

    python -m benchmarks.finetune_scale --device cuda --device-memory 20GiB --host-memory 200GiB \
        --family gpt2 --hidden 1024,1600,2048,2560,3072,4096,5120 --json benchmarks/results/finetune_scale_cuda.json
    python -m benchmarks.finetune_scale --device cpu --device-memory 32MiB --host-memory 2GiB \
        --vocab 1024 --batch-size 1 --seq-len 32 --json benchmarks/results/finetune_scale_cpu.json

Configs grow along a ladder of widths (layers = heads = width / 64; GPT-2 or LLaMA style; random
weights) until chunkmem no longer trains one. At each width:
  chunkmem  built on the meta device, prepared with the budgets, random weights written into its
            chunks, one warm-up step then --steps timed steps of AdamW. It trains if no step raises
            (MemoryBudgetError, out of memory) and the device held at most the budget at every
            moment: on CUDA the allocator's peak (the process is capped at the budget with
            set_per_process_memory_fraction), in the CPU simulation chunk bytes plus saved
            activations, read at every moment. A width whose chunks the planner says the host
            cannot hold is not built.
  plain     the model on the device with torch.optim.AdamW (bf16: autocast over fp32 weights, the
            usual recipe), tried while the widths below fitted. On CUDA it fits unless it runs out of
            memory under the same cap. In the CPU simulation nothing limits the CPU, so it fits when
            its model data (weights, gradients, two Adam states: 16 bytes a parameter) plus the
            activations its step saved (measured) stay within the budget; it still runs, for tokens/s.
The CPU simulation proves the script and the search, not the scale: its numbers are of a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Any

import psutil
import torch
from torch import nn

import chunkmem
from benchmarks.common import table, write_json
from chunkmem.chunks.observe import Moment, Move
from chunkmem.config import parse_size
from chunkmem.errors import MemoryBudgetError
from chunkmem.finetune import hf
from chunkmem.runtime.activations import ActivationMeter, Saved
from chunkmem.trace.planner import ModelSpec, Request, meta_module, plan, shape_of

WIDTHS = "128,192,256,320,384,448,512,576,640,768,1024,1280,1600,2048,2560,3072,4096,5120,6144,8192"


def ladder_config(family: str, hidden: int, vocab: int, seq: int) -> Any:
    from transformers import GPT2Config, LlamaConfig

    heads = max(1, hidden // 64)
    layers = max(2, heads)
    if family == "gpt2":
        return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=max(seq, 128),
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return LlamaConfig(hidden_size=hidden, intermediate_size=64 * round(8 * hidden / 3 / 64), num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                       max_position_embeddings=max(seq, 128), tie_word_embeddings=False, bos_token_id=0,
                       eos_token_id=0)


class DevicePeak:
    """Observer: the most bytes the simulated device holds at a moment (chunks and saved activations)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.peak = 0

    def moment(self, moment: Moment) -> None:
        held = sum(self.runtime.data.model_bytes()["device"].values()) + self.runtime.nonmodel_bytes()
        self.peak = max(self.peak, held)

    def moved(self, move: Move) -> None:
        pass


def train(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, steps: int,
          autocast: torch.dtype | None = None) -> float:
    """Seconds for `steps` optimizer steps on one batch."""
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast(ids.device.type, autocast) if autocast else contextlib.nullcontext():
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def checkpointing(model: Any) -> None:
    """Activation checkpointing as `chunkmem finetune --grad-ckpt` turns it on (non-reentrant)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def cuda_peak(reset: bool = True) -> int:
    peak = torch.cuda.max_memory_allocated()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def randomize(model: Any) -> None:
    """Random weights straight into the chunks (the model was built on meta: no second copy)."""
    gen = torch.Generator().manual_seed(0)
    for record in model.runtime.store.records.values():
        if len(record.shape) >= 2:
            value = torch.randn(record.shape, generator=gen) * 0.02
        else:
            value = torch.ones(record.shape) if record.name.endswith("weight") else torch.zeros(record.shape)
        model.runtime.data.set_value(record, value)


def run_chunkmem(config: Any, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    module = hf.build(config, on_meta=True)
    if args.grad_ckpt:
        checkpointing(module)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    model: Any = None
    try:
        model, optimizer = chunkmem.prepare(module, optimizer, chunkmem.Config(
            device=args.device, device_memory=args.device_memory, host_memory=args.host_memory, dtype=args.dtype))
        randomize(model)
        watcher = DevicePeak(model.runtime)
        model.runtime.observers.append(watcher)
        if cuda:
            cuda_peak()
        train(model, optimizer, ids, 1)
        warm_peak, watcher.peak = (cuda_peak() if cuda else watcher.peak), 0
        before = model.memory_stats()
        seconds = train(model, optimizer, ids, args.steps)
        steady_peak = cuda_peak() if cuda else watcher.peak
        stats = model.memory_stats()
    except Exception as error:  # noqa: BLE001 - only running out of memory is an answer; the rest is a bug
        return _failed(error)
    finally:
        del model, optimizer, module
        _release(cuda)
    peak = max(warm_peak, steady_peak)
    over = f"the device held {peak / 2**20:.1f} MiB at its peak, over the budget" if peak > args.device_memory else None
    return {"fits": over is None, "error": over,
            "tokens_per_s": round(ids.numel() * args.steps / seconds, 1),
            "device_peak_warmup": warm_peak, "device_peak_steady": steady_peak,
            "device_chunk_peak": stats["device_chunk_bytes_peak"], "model_data_bytes": stats["model_data_bytes"],
            "h2d_per_step": (stats["h2d_bytes"] - before["h2d_bytes"]) // args.steps,
            "d2h_per_step": (stats["d2h_bytes"] - before["d2h_bytes"]) // args.steps,
            "host_rss": psutil.Process().memory_info().rss}


def run_plain(config: Any, args: argparse.Namespace, ids: torch.Tensor, params: int) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    model_data = 16 * params  # fp32 weights, gradients, exp_avg, exp_avg_sq
    if not cuda and model_data > args.device_memory:
        return {"fits": False, "need_bytes": model_data, "error": "its model data alone exceeds the budget"}
    autocast = torch.bfloat16 if args.dtype == "bf16" else torch.float16 if args.dtype == "fp16" else None
    model: Any = None
    optimizer: Any = None
    try:
        model = hf.build(config, on_meta=False)
        model.to(ids.device)
        if args.grad_ckpt:
            checkpointing(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if cuda:
            cuda_peak()
            train(model, optimizer, ids, 1, autocast)
            seconds = train(model, optimizer, ids, args.steps, autocast)
            need = cuda_peak()
        else:
            activations = saved_activations(model, ids, autocast)
            seconds = train(model, optimizer, ids, args.steps, autocast)
            need = model_data + activations
    except Exception as error:  # noqa: BLE001 - as in run_chunkmem
        return _failed(error)
    finally:
        del model, optimizer
        _release(cuda)
    return {"fits": need <= args.device_memory, "need_bytes": need,
            "tokens_per_s": round(ids.numel() * args.steps / seconds, 1)}


def saved_activations(model: nn.Module, ids: torch.Tensor, autocast: torch.dtype | None) -> int:
    """Peak bytes autograd saves for backward in one plain step (weights excluded), as chunkmem counts them."""
    meter = ActivationMeter()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> Any:
        return tensor if tensor.untyped_storage().data_ptr() in weights else meter.wrap(tensor)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.get(meter) if isinstance(s, Saved) else s):
        with torch.autocast(ids.device.type, autocast) if autocast else contextlib.nullcontext():
            loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


def _failed(error: Exception) -> dict[str, Any]:
    """A run that ran out of memory, as a result; any other error is raised again."""
    text = str(error)
    memory = isinstance(error, (MemoryBudgetError, torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and any(w in text.lower() for w in ("out of memory", "alloc", "hostregister")))
    if not memory:
        raise error
    return {"fits": False, "error": f"{type(error).__name__}: {text[:300]}"}


def _release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def host_check(config: Any, args: argparse.Namespace) -> str | None:
    """Why this width is not built (the planner: its chunks would not fit the host budget), or None."""
    module = meta_module(config)
    request = Request(args.device_memory, args.host_memory, args.batch_size, args.seq_len, args.dtype, args.grad_ckpt,
                      cuda=args.device.startswith("cuda"))
    estimate = plan(ModelSpec(module, shape_of(config), args.family), request)
    limit = min(args.host_memory, int(psutil.virtual_memory().available * 0.8))
    if estimate.host_need > limit:
        return f"planner: host need {estimate.host_need / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB available"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--device-memory", required=True, help="the device budget, e.g. 20GiB (or 32MiB simulated)")
    parser.add_argument("--host-memory", required=True, help="host memory for chunks, e.g. 200GiB")
    parser.add_argument("--hidden", default=WIDTHS, help="widths to try, in order (default: %(default)s)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default: 50257 for gpt2, 32000 for llama)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--grad-ckpt", action="store_true")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.device_memory = parse_size("device_memory", args.device_memory)
    args.host_memory = parse_size("host_memory", args.host_memory)
    vocab = args.vocab or (50257 if args.family == "gpt2" else 32000)
    cuda = args.device.startswith("cuda")
    if cuda:  # plain PyTorch gets the same device budget as chunkmem
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_memory / torch.cuda.mem_get_info()[1]))
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    rows: list[dict[str, Any]] = []
    plain_fits = True
    for hidden in (int(h) for h in args.hidden.split(",")):
        config = ladder_config(args.family, hidden, vocab, args.seq_len)
        params = sum(p.numel() for p in meta_module(config).parameters())
        layers = getattr(config, "n_layer", None) or config.num_hidden_layers
        row: dict[str, Any] = {"family": args.family, "hidden": hidden, "layers": layers, "params": params}
        why = host_check(config, args)
        row["chunkmem"] = {"fits": False, "error": why} if why else run_chunkmem(config, args, ids)
        row["plain"] = (run_plain(config, args, ids, params) if plain_fits
                        else {"fits": False, "error": "a smaller width did not fit"})
        plain_fits = row["plain"]["fits"]
        rows.append(row)
        print(f"width {hidden}: {params / 1e6:.1f}M params, chunkmem {_short(row['chunkmem'])}, "
              f"plain {_short(row['plain'])}", flush=True)
        if not row["chunkmem"]["fits"]:
            break
    largest = {who: max((r["params"] for r in rows if r[who]["fits"]), default=0) for who in ("chunkmem", "plain")}
    print(table([{"who": who, "largest params": f"{n / 1e6:.1f}M"} for who, n in largest.items()],
                ["who", "largest params"]))
    simulated = not cuda
    write_json(args.json, {
        "benchmark": "largest model fine-tuned on one device: chunkmem vs plain PyTorch",
        "mode": "CPU SIMULATION (no GPU): small sizes that prove the script; not a scale result" if simulated
        else f"CUDA: {torch.cuda.get_device_name()}",
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"vocab": vocab},
        "rows": rows, "largest_params": largest,
        "ratio": round(largest["chunkmem"] / largest["plain"], 2) if largest["plain"] else None})


def _short(result: dict[str, Any]) -> str:
    if not result["fits"]:
        return "no (" + str(result.get("error") or f"needs {result.get('need_bytes', 0) / 2**20:.1f} MiB") + ")"
    return f"yes, {result['tokens_per_s']:,.0f} tokens/s"


if __name__ == "__main__":
    main()
