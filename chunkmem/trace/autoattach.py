"""Tracing with no code change: `chunkmem trace -- python script.py` and `CHUNKMEM_TRACE=1`.

[Note: how a script is traced without editing it]
`chunkmem trace` runs the command with CHUNKMEM_TRACE=<dir> and puts chunkmem/trace/boot first on
PYTHONPATH. Python imports `sitecustomize` from there at start-up in every process the command
starts (torchrun's workers included), which calls `install_from_env` here and then hands over to
any other sitecustomize on the path. `import chunkmem` calls it too, so CHUNKMEM_TRACE=1 alone
traces scripts that use chunkmem. `install_from_env` opens one session per process and:
  - wraps `chunkmem.prepare`, so the first model prepared is recorded with exact chunk categories;
  - adds a global module forward pre-hook that adopts the first plain module called at top level
    with trainable parameters (observer mode), and a global optimizer step pre-hook that hands
    that module its optimizer (the one whose parameters it owns);
  - closes the session at exit. Nothing is written by a process that never runs a model (the
    torchrun launcher itself).
Only public hooks are used; `chunkmem.prepare` is the one function replaced, by a wrapper that
calls the original and attaches.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from chunkmem.trace.api import Session, attach_to_sessions
from chunkmem.trace.recorder import Retention
from chunkmem.wrapper import watch_prepare

log = logging.getLogger("chunkmem")

ENV = "CHUNKMEM_TRACE"  # a directory, or "1" for ./chunkmem-trace
ENV_LEVEL = "CHUNKMEM_TRACE_LEVEL"
ENV_KEEP_LAST = "CHUNKMEM_TRACE_KEEP_LAST"
ENV_KEEP_WARMUP = "CHUNKMEM_TRACE_KEEP_WARMUP"
DEFAULT_DIR = "chunkmem-trace"

_installed: Session | None = None


def _retention_from_env() -> Retention:
    def number(name: str, default: int) -> int:
        value = os.environ.get(name, str(default))
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected a whole number of steps") from None

    return Retention(number(ENV_KEEP_WARMUP, 3), number(ENV_KEEP_LAST, 20))


def install_from_env() -> Session | None:
    """Start tracing this process if CHUNKMEM_TRACE is set (idempotent); returns the session."""
    global _installed
    value = os.environ.get(ENV, "")
    if _installed is not None or value in ("", "0"):
        return _installed
    directory = DEFAULT_DIR if value == "1" else value
    session = Session(directory, os.environ.get(ENV_LEVEL, "counters"), _retention_from_env())
    session.__enter__()
    _installed = session
    watch_prepare(attach_to_sessions)
    _watch_plain(session)
    atexit.register(session.__exit__, None, None, None)
    return session


def _watch_plain(session: Session) -> None:
    depth = [0]

    def pre(module: nn.Module, _args: Any) -> None:
        depth[0] += 1
        if depth[0] == 1 and not session.attached and torch.is_grad_enabled() and _trainable(module):
            session.attach(module)

    def post(_module: nn.Module, _args: Any, _out: Any) -> None:
        depth[0] -= 1

    def optimizer_pre(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        watcher = session.watcher
        if watcher is not None and watcher.optimizer is None and _owns(watcher.model, optimizer):
            session.attach(watcher.model, optimizer)

    nn.modules.module.register_module_forward_pre_hook(pre)
    nn.modules.module.register_module_forward_hook(post, always_call=True)
    register_optimizer_step_pre_hook(optimizer_pre)


def _trainable(module: nn.Module) -> bool:
    if hasattr(module, "runtime"):  # a prepared model records through its runtime (the prepare wrapper)
        return False
    return any(p.requires_grad and p.device.type != "meta" for p in module.parameters())


def _owns(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    mine = {id(p) for p in model.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])
