"""What every benchmark shares: a GPT-2-style model, timing, and writing results with their provenance."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def gpt2(layers: int, width: int, vocab: int, positions: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers,
                        n_head=max(1, width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(fn: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock() - start


def provenance() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    # Results written earlier in the same session don't count: they are this directory's outputs, not its code.
    status = subprocess.run(["git", "status", "--porcelain", "--", ":/", ":(top,exclude)benchmarks/results"],
                            capture_output=True, text=True)
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit,
            "clean_tree": status.returncode == 0 and not status.stdout.strip(),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("CHUNKMEM_", "MALLOC_", "OMP_"))},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (simulation)"}


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload | {"provenance": provenance()}, indent=1))
        print(f"wrote {path}")


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)
