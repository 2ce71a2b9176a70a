"""Fine-tune a causal LM in chunks: the loop behind `chunkmem finetune`.

A run is deterministic given its settings and the step it starts from: the data order is a
function of (seed, epoch), the learning rate a function of the step, and the random state is
reseeded from (seed, step) before every step. So a run resumed from a checkpoint continues to the
same weights as one that never stopped (bit for bit in fp32, with the same number of CPU threads:
matrix products sum in another order on another count), and a checkpoint needs no RNG state.

Work is lost to nothing but a hard kill: SIGINT/SIGTERM save a checkpoint after the step in
progress (chunkmem/finetune/interrupt.py), and by default a checkpoint is also written every
`save_minutes` of training, so a crash or SIGKILL costs at most that much.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import re
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

import chunkmem
from chunkmem.config import DEFAULT_DTYPE, default_device, parse_size
from chunkmem.finetune import corpus, hf, lora
from chunkmem.finetune.hf import InputError
from chunkmem.finetune.interrupt import StopOnSignal
from chunkmem.finetune.report import Traffic, memory_text, warn_over_budget
from chunkmem.finetune.rundir import RunDir
from chunkmem.memory.simmemory import simulated_memory
from chunkmem.finetune.threads import cpu_threads, torch_threads
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.wrapper import ChunkedModel

log = logging.getLogger("chunkmem")

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "data" / "tiny_gpt2.json"
SCHEDULES = ("constant", "linear", "cosine")
# A model's files an --output must not replace: its config, index, tokenizer and weights
MODEL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "vocab.json", "adapter_config.json")
WEIGHT_FILES = (".safetensors", ".bin")
# Config entries a resumed run may differ in: where it was loaded from, the writer's version, the dtype it loads in.
VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")
# The bundled default's chunks get this share of its model data on the device (beside what
# activations need), so that the first command a user runs shows chunks streaming every step.
DEFAULT_CHUNK_SHARE = 0.25


PRETRAINED_LR = 5e-5  # the default rate to fine-tune a pretrained model (Hugging Face Trainer's)
SCRATCH_LR = 1e-3  # and to train one from its random initialisation (the bundled tiny GPT-2, a config.json)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """The settings of one run (the command's flags). None for model/data: the bundled default."""

    model: str | None = None
    data: str | None = None
    output: str = "chunkmem-finetune"
    steps: int = 400
    epochs: float | None = None  # when given, overrides steps
    batch_size: int = 8
    seq_len: int = 128
    lr: float | None = None  # None: PRETRAINED_LR for a pretrained --model, SCRATCH_LR for a model started afresh
    schedule: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    dtype: str = DEFAULT_DTYPE
    device: str | None = None
    device_memory: str | None = None
    host_memory: str | None = None
    chunk_size: int | None = None
    grad_accum: int = 1
    grad_ckpt: bool = False
    eval_every: int = 50
    eval_batches: int = 8
    held_out: float = 0.1
    save_every: int = 0  # steps; 0: none by count
    save_minutes: float = 30.0  # a checkpoint once this much training time has passed since the last; 0: off
    keep: int = 2
    resume: bool = False  # continue from the newest checkpoint; an error when there is none
    resume_or_start: bool = False  # continue if there is a checkpoint, else start (time-sliced jobs)
    threads: int | None = None  # CPU threads for torch and the native kernel; None: see cpu_threads
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 16.0
    seed: int = 0
    text_field: str = "text"
    max_shard_size: str = "2GiB"
    stop_after: int | None = None  # leave after this many steps of this invocation (time-sliced jobs)

    def __post_init__(self) -> None:
        if self.lr is None:  # a pretrained model is fine-tuned gently; a random one trained from scratch
            pretrained = self.model is not None and not self.model.endswith(".json")
            object.__setattr__(self, "lr", PRETRAINED_LR if pretrained else SCRATCH_LR)
        positive = ("steps", "batch_size", "seq_len", "grad_accum", "keep", "eval_batches")
        for name in positive:
            if getattr(self, name) <= 0:
                raise InputError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected a positive integer")
        for name in ("eval_every", "save_every", "warmup_steps", "lora_rank"):
            if getattr(self, name) < 0:
                raise InputError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected 0 or more")
        if self.save_minutes < 0:
            raise InputError(f"--save-minutes {self.save_minutes}: expected 0 (off) or more minutes")
        if self.threads is not None and self.threads <= 0:
            raise InputError(f"--threads {self.threads}: expected a positive number of CPU threads")
        if self.resume and self.resume_or_start:
            raise InputError("--resume and --resume-or-start together: pass one (--resume fails when there "
                             "is no checkpoint, --resume-or-start then starts)")
        if not 0 < self.peak_lr < math.inf:  # NaN too
            raise InputError(f"--lr {self.lr}: expected a positive finite learning rate")
        if self.epochs is not None and not 0 < self.epochs < math.inf:
            raise InputError(f"--epochs {self.epochs}: expected a positive finite number of passes over the data")
        if not 0 <= self.weight_decay < math.inf:
            raise InputError(f"--weight-decay {self.weight_decay}: expected 0 (none) or a finite positive number")
        if self.stop_after is not None and self.stop_after <= 0:
            raise InputError(f"--stop-after {self.stop_after}: expected a positive number of steps (leave it out to "
                             "run to the end)")
        if self.seq_len < 2:
            raise InputError(f"--seq-len {self.seq_len}: expected 2 or more (each token predicts the next: one token "
                             "leaves nothing to predict)")
        if self.lora_rank and not 0 < self.lora_alpha < math.inf:  # NaN too: alpha / rank scales the adapters' output
            raise InputError(f"--lora-alpha {self.lora_alpha}: expected a positive scale (alpha / rank multiplies "
                             "the adapters' output; 16 is usual)")
        if not self.max_grad_norm >= 0:
            raise InputError(f"--max-grad-norm {self.max_grad_norm}: expected 0 (no clipping) or more")
        if Path(self.output).exists() and not Path(self.output).is_dir():
            raise InputError(f"--output {self.output} is a file: expected a folder for the run (new or one to resume)")
        output = Path(self.output)
        model = None if self.model is None else Path(self.model)
        if model is not None and (model if model.is_dir() else model.parent).resolve() == output.resolve():
            raise InputError(f"--output {self.output} is the --model folder: writing there would replace the model "
                             "being read (and lose it if the write is cut short); choose another --output")
        found = sorted(p.name for p in output.iterdir() if p.name in MODEL_FILES or p.suffix in WEIGHT_FILES) \
            if output.is_dir() and not RunDir(output).is_a_run() else []
        if found:
            raise InputError(f"--output {self.output} holds a model no chunkmem finetune run wrote "
                             f"({', '.join(found[:3])}): the run's output would replace it; choose another --output")
        if self.schedule not in SCHEDULES:
            raise InputError(f"--schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if not 0 <= self.held_out < 1:
            raise InputError(f"--held-out {self.held_out}: expected a fraction in [0, 1)")
        try:
            parse_size("max_shard_size", self.max_shard_size)
        except ValueError:
            raise InputError(f"--max-shard-size {self.max_shard_size!r}: expected a size like 500MB or 2GiB") from None

    @property
    def peak_lr(self) -> float:
        assert self.lr is not None, "resolved when the config is made"
        return self.lr

    def invariants(self) -> dict[str, Any]:
        """Settings a resumed run must share with the run it continues."""
        keys = ("model", "data", "batch_size", "seq_len", "grad_accum", "lr", "schedule", "warmup_steps",
                "weight_decay", "max_grad_norm", "dtype", "lora_rank", "lora_alpha", "seed", "held_out",
                "text_field", "steps", "epochs")  # the total steps shape the learning-rate schedule
        return {k: getattr(self, k) for k in keys}


@dataclasses.dataclass
class Result:
    """What a run did: the trained model stays usable (generation, comparisons in tests)."""

    model: ChunkedModel
    optimizer: ChunkOptimizer
    step: int
    total_steps: int
    losses: list[float]  # training loss of each step run in this invocation
    evals: list[tuple[int, float]]  # (step, held-out loss)
    seconds: float
    tokens: int
    output: Path
    traffic: Traffic = dataclasses.field(default_factory=Traffic)
    streaming_default: bool = False  # the bundled default's budget: chunks get a share of the model data
    stopped_by: int | None = None  # the signal that stopped the run early
    saved_step: int | None = None  # the step of the newest checkpoint this invocation wrote


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate at 0-based `step`: linear warm-up, then the schedule."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def build(cfg: FinetuneConfig, source: hf.ModelSource) -> tuple[ChunkedModel, ChunkOptimizer, dict[str, str]]:
    """The model from its source (weights streamed into chunks), adapters, optimizer, prepared."""
    try:
        module = hf.build(source.config, on_meta=bool(source.weight_files), seed=cfg.seed)
    except ValueError as error:  # transformers checks the config's values as it builds (heads dividing the width)
        raise InputError(f"--model {cfg.model or 'default'}: its config does not make a model ({error}); fix its "
                         "config.json") from None
    renames: dict[str, str] = {}
    if cfg.lora_rank:
        lora.apply_lora(module, rank=cfg.lora_rank, alpha=cfg.lora_alpha)
        renames = lora.renames(module)
    if cfg.grad_ckpt:
        # Non-reentrant: recomputation runs chunkmem's module hooks again, as a second call would.
        if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5
            module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    empty = {n for n, p in module.named_parameters() if p.device.type == "meta"}  # to be loaded
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([
        {"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}], lr=cfg.peak_lr)
    try:
        device = cfg.device if cfg.device is not None else default_device()
        config = chunkmem.Config(device=device, device_memory=cfg.device_memory, host_memory=cfg.host_memory,
                                 dtype=cfg.dtype, chunk_size=cfg.chunk_size)  # checks --device before it is used
        if config.device_memory is None and cfg.model is None:
            config = dataclasses.replace(config, device_memory=streaming_budget(cfg, source.config, device, module))
        model, chunk_optimizer = chunkmem.prepare(module, optimizer, config)
    except ValueError as error:  # a setting chunkmem refuses (chunkmem.prepare names the Config field)
        raise InputError(re.sub(r"Config\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(error))) from None
    if source.weight_files:
        hf.load_weights(model, source.weight_files, renames, required=empty)
    return model, chunk_optimizer, renames


def streaming_budget(cfg: FinetuneConfig, config: Any, device: str, module: nn.Module) -> int:
    """The bundled default's device budget: what its activations need and DEFAULT_CHUNK_SHARE of its model data
    for chunks, so chunks stream every step. The activations are measured: what one plain step of the model
    reserves in the caching allocator's segments (chunkmem plan's estimate where memory is not modelled)."""
    from chunkmem.chunks.placement import SAFETY_FRACTION
    from chunkmem.trace.planner import CUDA_CONTEXT, Request, plan, spec_from_config

    cuda = device != "cpu"
    request = Request(2**50, 2**50, cfg.batch_size, cfg.seq_len, cfg.dtype, cfg.grad_ckpt,
                      attention="fused" if cuda else "math", cuda=cuda)
    estimate = plan(spec_from_config(config, "default"), request)
    reserved = plain_step_reserves(module, cfg, device, config.vocab_size)
    activations = reserved if reserved is not None else estimate.activation_bytes  # segments round up already
    need = activations + (CUDA_CONTEXT if cuda else 0) + estimate.model_data_bytes * DEFAULT_CHUNK_SHARE
    return int(need / (1 - SAFETY_FRACTION))


def plain_step_reserves(module: nn.Module, cfg: FinetuneConfig, device: str, vocab: int) -> int | None:
    """What one plain step of a copy of `module`, in the compute dtype, reserves on `device` beyond its parameters
    (activations, temporaries, gradients, in the caching allocator's segments); None where the simulation does
    not model memory as a budget (CHUNKMEM_SIM_MEMORY=0 or places)."""
    probe = copy.deepcopy(module).to(chunkmem.Config(device="cpu", dtype=cfg.dtype).torch_dtype)
    ids = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    if device == "cpu":
        memory = simulated_memory()
        if memory is None or not memory.models_budget:
            return None
        for param in probe.parameters():
            memory.charge(param.data)
        before = memory.allocator.peak_reserved = memory.allocator.reserved
        probe(input_ids=ids, labels=ids).loss.backward()
        return memory.allocator.peak_reserved - before
    probe.to(device)
    before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
    reserved = torch.cuda.max_memory_reserved(device) - before
    del probe
    torch.cuda.empty_cache()
    return reserved


def _source(cfg: FinetuneConfig) -> tuple[hf.ModelSource, Path]:
    source = hf.resolve(cfg.model or DEFAULT_CONFIG)
    limit = hf.max_positions(source.config)
    if limit is not None and cfg.seq_len > limit:
        raise InputError(f"--seq-len {cfg.seq_len} exceeds the model's maximum of {limit} positions "
                         f"(config of {cfg.model or 'the default model'}): use --seq-len {limit} or less")
    return source, Path(cfg.data) if cfg.data else corpus.BUNDLED_TEXT


def total_steps(cfg: FinetuneConfig, train_blocks: int) -> int:
    """--steps, or --epochs in whole steps of an epoch (as Hugging Face's Trainer counts them): an epoch is the
    micro-batches of one permutation of the blocks (Batches: the blocks left over are dropped) and a step takes
    --grad-accum of them, so --epochs 1 sees no block twice, unless one step takes more micro-batches than an epoch has
    (it runs one step). Counted in blocks, 10 blocks in batches of 4 ran 3 steps, the third from the next epoch."""
    if cfg.epochs is None:
        return cfg.steps
    per_epoch = max(1, train_blocks // cfg.batch_size // cfg.grad_accum)
    return max(1, math.ceil(cfg.epochs * per_epoch))


class Batches:
    """Micro-batch `i` of the run, wherever the run starts: epochs of a seeded permutation."""

    def __init__(self, blocks: torch.Tensor, batch_size: int, seed: int) -> None:
        if len(blocks) < batch_size:
            raise InputError(f"--batch-size {batch_size} is more than the {len(blocks)} training blocks: "
                             f"lower --batch-size or --seq-len, or give more text")
        self.blocks, self.batch_size, self.seed = blocks, batch_size, seed
        self.per_epoch = len(blocks) // batch_size
        self._order: tuple[int, torch.Tensor] | None = None

    def __getitem__(self, index: int) -> torch.Tensor:
        epoch, position = divmod(index, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, corpus.batch_order(len(self.blocks), self.seed, epoch))
        rows = self._order[1][position * self.batch_size:(position + 1) * self.batch_size]
        return self.blocks[rows]


@torch.no_grad()
def evaluate(model: ChunkedModel, blocks: torch.Tensor, batch_size: int, max_batches: int) -> float:
    """Mean loss over (up to `max_batches` batches of) the held-out blocks."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, min(len(blocks), batch_size * max_batches), batch_size):
        ids = blocks[start:start + batch_size]
        total += model(ids, labels=ids, use_cache=False).loss.float().item() * len(ids)
        count += len(ids)
    model.train()
    return total / count


def train_step(model: ChunkedModel, optimizer: ChunkOptimizer, batches: Batches, step: int,
               cfg: FinetuneConfig, total: int) -> float:
    """One optimizer step over `grad_accum` micro-batches; returns the mean loss."""
    torch.manual_seed(cfg.seed * 1_000_003 + step)  # dropout masks depend on the step only
    factor = lr_factor(step, total, cfg.warmup_steps, cfg.schedule)
    for group in optimizer.param_groups:
        group["lr"] = cfg.peak_lr * factor
    loss_sum = 0.0
    for micro in range(cfg.grad_accum):
        ids = batches[step * cfg.grad_accum + micro]
        loss = model(ids, labels=ids, use_cache=False).loss
        (loss / cfg.grad_accum).backward()
        loss_sum += loss.float().item()
    if cfg.max_grad_norm > 0:
        model.clip_grad_norm_(cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss_sum / cfg.grad_accum


def run(cfg: FinetuneConfig) -> Result:
    """Train as `cfg` says, write the Hugging Face directory and a final checkpoint to cfg.output."""
    with torch_threads(cpu_threads(cfg.threads)):
        return _run(cfg)


def _run(cfg: FinetuneConfig) -> Result:
    source, data_path = _source(cfg)
    data = corpus.load(data_path, source.directory if source.has_tokenizer else None,
                       source.config.vocab_size, cfg.seq_len, cfg.held_out, cfg.text_field)
    batches = Batches(data.train, cfg.batch_size, cfg.seed)
    total = total_steps(cfg, len(data.train))
    out = RunDir(cfg.output)
    resuming = cfg.resume or cfg.resume_or_start
    # The tokens themselves: a data file edited between a run and its resume would otherwise pass unseen.
    tokens = zlib.crc32(torch.cat([data.train.flatten(), data.held_out.flatten()]).numpy().tobytes())
    # And the steps they make: the learning-rate schedule spans them (how --epochs counts steps may change).
    # The architecture: a config.json edited between a run and its resume (an activation, a norm's epsilon) too.
    shape = {k: v for k, v in source.config.to_dict().items() if k not in VOLATILE_CONFIG}
    architecture = zlib.crc32(json.dumps(shape, sort_keys=True, default=str).encode())
    out.start(cfg.invariants() | {"data_crc32": tokens, "model_config_crc32": architecture, "total_steps": total},
              resuming, required=cfg.resume)
    model, optimizer, _ = build(cfg, source)
    first = out.resume(model, optimizer) if resuming else 0
    last = total if cfg.stop_after is None else min(total, first + cfg.stop_after)
    result = Result(model, optimizer, first, total, [], [], 0.0, 0, out.path,
                    streaming_default=cfg.model is None and cfg.device_memory is None)
    model.runtime.observers.append(result.traffic)
    with StopOnSignal() as stop:
        _loop(cfg, result, batches, data.held_out, out, last, stop)
    result.stopped_by = stop.signal if result.step < total else None
    if result.step < total:
        if result.saved_step != result.step and result.step > first:  # resumable from where it stopped
            _save(cfg, result, out)
        return result
    if len(data.held_out) and first < total and (not result.evals or result.evals[-1][0] != total):
        _evaluate(cfg, result, data.held_out, out)  # (a finished run evaluated its last step: metrics hold it)
    save_outputs(cfg, result, source)  # again for a finished run: one cut short after its last checkpoint
    return result


def _loop(cfg: FinetuneConfig, result: Result, batches: Batches, held_out: torch.Tensor, out: RunDir,
          last: int, stop: StopOnSignal) -> None:
    model, optimizer = result.model, result.optimizer
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    bar = tqdm(total=result.total_steps, initial=result.step, desc="fine-tuning", unit="step",
               disable=hf._quiet(), dynamic_ncols=True)
    start = last_save = time.perf_counter()
    model.train()
    while result.step < last and stop.signal is None:
        loss = train_step(model, optimizer, batches, result.step, cfg, result.total_steps)
        result.step += 1
        result.traffic.step_done()
        result.losses.append(loss)
        result.tokens += tokens_per_step
        result.seconds = time.perf_counter() - start
        rate = result.tokens / max(result.seconds, 1e-9)
        out.log_metrics({"step": result.step, "loss": loss, "lr": optimizer.param_groups[0]["lr"],
                         "tokens_per_s": rate})
        if len(result.losses) == 1:
            warn_over_budget(model)
        if len(held_out) and cfg.eval_every and result.step % cfg.eval_every == 0:
            _evaluate(cfg, result, held_out, out)
        due = (cfg.save_every and result.step % cfg.save_every == 0) or \
            (cfg.save_minutes and time.perf_counter() - last_save >= 60 * cfg.save_minutes)
        if due and result.step < result.total_steps:
            _save(cfg, result, out)
            last_save = time.perf_counter()
        bar.set_postfix_str(f"loss {loss:.3f}, {rate:,.0f} tok/s, {memory_text(model)}", refresh=False)
        bar.update()
    bar.close()
    result.seconds = time.perf_counter() - start


def _save(cfg: FinetuneConfig, result: Result, out: RunDir) -> None:
    with chunkmem.annotate("checkpoint"):
        out.save(result.model, result.optimizer, result.step, cfg.keep)
    result.saved_step = result.step


def _evaluate(cfg: FinetuneConfig, result: Result, held_out: torch.Tensor, out: RunDir) -> None:
    with chunkmem.annotate("eval"):  # a span in the memory trace, when one is recording
        loss = evaluate(result.model, held_out, cfg.batch_size, cfg.eval_batches)
    result.evals.append((result.step, loss))
    out.log_metrics({"step": result.step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))})
    log.info("step %d: held-out loss %.4f, perplexity %.2f", result.step, loss, math.exp(min(loss, 50.0)))


def save_outputs(cfg: FinetuneConfig, result: Result, source: hf.ModelSource) -> None:
    """At the end: the final checkpoint and the Hugging Face directory (adapters folded in), with the
    model's tokenizer, or the byte-level one its data was read with."""
    _save(cfg, result, RunDir(cfg.output))
    transform = lora.merged(result.model.module) if cfg.lora_rank else None
    shard_bytes = parse_size("max_shard_size", cfg.max_shard_size) or 2 * 2**30
    tokenizer = source.directory if source.has_tokenizer else corpus.byte_tokenizer(source.config)
    with chunkmem.annotate("save_pretrained"):
        hf.save_pretrained(result.model, result.output, cfg.dtype, tokenizer, shard_bytes, transform)
