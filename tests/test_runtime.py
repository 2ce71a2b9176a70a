"""The runtime's promises at prepare: a budget it accepts trains at every step; one it cannot is refused."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.lora import apply_lora
from tests import zoo
from tests.helpers import gpt2_batches, gpt2_loss, param_bytes, tiny_gpt2, train

transformers = pytest.importorskip("transformers")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def accepts(model: nn.Module, budget: int, **config) -> bool:
    copied = copy.deepcopy(model)
    try:
        chunkmem.prepare(copied, ADAMW(trainable(copied)), chunkmem.Config(device="cpu", device_memory=budget, **config))
    except chunkmem.MemoryBudgetError:
        return False
    return True


def smallest_accepted(model: nn.Module, **config) -> int:
    """The least device budget prepare accepts (acceptance grows with the budget: bisect it)."""
    low, high = 1, 4 * param_bytes(model)
    assert accepts(model, high, **config)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if accepts(model, middle, **config) else (middle + 1, high)
    return low


def lora_gpt2() -> nn.Module:
    model = tiny_gpt2(layers=2)
    apply_lora(model, rank=4)  # each adapter owns parameters and calls its frozen base, in other chunks
    return model


NESTED: dict[str, tuple[Callable[[], nn.Module], list, Callable]] = {
    # ViT's embeddings own the CLS and position parameters and call the patch projection; ConvNeXt's layers
    # own the layer scale and call their convolutions.
    "vit": (zoo.by_name("vit").build, zoo.by_name("vit").batches(5), zoo.loss),
    "convnext": (zoo.by_name("convnext").build, zoo.by_name("convnext").batches(5), zoo.loss),
    "lora": (lora_gpt2, gpt2_batches(5), gpt2_loss),
}


@pytest.mark.parametrize("name", sorted(NESTED))
def test_every_budget_prepare_accepts_trains_bit_identically_on_nested_modules(name: str) -> None:
    build, batches, loss_fn = NESTED[name]
    model = build()
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(trainable(ref)), batches, loss_fn)
    least = smallest_accepted(model)
    assert least < param_bytes(model), "the smallest budget must make chunks move"
    for factor in (1.0, 1.5, 2.5):  # warm-up, then planned steps, at and above the least budget
        copied = copy.deepcopy(model)
        cm, opt = chunkmem.prepare(copied, ADAMW(trainable(copied)),
                                   chunkmem.Config(device="cpu", device_memory=int(least * factor)))
        assert train(cm, opt, batches, loss_fn) == expected, factor
        state = cm.state_dict()
        assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items()), factor
        assert cm.runtime.placer.follower is not None, "the steps after warm-up must follow a plan"
        stats = cm.memory_stats()
        assert stats["device_chunk_bytes_peak"] <= stats["device_limit_bytes"]


def test_a_budget_below_the_nested_working_set_is_refused_with_the_bytes_and_the_modules() -> None:
    model = lora_gpt2()
    size = 64 * 256  # elements: the MLP's base weight fills a chunk, its bias and the adapter take two more
    need = 3 * size * 4
    assert accepts(model, need, chunk_size=size)
    with pytest.raises(chunkmem.MemoryBudgetError, match=rf"module Conv1D \(transformer.h.0.mlp.c_fc.base inside "
                                                         rf"transformer.h.0.mlp.c_fc\) .*: 3 chunks of {size * 4} "
                                                         rf"bytes, {need} bytes, but Config.device_memory allows"):
        chunkmem.prepare(model, ADAMW(trainable(model)),
                         chunkmem.Config(device="cpu", device_memory=need - 1, chunk_size=size))
