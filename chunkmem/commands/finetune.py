"""`chunkmem finetune`: the command-line face of chunkmem/finetune/train.py.

With no arguments it trains the bundled tiny GPT-2 on the bundled text on whatever device there
is, with a device budget that makes its chunks stream every step, so the first command a new user
runs shows the whole path: data, chunks moving, progress, a Hugging Face directory at the end.
Mistakes in the arguments exit with status 2 and one line naming the value and what to do, before
anything heavy starts. Ctrl-C or SIGTERM saves a checkpoint after the step in progress and exits
with 128 + the signal's number and one line saying how to resume; a second one aborts at once.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
from typing import Any

from chunkmem.config import DEFAULT_DTYPE

HELP = "fine-tune a causal LM from a local Hugging Face directory or config on a local text file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("model and data")
    what.add_argument("--model", help="local Hugging Face directory (config.json + safetensors) or a "
                      "config.json file; default: a bundled tiny GPT-2 config (random initialisation)")
    what.add_argument("--data", help=".txt, .jsonl (.ndjson) or .json file; default: a bundled public-domain text")
    what.add_argument("--text-field", default="text", help="field of each JSON object that holds the text")
    what.add_argument("--output", default="chunkmem-finetune", help="output directory")
    what.add_argument("--held-out", type=float, default=0.1, help="fraction of blocks held out for evaluation")
    how = parser.add_argument_group("training")
    how.add_argument("--steps", type=int, default=400, help="optimizer steps")
    how.add_argument("--epochs", type=float, help="passes over the training blocks; overrides --steps")
    how.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    how.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    how.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    how.add_argument("--lr", type=float, help="peak learning rate (AdamW); default: 5e-5 to fine-tune a pretrained "
                     "--model, 1e-3 for a model trained from scratch (the bundled one, or a config.json)")
    how.add_argument("--schedule", default="cosine", choices=["constant", "linear", "cosine"],
                     help="learning rate after the warm-up")
    how.add_argument("--warmup-steps", type=int, default=10, help="steps of linear warm-up to the peak rate")
    how.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's, on weights of 2 or more dimensions")
    how.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clipping; 0 turns it off")
    how.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing (recompute in backward)")
    how.add_argument("--lora-rank", type=int, default=0, help="train rank-r adapters on frozen weights; 0: all weights")
    how.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA's scale: alpha / rank")
    how.add_argument("--seed", type=int, default=0, help="data order, initialisation and dropout")
    mem = parser.add_argument_group("memory")
    mem.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["fp32", "bf16", "fp16"],
                     help="compute dtype (as chunkmem plan assumes)")
    mem.add_argument("--device", help="'cuda', 'cuda:N' or 'cpu' (simulation); default: cuda if available")
    mem.add_argument("--device-memory", help="most device memory for chunks and activations, e.g. 20GiB; default: "
                     "what is free (with the bundled model: its activations and a quarter of its model data)")
    mem.add_argument("--host-memory", help="most host memory for chunks; default: what is free")
    mem.add_argument("--chunk-size", type=int, help="elements per chunk; default: searched")
    mem.add_argument("--threads", type=int, help="CPU threads for torch and chunkmem's kernel; default: "
                     "OMP_NUM_THREADS if set, else one less than the CPUs (at least 1)")
    save = parser.add_argument_group("evaluation and checkpoints")
    save.add_argument("--eval-every", type=int, default=50, help="held-out loss every N steps; 0: only at the end")
    save.add_argument("--eval-batches", type=int, default=8, help="batches per evaluation")
    save.add_argument("--save-every", type=int, default=0, help="resumable checkpoint every N steps (default: off)")
    save.add_argument("--save-minutes", type=float, default=30.0, help="a checkpoint after this many minutes of "
                      "training since the last, so a crash loses at most that (0: off)")
    save.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    save.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in "
                      "--output (an error when there is none)")
    save.add_argument("--resume-or-start", action="store_true", help="continue if --output has a checkpoint, "
                      "else start (for jobs that rerun one command)")
    save.add_argument("--stop-after", type=int, help="leave after N steps of this invocation (resume later)")
    save.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard of the output")


def in_flags(message: str) -> str:
    """A library error in this command's terms: Config's settings as its flags, and no advice to shard over more ranks
    (it runs one process)."""
    for name in ("device_memory", "host_memory", "chunk_size", "dtype"):
        flag = "--" + name.replace("_", "-")
        message = message.replace(f"Config.{name}", flag).replace(f"raise {name}", f"raise {flag}")
    message = message.replace("a lower-precision dtype", "a lower-precision --dtype")
    return re.sub(r"(,? or|,) shard (it )?over more ranks|shard (it )?over more ranks, ", "", message)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `chunkmem --help` does not pay for torch and transformers.
    from chunkmem.errors import CheckpointError, MemoryBudgetError
    from chunkmem.finetune import train as finetune
    from chunkmem.finetune.hf import InputError
    from chunkmem.finetune.report import summary
    from chunkmem.finetune.rundir import RunDir

    names = {f.name for f in finetune.dataclasses.fields(finetune.FinetuneConfig)}
    try:
        cfg = finetune.FinetuneConfig(**{k: v for k, v in vars(args).items() if k in names})
    except InputError as error:
        print(f"chunkmem finetune: error: {error}", file=sys.stderr)
        return 2
    try:
        result = finetune.run(cfg)
    except (InputError, MemoryBudgetError, CheckpointError) as error:
        print(f"chunkmem finetune: error: {in_flags(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second signal, or Ctrl-C before training started
        steps = RunDir(args.output).saved_steps()
        saved = f"the newest checkpoint is step {steps[-1]}; resume with: {resume_command(cfg)}" if steps \
            else "no checkpoint was saved"
        print(f"chunkmem finetune: aborted; {saved}", file=sys.stderr)
        return 128 + signal.SIGINT
    if result.stopped_by is not None:
        after = f"resume with: {resume_command(cfg)}" if result.step else "nothing to resume: run the command again"
        print(f"chunkmem finetune: interrupted at step {result.step} of {result.total_steps}; {after}", file=sys.stderr)
        return 128 + result.stopped_by
    print(summary(result))
    if result.step < result.total_steps:
        print(f"resume with: {resume_command(cfg)}")
    return 0


def resume_command(cfg: Any) -> str:
    """The command line that continues the run of `cfg`: its settings that differ from the defaults, and --resume."""
    from chunkmem.finetune import train as finetune

    words = ["chunkmem", "finetune"]
    for field in finetune.dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name in ("resume", "resume_or_start", "stop_after") or value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join([*words, "--resume"])
