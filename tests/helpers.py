"""Models and training loops shared by the tests: always a plain PyTorch reference beside chunkmem."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import chunkmem


def mlp(width: int = 32, depth: int = 6, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def tiny_gpt2(seed: int = 0, layers: int = 4, width: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=width, n_layer=layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def tiny_gemma3n(**overrides) -> nn.Module:
    """Transformers' Gemma3n text model, three layers: AltUp, per-layer inputs and Laurel around each layer."""
    import transformers
    layers = 3
    config = transformers.Gemma3nTextConfig(
        hidden_size=32, intermediate_size=[64] * layers, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=128, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, laurel_rank=8, num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.0] * layers,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=8,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=1, **overrides)
    torch.manual_seed(0)
    return transformers.Gemma3nForCausalLM(config).train()


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def mlp_batches(steps: int, width: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(steps)]


def gpt2_batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(steps)]


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def gpt2_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss.float()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, loss_fn: Callable,
          scheduler: Callable | None = None, clip: float | None = None, accumulate: int = 1) -> list[float]:
    """A plain loop; works the same on a plain model and on a prepared one."""
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            clip_fn = getattr(model, "clip_grad_norm_", None)
            clip_fn(clip) if clip_fn else nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses


def module_hooks(cm: nn.Module) -> int:
    """How many of chunkmem's forward hooks the prepared model's modules carry (none while it runs resident)."""
    from chunkmem.runtime.hooks import Hooks

    return sum(isinstance(getattr(hook, "__self__", None), Hooks)
               for m in cm.module.modules() for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))


def grad_hooks(cm: nn.Module) -> int:
    """How many of the prepared model's parameters carry chunkmem's gradient hook (none while it runs resident)."""
    from chunkmem.runtime.hooks import _grad_ready

    return sum(getattr(hook, "func", None) is _grad_ready
               for p in cm.module.parameters() for hook in (p._post_accumulate_grad_hooks or {}).values())


def prepared(model: nn.Module, make_opt: Callable, **config) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A deep copy of `model` prepared by chunkmem in the CPU simulation."""
    copy_ = copy.deepcopy(model)
    return chunkmem.prepare(copy_, make_opt(copy_.parameters()), chunkmem.Config(device="cpu", **config))


def accepts(model: nn.Module, make_opt: Callable, budget: int, **config) -> bool:
    """Whether prepare accepts `budget` for (a copy of) `model`."""
    copied = copy.deepcopy(model)
    params = [p for p in copied.parameters() if p.requires_grad]
    try:
        chunkmem.prepare(copied, make_opt(params), chunkmem.Config(device="cpu", device_memory=budget, **config))
    except chunkmem.MemoryBudgetError:
        return False
    return True


def least_accepted(model: nn.Module, make_opt: Callable, low: int = 1, high: int | None = None, **config) -> int:
    """The least device budget in [low, high] that prepare accepts (acceptance grows with the budget: bisect)."""
    high = 4 * param_bytes(model) if high is None else high
    if accepts(model, make_opt, low, **config):
        return low
    assert accepts(model, make_opt, high, **config), f"prepare refuses even {high} bytes"
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if accepts(model, make_opt, middle, **config) else (middle + 1, high)
    return low


def updates(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: after[k] - before[k] for k in before}


def assert_updates_close(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], rtol: float) -> None:
    """Per-tensor relative difference of updates (final minus initial), normwise."""
    for name in ref:
        scale = ref[name].norm().clamp_min(1e-12)
        assert (got[name] - ref[name]).norm() / scale <= rtol, name
