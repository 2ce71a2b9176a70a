"""Hugging Face checkpoints in and out of chunks, without a second copy of the model in host memory.

Loading builds the model with its parameters on the meta device (buffers stay real, so rotary
tables and masks come out of the constructor exactly as Hugging Face computes them), prepares it,
and streams safetensors shards tensor by tensor into the chunks: peak host memory is the model
data plus one mapped shard. Saving goes the other way, one parameter at a time, into a sharded
Hugging Face directory that `from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from chunkmem.files import fsync_dir, fsync_file, share_like_others
from chunkmem.wrapper import ChunkedModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger("chunkmem")

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class InputError(ValueError):
    """A user's input (path, file, size) that cannot work; the message says which and what to do."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a config, and optionally weights and a tokenizer beside it."""

    config: Any  # transformers.PretrainedConfig
    directory: Path  # the folder holding config.json
    weight_files: tuple[Path, ...]  # safetensors shards; empty: initialise at random
    has_tokenizer: bool


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a Hugging Face state dict, read only when its shard is written."""

    name: str
    shape: torch.Size
    read: Callable[[], torch.Tensor]  # fp32 (or the buffer's own dtype) on CPU


def resolve(path: str | os.PathLike) -> ModelSource:
    """A local Hugging Face directory, or a config.json file; never a hub download."""
    from transformers import AutoConfig

    path = Path(path)
    config_file = path / CONFIG if path.is_dir() else path
    if not config_file.is_file():
        raise InputError(f"--model {path}: no such directory or config file (expected {config_file}); pass a "
                         f"local Hugging Face directory with config.json, or a config.json file "
                         f"(chunkmem does not download from the hub)")
    try:
        config = AutoConfig.from_pretrained(str(config_file))
    # Not only ValueError and KeyError: a config class that checks its fields' types raises huggingface_hub's
    # StrictDataclassFieldValidationError, an Exception of its own (a layer count of "two").
    except Exception as error:
        raise InputError(f"--model {path}: {config_file} is not a Hugging Face config ({error}); "
                         f"check its model_type and the fields named") from error
    directory = config_file.parent
    weights = weight_files(directory) if path.is_dir() else ()
    if path.is_dir() and not weights:
        log.warning("--model %s holds no weights: training starts from random ones", path)
    has_tokenizer = path.is_dir() and any((directory / f).exists() for f in ("tokenizer.json", "tokenizer.model",
                                                                            "vocab.json"))
    return ModelSource(config, directory, weights, has_tokenizer)


def weight_files(directory: Path) -> tuple[Path, ...]:
    """The safetensors shards of a directory, from its index when there is one."""
    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = [str(name) for name in dict.fromkeys(weight_map.values())]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise InputError(f"--model {index}: not a safetensors index ({error}): it maps each tensor to its shard "
                             "under \"weight_map\"; download it again") from None
        return tuple(directory / name for name in names)  # a missing one is named where it is read (`_opened`)
    if (directory / SINGLE).exists():
        return (directory / SINGLE,)
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise InputError(f"--model {directory}: weights are pickled (.bin/.pt), chunkmem reads safetensors only; "
                         f"convert them once with transformers' save_pretrained(..., safe_serialization=True)")
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if others:
        raise InputError(f"--model {directory}: {', '.join(others)} without {INDEX} (nor one {SINGLE}): which "
                         "tensors each holds is unknown; save the model with transformers' save_pretrained, or "
                         "pass its config.json alone to start from random weights")
    return ()


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position embeddings allow, when the config says."""
    for field in ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers stay real.

    Patches `nn.Module.register_parameter` for the duration (not thread-safe). A parameter already
    on meta is registered as it is, so weights tied by assignment stay one Parameter.
    """
    original = nn.Module.register_parameter

    # Named `self` so the signature matches the method it replaces.
    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build(config: Any, on_meta: bool, seed: int = 0) -> PreTrainedModel:
    """A causal LM from `config`: empty (meta parameters) to load into, or seeded random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with params_on_meta() if on_meta else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config)
    return model


def load_weights(model: ChunkedModel, files: tuple[Path, ...], renames: dict[str, str] | None = None,
                 required: set[str] | None = None) -> None:
    """Stream safetensors shards into the prepared model's chunks, one tensor at a time.

    required: parameter names that must get a value (default: all); adapters added after the
    model was built, for instance, are initialised already and not in the checkpoint.
    """
    targets = _targets(model)
    prefix = getattr(model.module, "base_model_prefix", "")
    filled: set[int] = set()
    unexpected: list[str] = []
    bar = tqdm(files, desc="loading", unit="shard", disable=_quiet())
    with torch.no_grad():
        for file in bar:
            with _opened(file) as handle:
                for key in handle.keys():
                    name = _match(key, targets, renames or {}, prefix)
                    if name is None:
                        unexpected.append(key)
                        continue
                    target = targets[name]
                    _assign(model, target, handle.get_tensor(key), key)
                    filled.add(id(target))
    if unexpected:
        log.warning("ignored %d tensors the model does not have: %s", len(unexpected), unexpected[:5])
    missing = [n for n, p in model.module.named_parameters()
               if id(p) not in filled and (required is None or n in required)]
    if missing:
        raise InputError(f"the checkpoint in {files[0].parent} has no values for {len(missing)} parameters "
                         f"(first: {missing[:3]}): its config.json does not match its weights")


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """safetensors' reader of a weights file, or an InputError naming it."""
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as error:  # noqa: BLE001  SafetensorError, OSError: unreadable either way
        raise InputError(f"--model {file}: not a readable safetensors file ({error}): download it again") from None
    with handle:
        yield handle


def _targets(model: ChunkedModel) -> dict[str, torch.Tensor]:
    """Every name a checkpoint may use for a parameter or persistent buffer (tied names included)."""
    return dict(model.module.state_dict(keep_vars=True)) | {
        alias: r.param for r in model.runtime.store.records.values() for alias in r.aliases}


def _match(key: str, targets: dict[str, torch.Tensor], renames: dict[str, str], prefix: str) -> str | None:
    # Checkpoints of a bare base model ("h.0...") load into its LM wrapper ("transformer.h.0...").
    for name in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")):
        name = renames.get(name, name)
        if name in targets:
            return name
    return None


def _assign(model: ChunkedModel, target: torch.Tensor, value: torch.Tensor, key: str) -> None:
    if value.shape != target.shape:
        raise InputError(f"checkpoint tensor {key} has shape {tuple(value.shape)}, the model expects "
                         f"{tuple(target.shape)}: its config.json does not match its weights")
    record = model.runtime.store.records.get(target)  # type: ignore[call-overload]
    if record is not None:
        model.runtime.data.set_value(record, value)
    else:
        target.copy_(value)


def entries(model: ChunkedModel) -> list[Entry]:
    """The module's state dict as lazy entries, one per tensor; a tied group appears once."""
    runtime, seen = model.runtime, set()
    out = []
    for name, tensor in model.module.state_dict(keep_vars=True).items():
        record = runtime.store.records.get(tensor)  # type: ignore[call-overload]
        if record is None:
            out.append(Entry(name, tensor.shape, functools.partial(_cpu_copy, tensor)))
        elif id(record) not in seen:
            seen.add(id(record))
            out.append(Entry(name, record.shape, functools.partial(runtime.data.fp32_value, record)))
    return out


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def save_pretrained(model: ChunkedModel, out: str | os.PathLike, dtype: str = "fp32",
                    tokenizer: Path | Any = None, max_shard_bytes: int = 2 * 2**30,
                    transform: Callable[[list[Entry]], list[Entry]] | None = None) -> Path:
    """Write a Hugging Face directory (config, sharded safetensors with an index, tokenizer files).

    tokenizer: a directory whose tokenizer files are copied, or a tokenizer (anything with
    `save_pretrained`) to write, or None. Tensors are read one at a time and a shard is held only
    while it is written. Files go to `out/.saving` first and are renamed into place, the index last.
    """
    out = Path(out)
    todo = transform(entries(model)) if transform else entries(model)
    torch_dtype = _DTYPES[dtype]
    shards = _plan(todo, torch_dtype.itemsize, max_shard_bytes)
    tmp = out / ".saving"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    bar = tqdm(total=len(todo), desc="saving", unit="tensor", disable=_quiet())
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for entry in shard:
            value = entry.read()
            tensors[entry.name] = value.to(torch_dtype) if value.is_floating_point() else value
            total += tensors[entry.name].nbytes
            weight_map[entry.name] = file
            bar.update()
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        share_like_others(tmp / file)
        del tensors
    bar.close()
    _write_config(model, tmp, dtype)
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if isinstance(tokenizer, Path):
        _copy_tokenizer(tokenizer, tmp)
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    _swap_in(tmp, out)
    return out


def _plan(todo: list[Entry], itemsize: int, max_shard_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in todo:
        nbytes = entry.shape.numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _write_config(model: ChunkedModel, folder: Path, dtype: str) -> None:
    module = model.module
    config = cast("PretrainedConfig", module.config)  # nn.Module's __getattr__ types it as Tensor | Module
    config.architectures = [type(module).__name__]
    config.dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    config.save_pretrained(str(folder))
    generation = getattr(module, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(folder))


def _copy_tokenizer(tokenizer_dir: Path, folder: Path) -> None:
    if tokenizer_dir.resolve() == folder.parent.resolve():
        return
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, folder / name)


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace the previous weights with the new ones. The old index and weights in other forms (one
    model.safetensors, pickled .bin files: transformers reads those before an index) go first, so that a folder a
    crash leaves half swapped fails to load rather than mixing old and new shards; the new index goes last, so a
    reader never sees it point at missing shards."""
    stale = [out / INDEX, out / SINGLE, *out.glob("pytorch_model*.bin"), *out.glob("pytorch_model.bin.index.json"),
             *(old for old in out.glob("model-*-of-*.safetensors") if not (tmp / old.name).exists())]
    for old in stale:
        old.unlink(missing_ok=True)
    fsync_dir(out)
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != INDEX] + [INDEX]:
        fsync_file(tmp / name)
        os.replace(tmp / name, out / name)
    fsync_dir(out)
    tmp.rmdir()


def _quiet() -> bool:
    return os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
