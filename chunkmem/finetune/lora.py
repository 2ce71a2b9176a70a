"""Low-rank adapters: train two small matrices per layer while the base weights stay frozen.

Frozen base weights go into chunkmem's frozen chunks, which carry no gradient, master copy or
optimizer state, so a LoRA run stores the base model once, in the compute dtype. The adapters are
ordinary trainable parameters. For export the update is folded back into the base weight
(W + B A * alpha / r), so the saved directory is a plain Hugging Face model of the original class.

Works with `nn.Linear` (weight [out, in]) and Hugging Face's `Conv1D` (weight [in, out], GPT-2).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from chunkmem.finetune.hf import Entry

DEFAULT_SKIP = ("lm_head",)  # the output projection is usually tied to the embeddings: leave it alone


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class LoRALinear(nn.Module):
    """`base(x) + dropout(x) A^T B^T * alpha / rank`; B starts at zero, so training starts at the base."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank={rank}: expected a positive int")
        self.base = base
        self.transposed = _is_conv1d(base)  # Conv1D keeps its weight as [in, out]
        weight = base.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"LoRA base {type(base).__name__}: expected a `weight` tensor "
                            f"(nn.Linear or Conv1D), got {type(weight).__name__}")
        rows, cols = weight.shape
        self.in_features, self.out_features = (rows, cols) if self.transposed else (cols, rows)
        self.rank, self.scale = rank, alpha / rank
        # Adapters are created on the CPU in fp32 even when the base is on the meta device.
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))  # [out, r]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = nn.functional.linear(nn.functional.linear(self.dropout(x), self.lora_A), self.lora_B)
        return self.base(x) + update * self.scale

    def delta(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """The change to the base weight, in the base weight's layout."""
        product = (lora_b @ lora_a) * self.scale  # [out, in]
        return product.t() if self.transposed else product


def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: tuple[str, ...] | None = None) -> list[str]:
    """Freeze every parameter of `model` and wrap its Linear/Conv1D layers in adapters, in place.

    targets: substrings of module names to adapt (e.g. ("q_proj", "v_proj")); None: every linear
    layer but the output head. Returns the names of the wrapped modules.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    chosen = [name for name, module in model.named_modules()
              if (isinstance(module, nn.Linear) or _is_conv1d(module)) and _wanted(name, targets)]
    if not chosen:
        raise ValueError(f"LoRA targets {targets} match no Linear or Conv1D module of {type(model).__name__}: "
                         f"pass substrings of its module names")
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    return chosen


def _wanted(name: str, targets: tuple[str, ...] | None) -> bool:
    if targets is None:
        return not any(name == skip or name.endswith("." + skip) for skip in DEFAULT_SKIP)
    return any(t in name for t in targets)


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def renames(model: nn.Module) -> dict[str, str]:
    """Checkpoint names of the original model -> names inside the adapted one."""
    out = {}
    for name, module in adapters(model).items():
        for param, _ in module.base.named_parameters():
            out[f"{name}.{param}"] = f"{name}.base.{param}"
    return out


def merged(model: nn.Module) -> Callable[[list[Entry]], list[Entry]]:
    """A transform for `hf.save_pretrained`: original names, base weights with the update folded in."""
    found = adapters(model)

    def transform(todo: list[Entry]) -> list[Entry]:
        by_name = {e.name: e for e in todo}
        drop = {f"{n}.lora_{x}" for n in found for x in "AB"}
        out = []
        for entry in todo:
            if entry.name in drop:
                continue
            prefix, _, leaf = entry.name.rpartition(".base.")
            if prefix in found and leaf == "weight":
                entry = _fold(entry, f"{prefix}.weight", found[prefix], by_name[f"{prefix}.lora_A"],
                              by_name[f"{prefix}.lora_B"])
            elif prefix in found:
                entry = Entry(f"{prefix}.{leaf}", entry.shape, entry.read)
            out.append(entry)
        return out

    return transform


def _fold(base: Entry, name: str, module: LoRALinear, lora_a: Entry, lora_b: Entry) -> Entry:
    def read() -> torch.Tensor:
        return base.read() + module.delta(lora_a.read(), lora_b.read())

    return Entry(name, base.shape, read)
