"""Resumable checkpoints: safetensors for tensors, JSON for the rest, keyed by parameter name.

Keyed by name (not by chunk), so a checkpoint loads with another chunk size or world size.

[Note: atomic save]
The checkpoint is a directory. It is written in full beside its place (`<path>.tmp`), fsynced, and
swapped in by renames: the old one moves to `<path>.old`, the new one to `<path>`, then the old one
is deleted. A crash at any moment leaves a complete checkpoint at `<path>` or at `<path>.old`, and
`load_checkpoint` falls back to `<path>.old` when `<path>` is missing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from chunkmem.optim import ChunkOptimizer
from chunkmem.state import TensorState
from chunkmem.wrapper import ChunkedModel

FORMAT = "chunkmem-checkpoint/1"
TENSORS = "state.safetensors"
META = "meta.json"


def save_checkpoint(path: str | os.PathLike, model: ChunkedModel, optimizer: ChunkOptimizer) -> Path:
    """Write model values, optimizer states, step counts and hyperparameters to directory `path`."""
    _check_pair(model, optimizer)
    path = Path(path)
    tensors, meta = _collect(model, optimizer)  # under ZeRO a collective: every rank calls save_checkpoint
    shards = model.runtime.shards
    if shards is not None and shards.rank != 0:
        dist.barrier(group=shards.group)  # rank 0 writes; the others return once it has
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / TENSORS)
    (tmp / META).write_text(json.dumps(meta, indent=1))
    for file in (tmp / TENSORS, tmp / META):
        _fsync(file)
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    if shards is not None:
        dist.barrier(group=shards.group)
    return path


def load_checkpoint(path: str | os.PathLike, model: ChunkedModel, optimizer: ChunkOptimizer) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote; returns its metadata. Training continues bit-identically."""
    _check_pair(model, optimizer)
    path = Path(path)
    if not (path / META).exists() and (path.with_name(path.name + ".old") / META).exists():
        path = path.with_name(path.name + ".old")  # a save was interrupted after moving the old one aside
    if not (path / META).exists():
        raise FileNotFoundError(f"no chunkmem checkpoint at {path}: expected {path / META} and {path / TENSORS}")
    meta = json.loads((path / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / META} has format {meta.get('format')!r}, expected {FORMAT!r}")
    tensors = load_file(path / TENSORS)
    model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    _restore_optimizer(optimizer, tensors, meta)
    return meta


def _collect(model: ChunkedModel, optimizer: ChunkOptimizer) -> tuple[dict[str, torch.Tensor], dict]:
    runtime = model.runtime
    tensors = {f"model/{k}": v.contiguous() for k, v in _untied(model.state_dict()).items()}
    steps = _steps(optimizer)
    for kind in optimizer.rule.states:
        for record, value in runtime.values(kind).items():
            if steps.get(record.name, 0) > 0:
                tensors[f"optim/{kind}/{record.name}"] = value.contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [runtime.store.records[p].name
                                                                          for p in g["params"]]}
              for g in optimizer.param_groups]
    scaler = runtime.scaler.__dict__ if runtime.scaler else None
    meta = {"format": FORMAT, "optimizer": optimizer.wrapped_type.__name__, "steps": steps,
            "param_groups": _jsonable(groups), "loss_scaler": scaler, "dtype": runtime.config.dtype}
    return tensors, meta


def _restore_optimizer(optimizer: ChunkOptimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    runtime = optimizer.runtime
    if meta["optimizer"] != optimizer.wrapped_type.__name__:
        raise ValueError(f"checkpoint holds {meta['optimizer']} state but the optimizer is "
                         f"{optimizer.wrapped_type.__name__}: use the same optimizer class to resume")
    for saved, group in zip(meta["param_groups"], optimizer.param_groups):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params"})
    for record, step in optimizer.steps.items():
        step.fill_(meta["steps"].get(record.name, 0.0))
        for kind in optimizer.rule.states if record.group.owned else ():
            chunk = record.group.chunks[kind]
            value = tensors.get(f"optim/{kind}/{record.name}")
            if value is not None or chunk.state is not TensorState.FREE:
                view = record.view(runtime.writable(chunk, chunk.state.on_device))
                view.copy_(value) if value is not None else view.zero_()
    if meta["loss_scaler"] and runtime.scaler:
        runtime.scaler.__dict__.update(meta["loss_scaler"])
    runtime.zero_grad()


def _steps(optimizer: ChunkOptimizer) -> dict[str, float]:
    """Step counts by parameter name; under ZeRO only a parameter's owner counts its steps."""
    records = list(optimizer.steps)
    steps = torch.stack([optimizer.steps[r] if r.group.owned else torch.zeros(()) for r in records]).double()
    shards = optimizer.runtime.shards
    if shards is not None:
        shards.all_reduce(steps)
    return {r.name: s for r, s in zip(records, steps.tolist())}


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared tensors: keep the first name of each tied group."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _check_pair(model: Any, optimizer: Any) -> None:
    if not isinstance(model, ChunkedModel) or not isinstance(optimizer, ChunkOptimizer):
        raise TypeError(f"expected the model and optimizer returned by chunkmem.prepare, got "
                        f"{type(model).__name__} and {type(optimizer).__name__}")
    if optimizer.runtime is not model.runtime:
        raise ValueError("the optimizer was prepared with another model: pass the pair chunkmem.prepare returned")


def _fsync(file: Path) -> None:
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())
