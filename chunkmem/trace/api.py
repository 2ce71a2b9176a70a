"""`chunkmem.trace(...)` and `chunkmem.annotate(...)`: recording from inside a script.

A tracing session owns one output directory and, in this process, one recorder (one rank, one
file). It attaches to a prepared model (the recorder becomes one of the runtime's observers) or
to a plain model (observer mode, chunkmem.trace.plain). Sessions in force are kept in a stack so
that `annotate` reaches them without the user passing anything around; it is the only
process-wide state, and entering and leaving a session restores it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from chunkmem.trace.plain import PlainWatcher
from chunkmem.trace.recorder import Recorder, Retention
from chunkmem.trace.schema import META_FILE, SCHEMA
from chunkmem.trace.sources import ChunkSource, PlainSource
from chunkmem.version import __version__
from chunkmem.wrapper import watch_prepare

log = logging.getLogger("chunkmem")

_ACTIVE: list[Session] = []


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Session:
    """One trace directory; attaches a recorder to the first model it is given."""

    def __init__(self, directory: str | os.PathLike = "chunkmem-trace", level: str = "counters",
                 retention: Retention = Retention()) -> None:
        self.directory = Path(directory)
        self.level = level
        self.retention = retention
        self.recorder: Recorder | None = None
        self.watcher: PlainWatcher | None = None
        self._detach: Any = None

    @property
    def attached(self) -> bool:
        return self.recorder is not None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Record `model` (prepared: exact chunk categories; plain: observer mode)."""
        if self.recorder is not None:
            if self.watcher is not None and optimizer is not None and not hasattr(optimizer, "runtime"):
                self.watcher.set_optimizer(optimizer)
                self.recorder.source.optimizer = optimizer  # type: ignore[attr-defined]
            return
        rank, world = _rank()
        runtime = getattr(model, "runtime", None)
        if runtime is not None and hasattr(runtime, "observers"):
            self.recorder = Recorder(self.directory, rank, ChunkSource(runtime), self.level, self.retention)
            runtime.observers.append(self.recorder)
            self._detach = lambda: runtime.observers.remove(self.recorder)
            config = dict(vars(runtime.config))
        elif isinstance(model, nn.Module):
            watcher = self.watcher = PlainWatcher(model, _Forward(self))
            self.recorder = Recorder(self.directory, rank, PlainSource(model, optimizer, lambda: watcher.meter.live),
                                     self.level, self.retention)
            if optimizer is not None:
                watcher.set_optimizer(optimizer)
            self._detach = watcher.remove
            config = {}
        else:
            raise TypeError(f"chunkmem.trace: model must be an nn.Module (plain or prepared), got {type(model).__name__}")
        if rank == 0:
            self._write_meta(world, type(getattr(model, "module", model)).__name__, config)

    def _write_meta(self, world: int, model_name: str, config: dict[str, Any]) -> None:
        meta = {"schema": SCHEMA, "chunkmem": __version__, "torch": torch.__version__,
                "python": sys.version.split()[0], "argv": sys.argv, "world_size": world, "model": model_name,
                "config": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                           for k, v in config.items()},
                "level": self.level, "unix_time": time.time(),
                "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        (self.directory / META_FILE).write_text(json.dumps(meta, indent=1))

    def marker(self, name: str, phase: str) -> None:
        if self.recorder is not None:
            self.recorder.marker(name, phase)

    def close(self) -> None:
        if self.recorder is not None:
            if self._detach is not None:
                self._detach()
                self._detach = None
            self.recorder.close()

    def __enter__(self) -> Session:
        _ACTIVE.append(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self.close()


class _Forward:
    """Hands a watcher's moments to the session's recorder, created after the watcher."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def moment(self, moment: Any) -> None:
        if self.session.recorder is not None:
            self.session.recorder.moment(moment)

    def moved(self, move: Any) -> None:
        pass


def trace(directory: str | os.PathLike = "chunkmem-trace", model: nn.Module | None = None,
          optimizer: torch.optim.Optimizer | None = None, *, level: str = "counters", keep_warmup: int = 3,
          keep_last: int = 20) -> Session:
    """Record a memory trace of `model` while the `with` block runs.

        with chunkmem.trace("trace-dir", model=model, optimizer=optimizer):
            train()

    model: a model returned by chunkmem.prepare (exact chunk categories) or a plain nn.Module
    (observer mode: parameters, gradients and optimizer states found from model and optimizer).
    None: the first model prepared with `chunkmem.prepare` inside the block.
    level: "counters" (cheap, default) or "exact" (synchronises the device at every moment to read
    peaks). keep_warmup / keep_last: steps kept in full (see chunkmem/trace/recorder.py).
    Render the directory with `chunkmem report DIR`.
    """
    session = Session(directory, level, Retention(keep_warmup, keep_last))
    if model is not None:
        session.attach(model, optimizer)
    else:
        watch_prepare(attach_to_sessions)
    return session


def attach_to_sessions(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Hand a model `chunkmem.prepare` just returned to the active sessions that have none yet."""
    for session in active():
        if not session.attached:
            session.attach(model, optimizer)


def active() -> list[Session]:
    return list(_ACTIVE)


class annotate(contextlib.AbstractContextManager):  # noqa: N801 - used like a function
    """Mark a moment in every active trace: `chunkmem.annotate("eval")`, or a span with `with`.

        chunkmem.annotate("checkpoint saved")     # a point
        with chunkmem.annotate("eval"):            # a span: begin and end markers
            evaluate()
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"chunkmem.annotate({name!r}): expected a non-empty string naming the moment")
        self.name = name
        for session in _ACTIVE:
            session.marker(name, "point")

    def __enter__(self) -> annotate:
        for session in _ACTIVE:
            session.marker(self.name, "begin")
        return self

    def __exit__(self, *exc: Any) -> None:
        for session in _ACTIVE:
            session.marker(self.name, "end")
