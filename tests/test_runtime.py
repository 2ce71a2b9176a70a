"""The runtime's promises at prepare: a budget it accepts trains at every step; one it cannot is refused."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import psutil
import pytest
import torch
from torch import nn

import chunkmem
from chunkmem.lora import apply_lora
from chunkmem.optim import rule_for
from chunkmem.store import planned_model_data_bytes
from tests import zoo
from tests.helpers import accepts, gpt2_batches, gpt2_loss, least_accepted, param_bytes, tiny_gpt2, train

transformers = pytest.importorskip("transformers")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def lora_gpt2() -> nn.Module:
    model = tiny_gpt2(layers=2)
    apply_lora(model, rank=4)  # each adapter owns parameters and calls its frozen base, in other chunks
    return model


VIT = dataclasses.replace(zoo.by_name("vit"), kwargs=zoo.by_name("vit").kwargs | {"image_size": 32})
NESTED: dict[str, tuple[Callable[[], nn.Module], list, Callable]] = {
    # ViT's embeddings own the CLS and position parameters and call the patch projection (in another chunk
    # at 32 x 32 pixels); ConvNeXt's layers own the layer scale and call their convolutions.
    "vit": (VIT.build, VIT.batches(5), zoo.loss),
    "convnext": (zoo.by_name("convnext").build, zoo.by_name("convnext").batches(5), zoo.loss),
    "lora": (lora_gpt2, gpt2_batches(5), gpt2_loss),
}


@pytest.mark.parametrize("name", sorted(NESTED))
def test_every_budget_prepare_accepts_trains_bit_identically_on_nested_modules(name: str) -> None:
    build, batches, loss_fn = NESTED[name]
    model = build()
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(trainable(ref)), batches, loss_fn)
    least = least_accepted(model, ADAMW)
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
    assert accepts(model, ADAMW, need, chunk_size=size)
    with pytest.raises(chunkmem.MemoryBudgetError, match=rf"module Conv1D \(transformer.h.0.mlp.c_fc.base inside "
                                                         rf"transformer.h.0.mlp.c_fc\) .*: 3 chunks of {size * 4} "
                                                         rf"bytes, {need} bytes, but Config.device_memory allows"):
        chunkmem.prepare(model, ADAMW(trainable(model)),
                         chunkmem.Config(device="cpu", device_memory=need - 1, chunk_size=size))


def test_device_memory_beyond_the_device_names_the_field_and_the_limit() -> None:
    model, total = tiny_gpt2(layers=1), psutil.virtual_memory().total
    with pytest.raises(ValueError, match=rf"Config.device_memory={total + 1} bytes \(.* GiB\) is more than the device "
                                         rf"has: the CPU simulation's device \(this machine's RAM\) has {total} bytes"):
        chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", device_memory=total + 1))


def test_an_absurd_chunk_size_names_the_field_and_the_limit_before_allocating() -> None:
    model = tiny_gpt2(layers=1)
    with pytest.raises(chunkmem.MemoryBudgetError,
                       match=r"Config.chunk_size=1000000000000 elements makes chunks of 4000000000000 bytes .* "
                             r"more than the device budget holds: \d+ bytes \(Config.device_memory=None: what is free "
                             r"on the device\): lower chunk_size \(the largest parameter has 16384 elements\)"):
        chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", chunk_size=10**12))


def test_model_data_beyond_the_free_host_memory_is_refused_before_allocating(monkeypatch) -> None:
    model = tiny_gpt2(layers=1)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2**20))
    with pytest.raises(chunkmem.MemoryBudgetError, match=r"model data needs \d+ bytes \(.*\) of host memory in chunks "
                                                         r"of 16384 elements, this machine has 1048576 \(0.00 GiB\) "
                                                         r"available: use a lower-precision dtype, shard it over more "
                                                         r"ranks, or lower Config.chunk_size"):
        chunkmem.prepare(model, ADAMW(model.parameters()),
                         chunkmem.Config(device="cpu", device_memory=2**30, chunk_size=16384))


@pytest.mark.parametrize("dtype,make", [("fp32", ADAMW), ("bf16", ADAMW),
                                        ("fp16", functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)),
                                        ("bf16", functools.partial(torch.optim.SGD, lr=0.1))])
def test_the_host_check_counts_exactly_the_model_data_prepare_allocates(dtype, make) -> None:
    model = lora_gpt2()
    states = len(rule_for(make(trainable(model))).states)
    cm, _ = chunkmem.prepare(model, make(trainable(model)), chunkmem.Config(device="cpu", dtype=dtype))
    planned = planned_model_data_bytes(model, cm.runtime.store.chunk_size, cm.runtime.config.torch_dtype, states)
    assert planned == cm.memory_stats()["model_data_bytes"] > 0


def test_host_memory_beyond_the_machine_names_the_field_and_the_limit() -> None:
    model, ram = tiny_gpt2(layers=1), psutil.virtual_memory().total
    with pytest.raises(ValueError, match=rf"Config.host_memory={ram + 1} bytes \(.* GiB\) is more than this machine's "
                                         rf"RAM, {ram} bytes"):
        chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", host_memory=ram + 1))


def test_a_device_index_beyond_the_machine_names_the_field_and_the_devices(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"Config.device='cuda:2' but this machine has 2 CUDA device\(s\), cuda:0 to "
                                         r"cuda:1"):
        chunkmem.Config(device="cuda:2")
    assert chunkmem.Config(device="cuda:1").device == "cuda:1"
