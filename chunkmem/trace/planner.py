"""`chunkmem plan`: will a model train within a device and host budget, and if not, what to change.

Model data is not estimated but computed: the model is built on the meta device (no memory) and
the runtime's own chunk-size search and layout (chunkmem.chunks.layout, chunkmem.chunks.store) give the chunk
count, so the figure equals `memory_stats()["model_data_bytes"]` of the prepared model. Non-model
data is chunkmem/trace/activation_model.py's estimate plus fixed margins:
  CUDA_CONTEXT  what a training process holds on the device outside PyTorch's allocator (CUDA context,
                kernels, libraries): 590-814 MiB measured on an H100 (torch 2.11, CUDA 13.0), the most taken
  FRAGMENTATION a share of the device budget the caching allocator cannot hand out (the same share
                the runtime's placement keeps free, chunkmem.chunks.placement.SAFETY_FRACTION)
  HOST_OVERHEAD the resident memory of torch and the CUDA libraries in the host process
Constraints: the device must hold one module's chunks (the working set) with the activation peak
and margins; the host must hold all model data (chunkmem keeps every chunk's host copy) and the
overhead. With a disk tier (`disk`, Config(disk=...)), when all model data does not fit the host,
the host holds the parameter and gradient chunks and the master and optimizer states of a few
groups (chunkmem/runtime/limits.py `disk_room`); the rest lives on disk, and every step reads it
back and writes it again (about the disk tier's bytes each way). Verdict: "does not fit" if a constraint fails, "tight" if one is above TIGHT of its
budget, else "fits". The binding constraint is the one closest to (or furthest past) its budget.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from chunkmem.chunks.family import Families
from chunkmem.chunks.layout import search_chunk_size
from chunkmem.chunks.placement import SAFETY_FRACTION
from chunkmem.chunks.store import layouts, working_set_chunks
from chunkmem.config import DEFAULT_DTYPE
from chunkmem.runtime.limits import MIN_DISK_GROUPS, tier_bytes
from chunkmem.trace.activation_model import Shape, estimate
from chunkmem.zero.shards import least_device_bytes

CUDA_CONTEXT = 832 * 2**20
HOST_OVERHEAD = 2 * 2**30
TIGHT = 0.9
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": (), "sgd-momentum": ("momentum_buffer",)}  # by --optimizer


@dataclasses.dataclass(frozen=True)
class Request:
    """What the user wants to run, and with what. device_memory is per rank (one GPU); host_memory is
    one machine's, shared by the ranks on it (ranks_per_host; None: all of world_size, one machine)."""

    device_memory: int
    host_memory: int
    batch_size: int = 8
    seq_len: int = 1024
    dtype: str = DEFAULT_DTYPE
    checkpointing: bool = False
    offload_activations: bool = False
    world_size: int = 1
    optimizer: str = "adam"
    attention: str = "fused"
    cuda: bool = True  # margins for a CUDA device (False: the CPU simulation)
    ranks_per_host: int | None = None
    disk: bool = False  # a disk tier (Config(disk=...)) takes what host memory cannot hold

    @property
    def hosted_ranks(self) -> int:
        return min(self.world_size, self.ranks_per_host or self.world_size)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"hosted_ranks": self.hosted_ranks}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: its parameter module (on meta) and its activation shape."""

    module: nn.Module
    shape: Shape
    name: str


@dataclasses.dataclass(frozen=True)
class Estimate:
    request: Request
    chunk_size: int
    trainable_chunks: int
    frozen_chunks: int
    model_data_bytes: int  # per rank, as memory_stats()["model_data_bytes"]
    model_data_by_kind: dict[str, int]
    working_set_bytes: int
    activation_bytes: int
    activation_forward_bytes: int  # saved at the end of the forward (differs with checkpointing)
    margin_bytes: int
    device_need: int  # least device memory: working set + activations + margins
    device_all_resident: int  # device memory with every chunk resident (nothing moves)
    host_need: int  # per rank
    host_need_per_host: int  # what the ranks on one machine need together: held against host_memory
    pinned_bytes: int
    verdict: str
    binding: str
    disk_bytes: int = 0  # per rank, on disk (disk tier); also read and written back every step
    offloaded_activation_bytes: int = 0  # saved activations waiting on the host (offload_activations)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request"] = self.request.to_json()
        return out


def chunk_layout(module: nn.Module, request: Request) -> tuple[int, int, int, int]:
    """(chunk_size, trainable chunks, frozen chunks, working-set chunks), as chunkmem.prepare chooses them."""
    return _layout(module, ITEMSIZE[request.dtype], request.world_size, request.device_memory)


@functools.lru_cache(maxsize=32)  # a search of combined fixes (trace/search.py) asks for a few layouts many times
def _layout(module: nn.Module, itemsize: int, world: int, device_memory: int) -> tuple[int, int, int, int]:
    named = [(n, p.numel()) for n, p in module.named_parameters()]
    size = search_chunk_size(named, multiple_of=world,
                             fits=lambda s: least_device_bytes(module, s, itemsize, world) <= device_memory)
    trainable, frozen = layouts(module, size, world)
    return size, trainable.num_chunks, frozen.num_chunks, working_set_chunks(module, size)


def model_data(module: nn.Module, request: Request) -> tuple[int, int, int, int, dict[str, int]]:
    """chunk_size, chunks and per-rank bytes by kind, exactly as the runtime allocates them."""
    size, trainable, frozen, working = chunk_layout(module, request)
    world = request.world_size
    owned_trainable, owned_frozen = trainable // world, frozen // world  # counts are multiples of world
    families = _families(request)
    kinds = {f.name: owned_trainable * f.dtype.itemsize * size for f in families.trained}
    kinds["param"] += owned_frozen * families.dtype.itemsize * size
    return size, trainable, frozen, working * size * families.dtype.itemsize, kinds


def _families(request: Request) -> Families:
    return Families.declare(DTYPES[request.dtype], STATES[request.optimizer])


def plan(spec: ModelSpec, request: Request) -> Estimate:
    if request.optimizer not in STATES:
        raise ValueError(f"optimizer={request.optimizer!r}: expected one of {sorted(STATES)}")
    size, trainable, frozen, working, kinds = model_data(spec.module, request)
    acts = estimate(spec.shape, request.batch_size, request.seq_len, ITEMSIZE[request.dtype],
                    request.checkpointing, request.attention)
    device_acts = acts.peak
    host_acts = 0
    if request.offload_activations:
        # Saved tensors wait on the host; the device keeps those of the layer computing now.
        host_acts = acts.peak - acts.once - acts.per_layer if not request.checkpointing else acts.boundaries
        device_acts = acts.peak - host_acts
    margin = int(request.device_memory * SAFETY_FRACTION) + (CUDA_CONTEXT if request.cuda else 0)
    total = sum(kinds.values())
    device_need = working + device_acts + margin
    overhead = host_acts + (HOST_OVERHEAD if request.cuda else 0)
    host_need, disk_bytes = total + overhead, 0
    if request.disk and host_need * request.hosted_ranks > request.host_memory:
        fixed, disk_bytes, group = tier_bytes(spec.module, size, _families(request), request.world_size)
        host_need = fixed + min(disk_bytes, MIN_DISK_GROUPS * group) + overhead
    per_host = host_need * request.hosted_ranks
    ratios = {"device memory": device_need / request.device_memory, "host memory": per_host / request.host_memory}
    binding = max(ratios, key=ratios.__getitem__)
    worst = ratios[binding]
    verdict = "does not fit" if worst > 1.0 else "tight" if worst > TIGHT else "fits"
    return Estimate(request, size, trainable, frozen, total, kinds, working, device_acts, acts.forward_peak,
                    margin, device_need,
                    total + device_acts + margin, host_need, per_host, host_need - overhead + host_acts if request.cuda else 0,
                    verdict, binding, disk_bytes, host_acts)


def fixes(spec: ModelSpec, request: Request) -> list[tuple[str, Estimate]]:
    """Changes that help, best first: those that make it fit, then by how much they lower the binding need."""
    base = plan(spec, request)
    candidates: list[tuple[str, Request]] = []
    if not request.checkpointing:
        candidates.append(("enable activation checkpointing (--grad-ckpt)", dataclasses.replace(request, checkpointing=True)))
    if request.batch_size > 1:
        half = request.batch_size // 2
        candidates.append((f"batch size {half} with 2x gradient accumulation (same tokens per step)",
                           dataclasses.replace(request, batch_size=half)))
    if not request.offload_activations:
        candidates.append(("offload activations to host (Config(offload_activations=True))",
                           dataclasses.replace(request, offload_activations=True)))
    if request.dtype == "fp32":
        candidates.append(("bf16 compute (--dtype bf16)", dataclasses.replace(request, dtype="bf16")))
    hosts = "one host" if request.ranks_per_host is None else f"hosts of {request.ranks_per_host}"
    candidates.append((f"shard over {request.world_size * 2} GPUs on {hosts} (torchrun, ZeRO)",
                       dataclasses.replace(request, world_size=request.world_size * 2)))
    if base.binding == "host memory" and base.verdict != "fits" and not request.disk:
        candidates.append(("master weights and optimizer states on disk (Config(disk=DIR), --disk)",
                           dataclasses.replace(request, disk=True)))
    if base.binding == "host memory" and base.verdict != "fits":
        candidates.append((f"allow {_gib(base.host_need_per_host / TIGHT)} of host memory",
                           dataclasses.replace(request, host_memory=int(base.host_need_per_host / TIGHT) + 1)))
    rank = {"fits": 0, "tight": 1, "does not fit": 2}
    scored = [(label, plan(spec, r)) for label, r in candidates]
    need = "device_need" if base.binding == "device memory" else "host_need_per_host"
    useful = [(label, e) for label, e in scored if getattr(e, need) < getattr(base, need)]
    return sorted(useful, key=lambda item: (rank[item[1].verdict], getattr(item[1], need)))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def meta_module(config: Any) -> nn.Module:
    """A Hugging Face causal LM built from `config` on the meta device: parameters without memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def shape_of(config: Any) -> Shape:
    hidden = getattr(config, "n_embd", None) or config.hidden_size
    family = "gpt2" if getattr(config, "model_type", "") == "gpt2" else "generic"
    return Shape(family=family, layers=getattr(config, "n_layer", None) or config.num_hidden_layers, hidden=hidden,
                 heads=getattr(config, "n_head", None) or config.num_attention_heads, vocab=config.vocab_size,
                 intermediate=getattr(config, "n_inner", None) or getattr(config, "intermediate_size", None) or 4 * hidden,
                 attn_dropout=float(getattr(config, "attn_pdrop", 0.0) or getattr(config, "attention_dropout", 0.0) or 0.0),
                 embd_dropout=float(getattr(config, "embd_pdrop", 0.0) or 0.0))


def spec_from_config(config: Any, name: str) -> ModelSpec:
    return ModelSpec(meta_module(config), shape_of(config), name)


def gpt2_config(layers: int, hidden: int, vocab: int, positions: int) -> Any:
    """A GPT-2 config of the given size (for --layers/--hidden/--vocab): heads of 64 dimensions."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=vocab,
                      n_positions=positions, bos_token_id=0, eos_token_id=0)
