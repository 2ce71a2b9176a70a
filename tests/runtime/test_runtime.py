"""The runtime's promises: a budget prepare accepts trains at every step and one it cannot is refused; every
reader of a payload waits for the copy that fills it, gradients stream to the host without stopping
backward, a wait taken out of the runtime fails a test, and the device budget reaches the device layer."""

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
from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.family import Families
from chunkmem.chunks.residency import Residency
from chunkmem.chunks.state import ChunkState
from chunkmem.chunks.store import planned_model_data_bytes
from chunkmem.finetune.lora import apply_lora
from chunkmem.memory.sim import HazardError, SimulatedDevice
from chunkmem.runtime.activations import ActivationMeter
from chunkmem.runtime.grads import ShownGrads
from chunkmem.runtime.rules import rule_for
from chunkmem.runtime.runtime import LAZY_ROOM, Runtime
from tests import zoo
from tests.helpers import (accepts, gpt2_batches, gpt2_loss, least_accepted, mlp, mlp_batches, mlp_loss, param_bytes,
                           prepared, tiny_gpt2, train)

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
    config = chunkmem.Config(device="cpu", dtype=dtype)
    families = Families.declare(config.torch_dtype, rule_for(make(trainable(model))).states)
    cm, _ = chunkmem.prepare(model, make(trainable(model)), config)
    planned = planned_model_data_bytes(model, cm.runtime.store.chunk_size, families)
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


adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_reads_right_after_a_step_wait_for_the_uploads_already_on_their_way(tmp_path, monkeypatch):
    # After a step the host-updated parameter chunks are sent up for the next one at once; state_dict,
    # fp32_value and save_checkpoint read them right away. In the simulation an upload lands only when
    # waited for (NaN until then) and the checker raises on a read before. step() ends with compute waiting for
    # them (Runtime.fence_params); without that, each of these readers must still wait on its own.
    monkeypatch.setattr(Runtime, "fence_params", lambda self: None)
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    ref_opt = adamw(ref.parameters())
    cm, opt = prepared(model, adamw, device_memory=param_bytes(model) * 2)  # room to send chunks up for the next step
    for i, batch in enumerate(gpt2_batches(3)):
        step(ref, ref_opt, gpt2_loss(ref, batch))
        step(cm, opt, gpt2_loss(cm, batch))
        in_flight = any(c.pending is not None for c in cm.runtime.store.chunks())
        assert in_flight == (i > 0), "after warm-up, uploads must be in flight here"
        state = cm.state_dict()
        for key, value in ref.state_dict().items():
            assert torch.equal(state[key], value), key
    step(ref, ref_opt, gpt2_loss(ref, gpt2_batches(1, seed=9)[0]))
    step(cm, opt, gpt2_loss(cm, gpt2_batches(1, seed=9)[0]))
    record = next(r for r in cm.runtime.store.records.values() if r.group.param.pending is not None)
    assert torch.equal(cm.runtime.data.fp32_value(record), dict(ref.named_parameters())[record.name].detach())
    chunkmem.save_checkpoint(tmp_path / "ckpt", cm, opt)
    again, again_opt = prepared(tiny_gpt2(seed=5), adamw)
    chunkmem.load_checkpoint(tmp_path / "ckpt", again, again_opt)
    for key, value in ref.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("accumulate", [1, 2])
def test_streamed_gradients_are_copied_asynchronously_and_land_before_the_optimizer_reads_them(
        monkeypatch, accumulate):
    # Below the model data no group is homed, so every gradient goes to the host: each one is a download
    # that backward does not wait for (a second backward adds through a staging buffer).
    model, batches = mlp(), mlp_batches(3 * accumulate)
    ref = copy.deepcopy(model)
    ref_opt = adamw(ref.parameters())
    cm, opt = prepared(model, adamw, device_memory=int(param_bytes(model) * 0.3))
    downloads, landing = [], []
    original = SimulatedDevice.download
    monkeypatch.setattr(SimulatedDevice, "download",
                        lambda self, device, host, label="": downloads.append(label) or original(self, device, host, label))
    show = ShownGrads.show  # when backward ends, the host waits for them to show `p.grad` (grads.py's Note)
    monkeypatch.setattr(ShownGrads, "show", lambda self: landing.append(
        all(g.chunks["grad"].landings for g in cm.runtime.groups())) or show(self))
    for i, batch in enumerate(batches):
        mlp_loss(ref, batch).backward()
        mlp_loss(cm, batch).backward()
        assert not cm.runtime.placer.homes and landing.pop(), "every gradient still landing as backward ends"
        if (i + 1) % accumulate == 0:
            ref_opt.step(), ref_opt.zero_grad()
            opt.step(), opt.zero_grad()
    assert downloads.count("grad.0") >= 2 * len(batches), "one download per parameter, as backward writes it"
    state = cm.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(state[key], value), key


def _unfenced_device(self: Chunk) -> torch.Tensor | None:
    return self._device


def _unfenced_host(self: Chunk) -> torch.Tensor:
    return self._host


def _prefetch_everything(self: Residency, chunk: Chunk, reason: str = "on-demand") -> None:
    _bring(self, chunk, "prefetch")


_bring = Residency.bring


@pytest.mark.parametrize("target,name,replacement", [
    (Chunk, "fence", _unfenced_device),  # compute skips the upload's wait
    (Chunk, "device", property(_unfenced_device)),  # readers of a device payload skip the upload's wait
    (Chunk, "host", property(_unfenced_host)),  # readers of a host payload skip the downloads' waits
    (Residency, "bring", _prefetch_everything),  # the residency hands out every upload unwaited
], ids=["Chunk.fence", "Chunk.device", "Chunk.host", "Residency.bring"])
def test_a_wait_taken_out_of_the_runtime_fails(monkeypatch, target, name, replacement):
    model, batches = tiny_gpt2(), gpt2_batches(3)
    cm, opt = prepared(model, adamw, device_memory=param_bytes(model) * 2)
    monkeypatch.setattr(target, name, replacement)
    # The waits at a step's edges hide the rest: uploads fenced as forward, backward and step() end; gradients
    # waited for as backward ends, to be shown in p.grad.
    monkeypatch.setattr(Runtime, "fence_params", lambda self: None)
    monkeypatch.setattr(ShownGrads, "show", lambda self: None)
    with pytest.raises(HazardError, match="chunkmem simulation"):
        for batch in batches:
            step(cm, opt, gpt2_loss(cm, batch))
        cm.state_dict()


def test_the_device_budget_reaches_the_device_layer():
    # On CUDA the runtime caps the caching allocator here (gpu_memory's Note on the budget); the simulated
    # device records what it was told (and caps its allocator model, when it has one: tests/test_budgets.py).
    model = mlp()
    cm, _ = prepared(model, adamw, device_memory=param_bytes(model))
    assert cm.runtime.device.memory_limit == param_bytes(model)
    unlimited, _ = prepared(model, adamw)
    assert unlimited.runtime.device.memory_limit is None


def test_what_the_process_holds_outside_the_allocator_is_read_again_after_each_step():
    # cuBLAS handles, NCCL buffers and lazily loaded kernels appear after prepare read NVML, in the first step and
    # in the first steps under the plan (the H200 held 54 MB more after the warm-up): the cap counts them.
    class Outside:  # gpu_memory.DeviceMemory as a CUDA run would have it
        def __init__(self) -> None:
            self.bytes, self.fresh = 0, []

        def outside_allocator(self, fresh: bool = False) -> int:
            self.fresh.append(fresh)
            return self.bytes

    model, batches = mlp(), mlp_batches(3)
    budget = param_bytes(model) * 4
    cm, opt = prepared(model, adamw, device_memory=budget)
    cm.runtime.gpu_memory = outside = Outside()
    room = int((budget - 1000) * LAZY_ROOM)  # what may still load lazily, counted ahead (Runtime.outside)
    outside.bytes = 1000
    train(cm, opt, batches[:1], mlp_loss)
    assert cm.runtime.device.memory_limit == budget - 1000 - room and outside.fresh[-1], "read afresh after a step"
    for grown in (1000 + room // 2, 1000 + 2 * room):
        outside.bytes = grown
        train(cm, opt, batches[1:2], mlp_loss)
        assert not outside.fresh[-1], "then as NVML is read"
        assert cm.runtime.device.memory_limit == budget - max(grown, 1000 + room), "more than the room: as read"


def test_a_zeroed_gradient_chunk_with_copies_landing_reads_as_zeros():
    # zero_grad right after backward, before anything waited: the chunk forgets its payloads.
    model = mlp()
    cm, opt = prepared(model, adamw, device_memory=int(param_bytes(model) * 0.3))
    mlp_loss(cm, mlp_batches(1)[0]).backward()
    opt.zero_grad()
    grads = [g.chunks["grad"] for g in cm.runtime.groups()]
    assert all(c.state is ChunkState.FREE for c in grads)
    assert all(torch.count_nonzero(c.payload()) == 0 for c in grads)


def plain_activation_peak(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the tensors plain PyTorch saves for backward at their peak (weights excluded)."""
    meter = ActivationMeter()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> object:
        return tensor if tensor.untyped_storage().data_ptr() in weights else meter.wrap(tensor)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved if isinstance(saved, torch.Tensor)
                                                  else saved.get(meter)):
        gpt2_loss(model, batch).backward()
    return meter.peak


def test_device_peak_is_chunks_plus_activations_at_the_same_moment() -> None:
    base, batches = tiny_gpt2(), gpt2_batches(3)
    model, opt = prepared(base, functools.partial(torch.optim.AdamW, lr=1e-3))  # everything fits: all resident
    train(model, opt, batches, gpt2_loss)
    stats = model.memory_stats()
    activations = plain_activation_peak(copy.deepcopy(base), batches[0])
    assert stats["device_chunk_bytes_peak"] == stats["model_data_bytes"]
    assert stats["device_bytes_peak"] == stats["model_data_bytes"] + activations


def test_device_peak_under_a_tight_budget_stays_within_it() -> None:
    base, batches = tiny_gpt2(), gpt2_batches(3)
    activations = plain_activation_peak(copy.deepcopy(base), batches[0])
    budget = activations + param_bytes(base) // 2
    model, opt = prepared(base, functools.partial(torch.optim.AdamW, lr=1e-3), device_memory=budget)
    train(model, opt, batches, gpt2_loss)
    stats = model.memory_stats()
    assert stats["h2d_bytes"] > 0  # chunks moved
    assert max(stats["device_chunk_bytes_peak"], activations) < stats["device_bytes_peak"] <= budget
    assert stats["device_bytes_peak"] < stats["device_chunk_bytes_peak"] + activations  # not two peaks added
