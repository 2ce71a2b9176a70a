"""Resumable checkpoints: safetensors for tensors, JSON for the rest, keyed by parameter name.

Keyed by name (not by chunk), so a checkpoint loads with another chunk size or world size.

[Note: atomic save]
The checkpoint is a directory. It is written in full beside its place (`<path>.tmp`), fsynced, read
back against its checksums, and swapped in by renames: the old one moves to `<path>.old`, the new
one to `<path>`, then the old one is deleted; the parent directory is fsynced after the renames. A
crash at any moment leaves a complete checkpoint at `<path>` or at `<path>.old`, and
`load_checkpoint` falls back to `<path>.old` when `<path>` is missing.

[Note: load checks everything, then changes anything]
`load_checkpoint` reads the files, verifies every tensor's CRC-32 against meta.json, and checks every
key and shape against the model and the optimizer before it writes a single value: a load that
raises leaves both exactly as they were. Format 1 checkpoints (before checksums) still load: their
tensors cannot be verified, everything else is checked the same way.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import math
import os
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from chunkmem.chunks.store import ParamRecord, outside_inference_mode
from chunkmem.errors import CheckpointDamaged, CheckpointError
from chunkmem.files import fsync_dir, fsync_file, share_like_others
from chunkmem.runtime.optim import ChunkOptimizer, is_step_count
from chunkmem.wrapper import ChunkedModel

log = logging.getLogger("chunkmem")

FORMAT = "chunkmem-checkpoint/2"
UNVERIFIED_FORMAT = "chunkmem-checkpoint/1"  # no checksums
TENSORS = "state.safetensors"
META = "meta.json"
_META_KEYS = ("optimizer", "steps", "param_groups", "loss_scaler")


@dataclasses.dataclass
class _Restore:
    """Everything a load writes, checked: model values, group settings, step counts, optimizer states."""

    values: dict[str, Any]  # tensors, and modules' extra state
    groups: list[dict[str, Any]]
    steps: dict[ParamRecord, float]
    states: dict[tuple[ParamRecord, str], torch.Tensor]
    scaler: dict[str, Any] | None


def save_checkpoint(path: str | os.PathLike, model: ChunkedModel, optimizer: ChunkOptimizer) -> Path:
    """Write model values, optimizer states, step counts and hyperparameters to directory `path`. Under ZeRO every
    rank calls it (a collective) and rank 0 writes; every rank returns once the checkpoint is written whole, or
    raises if rank 0 could not write it."""
    _check_pair(model, optimizer)
    path = Path(path)
    if path.name in ("", ".", ".."):  # its siblings (.tmp, .old) need a name
        path = path.resolve()
    tensors, meta = _collect(model, optimizer)  # under ZeRO a collective: every rank calls save_checkpoint
    shards = model.runtime.shards
    if shards is None:
        _write(path, tensors, meta)
        return path
    failed = attempt(lambda: _write(path, tensors, meta)) if shards.rank == 0 else None
    written = all_written(shards.group, failed is None)
    if failed is not None:
        raise failed
    if not written:
        raise CheckpointError(f"rank 0 could not write the checkpoint {path} (its error says why): the previous "
                              f"checkpoint there is intact")
    return path


CHECKPOINT_TIMEOUT_S = 6 * 3600  # how long ranks wait for rank 0's write (CHUNKMEM_CHECKPOINT_TIMEOUT overrides)
_GROUPS: dict[Any, Any] = {}  # a ZeRO process group -> the gloo group its ranks wait for a save in


def attempt(write: Callable[[], Any]) -> Exception | None:
    """The error of a checkpoint write, which the other ranks learn of (all_written) before it is raised."""
    try:
        write()
    except Exception as error:  # noqa: BLE001  raised once every rank knows
        return error
    return None


def all_written(group: Any, ok: bool) -> bool:
    """Whether every rank of `group` wrote its part of a checkpoint (`ok`, its own): a collective that waits however
    long the slowest writes, up to CHECKPOINT_TIMEOUT_S."""
    flag = torch.tensor([ok], dtype=torch.int64, device="cpu")  # gloo's
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_checkpoint_group(group))
    return bool(flag.item())


def _checkpoint_group(group: Any) -> Any:
    """A gloo group of `group`'s ranks whose collectives wait CHECKPOINT_TIMEOUT_S: rank 0's write of a large model
    outlasts the training group's timeout (CHUNKMEM_TIMEOUT), which would end a job whose save was going well."""
    if group not in _GROUPS:
        timeout = float(os.environ.get("CHUNKMEM_CHECKPOINT_TIMEOUT", CHECKPOINT_TIMEOUT_S))
        _GROUPS[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                        timeout=datetime.timedelta(seconds=timeout), use_local_synchronization=True)
    return _GROUPS[group]


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write a checkpoint beside `path`, check that it reads back whole, then put it in place of the last one."""
    tmp = path.with_name(path.name + ".tmp")
    check_replaceable(path)
    for key, value in meta.get("extra_state", {}).items():
        if not _round_trips(value):
            raise CheckpointError(f"model/{key} is a module's extra state (get_extra_state), a {type(value).__name__} "
                                  f"that a checkpoint holds only as JSON (numbers, strings, lists and dicts of them) or "
                                  f"as a tensor: make get_extra_state return such values, or save that state apart")
    shutil.rmtree(tmp, ignore_errors=True)
    meta["checksums"] = {key: checksum(value) for key, value in tensors.items()}
    meta["meta_checksum"] = meta_checksum(meta)
    try:
        tmp.mkdir(parents=True)
        save_file(tensors, tmp / TENSORS)
        share_like_others(tmp / TENSORS)
        (tmp / META).write_text(json.dumps(meta, indent=1))
        for file in (tmp / TENSORS, tmp / META):
            fsync_file(file)
        fsync_dir(tmp)
    except (OSError, SafetensorError) as error:  # a full disk, a quota, a lost mount
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "the previous checkpoint there is intact; " if (path / META).exists() else ""
        fix = "free space there or save elsewhere" if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) \
            else "save where this process can write"
        raise CheckpointError(f"could not write the checkpoint {path} ({error}): {kept}{fix}") from error
    try:
        verify_checkpoint(tmp)  # the previous checkpoint goes only once this one reads back whole
        swap_in(tmp, path)
    except OSError as error:  # a rename refused, a lost mount: at `path` or moved aside (`existing`), one is whole
        which = "the previous checkpoint is intact" if tmp.exists() else "the new checkpoint is in place"
        raise CheckpointError(f"could not put the checkpoint in place at {path} ({error}): {which}, and "
                              f"load_checkpoint({str(path)!r}) reads it") from error


def check_replaceable(path: Path) -> None:
    """A save replaces or removes only what a save wrote: at `path` and beside it (.tmp, .old), nothing, or a
    directory of a checkpoint's files."""
    for place in (path, path.with_name(path.name + ".old"), path.with_name(path.name + ".tmp")):
        if place.exists():
            _check_ours(place)


def _check_ours(place: Path) -> None:
    found = sorted(entry.name for entry in place.iterdir()) if place.is_dir() else None
    # A pipeline's checkpoint holds a part per stage (and what a stage's save left)
    ours = (TENSORS, META, "pipeline.json")
    if found is None or not all(name in ours or re.fullmatch(r"stage-\d+(\.tmp|\.old)?", name) for name in found):
        what = "a file" if found is None else f"a directory holding {', '.join(found[:3])}" + \
            (", ..." if len(found) > 3 else "")
        raise CheckpointError(f"{place} is {what}, not a chunkmem checkpoint, and a save would replace or remove it: "
                              "save to a new or empty directory, or to one a save wrote before")


def swap_in(tmp: Path, path: Path) -> None:
    """Put the checkpoint written at `tmp` in place of the one at `path` (moved aside until then: `existing`)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _round_trips(value: Any) -> bool:
    """Whether `value` comes back from JSON as it is."""
    try:
        return bool(json.loads(json.dumps(value)) == value)
    except (TypeError, ValueError):
        return False


def checksum(tensor: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes: finds flipped and missing bytes (not tampering) at about 1 GiB/s."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return f"crc32:{zlib.crc32(flat.numpy().data):08x}"


def meta_checksum(meta: dict[str, Any]) -> str:
    """CRC-32 of the metadata but this field, as canonical JSON: a digit changed in a learning rate or a step
    count is found like a flipped byte in a tensor."""
    text = json.dumps({k: v for k, v in meta.items() if k != "meta_checksum"}, sort_keys=True)
    return f"crc32:{zlib.crc32(text.encode()):08x}"


@outside_inference_mode
def load_checkpoint(path: str | os.PathLike, model: ChunkedModel, optimizer: ChunkOptimizer, *,
                    together: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote; returns its metadata. Training continues bit-identically.

    Raises CheckpointDamaged when the files are unreadable or fail their checksums, CheckpointError
    when they do not fit this model or optimizer; either way nothing has been changed (but by a module's
    `set_extra_state` that raises, after the values were written, as in PyTorch). `together`: a process group
    whose every rank loads its own part of one checkpoint in this call, all of them or none (a pipeline's stages).
    """
    shards = model.runtime.shards
    try:
        try:
            _check_pair(model, optimizer)
            path, meta, restore = _read(Path(path), model, optimizer)
        except Exception as error:
            if shards is not None:
                all_read(shards.group, path, error)
            raise
        if shards is not None:
            all_read(shards.group, path, meta.get("meta_checksum"))
    except Exception as error:
        if together is not None:
            all_read(together, path, error)
        raise
    if together is not None:
        all_read(together, path, OWN_PART)
    _apply(restore, model, optimizer)
    saved, dtype = meta.get("dtype"), model.runtime.config.dtype
    if saved is not None and saved != dtype:  # (values and states are fp32 in the file)
        log.warning("chunkmem: %s was saved by a run in dtype=%r and resumes in dtype=%r%s", path, saved, dtype,
                    ": its loss scale is not used" if meta.get("loss_scaler") and restore.scaler is None else "")
    return meta


# What a rank of `load_checkpoint(..., together=group)` says it read: each its own part, so only errors are compared.
OWN_PART = "its own part"

# What a rank that read a checkpoint raises when another could not: the other's kind of error (a user resuming where
# one is found, `except FileNotFoundError`, starts afresh on every rank, or on none).
_SHARED_ERRORS = {kind.__name__: kind for kind in (FileNotFoundError, CheckpointDamaged, CheckpointError)}


def all_read(group: Any, path: str | os.PathLike, read: Exception | str | None) -> None:
    """Every rank of `group` loads the same checkpoint, or none: a rank that could not read it (no file system shared
    with rank 0) would leave its part fresh. `read`: this rank's error, or what says which checkpoint it read (its
    metadata's checksum). Raises, on every rank, the first failing rank's kind of error (a rank whose own is of that
    kind returns, and raises its own). A collective."""
    said: list[Any] = [None] * dist.get_world_size(group)
    failed = isinstance(read, Exception)
    dist.all_gather_object(said, type(read).__name__ if failed else ("read", read), group=_checkpoint_group(group))
    errors = [kind for kind in said if not isinstance(kind, tuple)]
    if errors:
        if failed and type(read).__name__ == errors[0]:
            return
        raise _SHARED_ERRORS.get(errors[0], CheckpointError)(
            f"a rank could not load the checkpoint {path} ({errors[0]}: its error says why): nothing was loaded on any "
            "rank; every rank reads the checkpoint rank 0 wrote (a file system they share, or a copy on each node)"
        ) from (read if isinstance(read, Exception) else None)
    if len(set(said)) > 1:
        raise CheckpointError(f"the ranks read different checkpoints at {path} (their metadata differ): nothing was "
                              "loaded on any rank; give every rank the checkpoint rank 0 wrote")


def _read(path: Path, model: ChunkedModel, optimizer: ChunkOptimizer) -> tuple[Path, dict[str, Any], _Restore]:
    """The checkpoint at `path` (or the one a save interrupted), its metadata and what a load writes, all checked."""
    path = existing(path)
    meta = _read_meta(path)
    tensors = _read_tensors(path / TENSORS)
    _verify(path, meta, tensors)
    restore = _Restore(_model_values(path, meta, tensors, model), *_optimizer_values(path, meta, tensors, optimizer))
    return path, meta, restore


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint's files against their checksums, one tensor at a time (no model needed).

    Returns its metadata; raises CheckpointDamaged naming the file and the first bad key.
    """
    path = existing(Path(path))
    meta = _read_meta(path)
    expected = meta.get("checksums")
    file = path / TENSORS
    try:
        with safe_open(str(file), framework="pt") as handle:
            keys = set(handle.keys())
            if expected is not None:
                _same_keys(file, set(expected), keys)
                for key in sorted(keys):
                    _check_sum(file, key, handle.get_tensor(key), expected[key])
    except (SafetensorError, OSError) as error:
        raise _unreadable(file, error) from None
    return meta


def existing(path: Path, marker: str = META) -> Path:
    """`path`, or the checkpoint a save interrupted after moving it aside; the file `marker` says one is there."""
    old, tmp = path.with_name(path.name + ".old"), path.with_name(path.name + ".tmp")
    if not (path / marker).exists() and (old / marker).exists():
        newer = f"; the one it wrote, {tmp}, may be whole (verify_checkpoint says)" if marker == META and \
            (tmp / marker).exists() else ""
        log.warning("chunkmem: no checkpoint at %s, where a save stopped while replacing it: the one it replaced, %s, "
                    "is read%s", path, old, newer)
        return old
    if not (path / marker).exists():
        inside = f": pass its directory, {path.parent}" if (path.parent / marker).exists() else ""
        raise FileNotFoundError(f"no chunkmem checkpoint at {path}: expected a directory holding {marker}, as "
                                f"save_checkpoint writes{inside}")
    return path


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / META
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointDamaged(f"{file} cannot be read as JSON ({error}): the checkpoint is damaged; "
                                f"resume from an earlier one") from None
    if not isinstance(meta, dict):
        raise CheckpointDamaged(f"{file} holds a {type(meta).__name__}, not a JSON object: the checkpoint "
                                f"is damaged; resume from an earlier one")
    if meta.get("format") not in (FORMAT, UNVERIFIED_FORMAT):
        raise CheckpointError(f"{file} has format {meta.get('format')!r}, expected {FORMAT!r}: it was not "
                              f"written by this version of chunkmem.save_checkpoint")
    missing = [key for key in _META_KEYS if key not in meta]
    if missing:
        raise CheckpointDamaged(f"{file} has no {', '.join(map(repr, missing))}: the checkpoint is incomplete; "
                                f"resume from an earlier one")
    expected = meta.get("meta_checksum")  # none before checkpoints checked their metadata
    if expected is not None and expected != meta_checksum(meta):
        raise CheckpointDamaged(f"{file} has checksum {meta_checksum(meta)}, it recorded {expected}: the file is "
                                f"damaged; resume from an earlier checkpoint")
    if meta["format"] == UNVERIFIED_FORMAT:
        log.warning("%s was written before checkpoints had checksums: its tensors cannot be verified", file)
    return meta


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except (SafetensorError, OSError) as error:
        raise _unreadable(file, error) from None


def _unreadable(file: Path, error: Exception) -> CheckpointDamaged:
    return CheckpointDamaged(f"{file} cannot be read ({type(error).__name__}: {error}): the checkpoint is "
                             f"damaged or was cut short; resume from an earlier one")


def _verify(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    expected = meta.get("checksums")
    if expected is None:  # format 1
        return
    file = path / TENSORS
    _same_keys(file, set(expected), set(tensors))
    for key, value in tensors.items():
        _check_sum(file, key, value, expected[key])


def _same_keys(file: Path, listed: set[str], found: set[str]) -> None:
    if listed - found:
        raise CheckpointDamaged(f"{file} has no tensor {sorted(listed - found)[0]!r}, which {META} lists: the "
                                f"checkpoint is incomplete; resume from an earlier one")
    if found - listed:
        raise CheckpointDamaged(f"{file} holds tensor {sorted(found - listed)[0]!r}, which {META} does not "
                                f"list: the files are of different saves; resume from an earlier checkpoint")


def _check_sum(file: Path, key: str, value: torch.Tensor, expected: str) -> None:
    found = checksum(value)
    if found != expected:
        raise CheckpointDamaged(f"{file}: tensor {key!r} has checksum {found}, {META} recorded {expected}: "
                                f"the file is damaged; resume from an earlier checkpoint")


def _model_values(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor], model: ChunkedModel
                  ) -> dict[str, Any]:
    """The model's values from the checkpoint: every parameter and buffer present, each of its shape, and the extra
    state of modules that have one (`get_extra_state`)."""
    file = path / TENSORS
    given = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    records = model.runtime.store.records
    known: set[str] = set()
    extra: dict[str, Any] = {}
    for name, target in model.module.state_dict(keep_vars=True).items():
        if not isinstance(target, torch.Tensor):  # extra state, kept in the metadata
            if name not in meta.get("extra_state", {}):
                raise CheckpointError(f"{path / META} has no extra state for model/{name}: the checkpoint is of "
                                      f"another model; load it into the model it was saved from")
            extra[name] = meta["extra_state"][name]
            continue
        record = records.get(target)  # type: ignore[call-overload]  # buffers are not records
        names = (name, *record.aliases) if record is not None else (name,)
        known.update(names)
        key = next((k for k in names if k in given), None)
        if key is None:
            raise CheckpointError(f"{file} has no value for model/{name}: the checkpoint is of another model; "
                                  f"load it into the model it was saved from")
        shape = record.shape if record is not None else target.shape
        if given[key].shape != shape:
            raise CheckpointError(f"{file}: model/{key} has shape {tuple(given[key].shape)}, the model's is "
                                  f"{tuple(shape)}: the checkpoint is of another model configuration")
        # A float buffer is in the compute dtype where that is wider (wrapper.py): the run's dtype may be another.
        if record is not None or not (given[key].is_floating_point() and target.is_floating_point()):
            _check_dtype(file, f"model/{key}", given[key], torch.float32 if record is not None else target.dtype)
    unexpected = sorted(given.keys() - known)
    if unexpected:
        raise CheckpointError(f"{file} holds model/{unexpected[0]}, which the model does not have "
                              f"({len(unexpected)} such keys): the checkpoint is of another model")
    return {**given, **extra}


def _optimizer_values(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor], optimizer: ChunkOptimizer
                      ) -> tuple[list[dict[str, Any]], dict[ParamRecord, float],
                                 dict[tuple[ParamRecord, str], torch.Tensor], dict[str, Any] | None]:
    file = path / META
    if meta["optimizer"] != optimizer.wrapped_type.__name__:
        raise CheckpointError(f"{file}: checkpoint holds {meta['optimizer']} state but the optimizer is "
                              f"{optimizer.wrapped_type.__name__}: use the same optimizer class to resume")
    groups = _groups(file, meta["param_groups"], optimizer)
    for index, group in enumerate(groups):
        try:
            optimizer._check_momentum(group)
        except ValueError as error:  # its momentum buffers have no chunks to go to
            raise CheckpointError(f"{file}: param_groups[{index}] was saved with momentum={group['momentum']}, and "
                                  "this optimizer was given to chunkmem.prepare with momentum=0 in every group, so it "
                                  "keeps no momentum buffers: make it with the saved momentum") from error
    steps = _step_counts(file, meta["steps"], optimizer)
    states = {}
    kinds = optimizer.runtime.store.families.saved
    for record, count in steps.items():
        # Never stepped: no states. A count set back to 0 that kept its states (`restarted`): all of them.
        if count <= 0 and not any(f"optim/{kind}/{record.name}" in tensors for kind in kinds):
            continue
        for kind in kinds:
            key = f"optim/{kind}/{record.name}"
            value = tensors.get(key)
            if value is None:
                raise CheckpointError(f"{path / TENSORS} has no {key!r}, but {record.name} has taken {count:g} "
                                      f"steps (or keeps states at 0): the checkpoint is incomplete; resume from an "
                                      f"earlier one")
            if value.shape != record.shape:
                raise CheckpointError(f"{path / TENSORS}: {key!r} has shape {tuple(value.shape)}, the parameter's "
                                      f"is {tuple(record.shape)}: the checkpoint is of another model")
            _check_dtype(path / TENSORS, key, value, torch.float32)
            states[record, kind] = value
    return groups, steps, states, _scaler(file, meta["loss_scaler"], optimizer)


def _check_dtype(file: Path, key: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """save_checkpoint writes parameters and optimizer states in fp32, buffers in their own dtype."""
    if value.dtype != dtype:
        raise CheckpointError(f"{file}: {key!r} is {value.dtype}, expected {dtype} (what save_checkpoint writes): "
                              f"the file was written by something else; save it with chunkmem.save_checkpoint")


def _same_kind(saved: Any, current: Any) -> bool:
    """Whether a saved hyperparameter can stand for the current one: a number for a number (a tensor's too), a
    flag for a flag, a sequence of as many for a sequence (betas), a string for a string."""
    if isinstance(current, bool) or current is None:
        return saved is None or isinstance(saved, bool)
    if isinstance(current, (int, float, torch.Tensor)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(current, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_same_kind, saved, current))
    return not isinstance(current, str) or isinstance(saved, str)


def _groups(file: Path, saved: Any, optimizer: ChunkOptimizer) -> list[dict[str, Any]]:
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        count = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise CheckpointError(f"{file}: param_groups holds {count} groups, the optimizer has "
                              f"{len(optimizer.param_groups)}: build the optimizer as the saved run did")
    records = optimizer.runtime.store.records
    out = []
    for index, (group, current) in enumerate(zip(saved, optimizer.param_groups)):
        names = [records[p].name for p in current["params"]]
        if not isinstance(group, dict) or group.get("params") != names:
            raise CheckpointError(f"{file}: param_groups[{index}] holds other parameters than the optimizer's "
                                  f"group {index}: build the optimizer's groups as the saved run did")
        wrong = [k for k in current if k != "params" and k in group and not _same_kind(group[k], current[k])]
        if wrong:
            raise CheckpointError(f"{file}: param_groups[{index}][{wrong[0]!r}] is {group[wrong[0]]!r}, the "
                                  f"optimizer's is {current[wrong[0]]!r}: the file was changed or written by "
                                  f"something else")
        # An option the optimizer has that the saved group lacks (one a later torch added: AdamW's
        # `decoupled_weight_decay`) is at its default, as optimizer.load_state_dict leaves it. Another key (an LR
        # scheduler's `initial_lr`, where the saved run had none) keeps its value.
        saved_options = {k: tuple(v) if k == "betas" else v for k, v in group.items() if k != "params"}
        out.append({**optimizer.defaults, **saved_options})
    return out


def _step_counts(file: Path, saved: Any, optimizer: ChunkOptimizer) -> dict[ParamRecord, float]:
    if not isinstance(saved, dict):
        raise CheckpointDamaged(f"{file}: steps is a {type(saved).__name__}, expected an object of step counts")
    out = {}
    for record in optimizer.steps:
        count = saved.get(record.name)
        if not is_step_count(count):
            raise CheckpointError(f"{file}: steps[{record.name!r}] is {count!r}, expected a step count: the "
                                  f"checkpoint is of another model or incomplete")
        out[record] = float(count)
    return out


def _scaler(file: Path, saved: Any, optimizer: ChunkOptimizer) -> dict[str, Any] | None:
    scaler = optimizer.runtime.scaler
    if saved is None or scaler is None:
        return None
    problem = scaler.problem(saved)
    if problem is not None:
        raise CheckpointError(f"{file}: loss_scaler is {saved!r}: {problem}")
    return saved


def _apply(restore: _Restore, model: ChunkedModel, optimizer: ChunkOptimizer) -> None:
    """Write what `load_checkpoint` checked; nothing here can fail on the checkpoint's account (but a module's
    `set_extra_state` refusing its state: the model's values are loaded then, the optimizer's states not)."""
    runtime = optimizer.runtime
    model.load_state_dict(restore.values)
    for saved, group in zip(restore.groups, optimizer.param_groups):
        group.update({k: _as_held(v, group.get(k)) for k, v in saved.items()})
    optimizer.set_states(restore.steps, restore.states)
    if restore.scaler is not None and runtime.scaler is not None:
        runtime.scaler.__dict__.update(restore.scaler)
    model.zero_grad()


def _collect(model: ChunkedModel, optimizer: ChunkOptimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """What save_checkpoint writes: under ZeRO gathered on rank 0 alone, which writes it (a collective)."""
    runtime = model.runtime
    root = None if runtime.shards is None else 0
    state = model.consolidated(root)
    tensors = {f"model/{k}": v.contiguous() for k, v in _untied(state).items()}
    steps = steps_by_name(optimizer)
    for (record, kind), value in optimizer_states(optimizer, root).items():
        if steps[record.name] > 0 or record in optimizer.restarted:  # those with states (statecopy's `_has_stepped`)
            tensors[f"optim/{kind}/{record.name}"] = value.contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [runtime.store.records[p].name
                                                                          for p in g["params"]]}
              for g in optimizer.param_groups]
    scaler = runtime.scaler.__dict__ if runtime.scaler else None
    meta = {"format": FORMAT, "optimizer": optimizer.wrapped_type.__name__, "steps": steps,
            "param_groups": _jsonable(groups), "loss_scaler": scaler, "dtype": runtime.config.dtype}
    extra = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}  # modules' get_extra_state
    if extra:
        meta["extra_state"] = extra
    return tensors, meta


def optimizer_states(optimizer: ChunkOptimizer, root: int | None = None) -> dict[tuple[ParamRecord, str], torch.Tensor]:
    """Every state of each of `optimizer`'s parameters (a manager's runtime holds other models' too), on CPU: under
    ZeRO gathered on every rank, or on rank `root` alone (a collective)."""
    data = optimizer.runtime.data
    return {(record, kind): value for kind in optimizer.runtime.store.families.saved
            for record, value in data.values(kind, root).items() if record in optimizer.steps}


def steps_by_name(optimizer: ChunkOptimizer) -> dict[str, float]:
    """Step counts by parameter name; under ZeRO only a parameter's owner counts its steps."""
    records = list(optimizer.steps)
    none = torch.zeros((), dtype=torch.float64, device="cpu")
    steps = torch.stack([optimizer.steps[r] if r.group.owned else none for r in records]).double()
    shards = optimizer.runtime.shards
    if shards is not None:
        shards.all_reduce(steps)
    return {r.name: s for r, s in zip(records, steps.tolist())}


def _untied(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of `state`: safetensors refuses shared tensors, so the first name of each tied group."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _as_held(saved: Any, live: Any) -> Any:
    """A saved option in the type the live group holds it in, which JSON does not keep: a tensor (torch.optim rounds a
    tensor lr otherwise than a float one) or a tuple (betas)."""
    if isinstance(live, torch.Tensor) and isinstance(saved, (int, float)):
        return torch.tensor(saved, dtype=live.dtype, device=live.device)
    if isinstance(live, tuple) and isinstance(saved, (list, tuple)) and len(saved) == len(live):
        return tuple(_as_held(s, held) for s, held in zip(saved, live))
    return saved


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
    # A manager's models share one runtime: the optimizer's own parameters tell its model.
    if optimizer.runtime is not model.runtime or (optimizer.own is not None and
                                                  optimizer.own != frozenset(model.parameters())):
        raise ValueError("the optimizer was prepared with another model: pass the pair chunkmem.prepare (or "
                         "Manager.prepare) returned")
