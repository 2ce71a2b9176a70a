"""The runtime where copies are asynchronous, against plain PyTorch: every reader of a payload waits for
the copy that fills it, gradients stream to the host without stopping backward, a wait taken out of
the runtime fails a test, and the device budget reaches the device layer."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import chunkmem
from chunkmem.chunk import Chunk
from chunkmem.residency import Residency
from chunkmem.sim import HazardError, SimulatedDevice
from chunkmem.state import ChunkState
from tests.helpers import gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss, param_bytes, prepared, tiny_gpt2

adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_reads_right_after_a_step_wait_for_the_uploads_already_on_their_way(tmp_path):
    # After a step the host-updated parameter chunks are sent up for the next one at once; state_dict,
    # fp32_value and save_checkpoint read them right away. In the simulation an upload lands only when
    # waited for (NaN until then) and the checker raises on a read before.
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    ref_opt = adamw(ref.parameters())
    cm, opt = prepared(model, adamw, device_memory=param_bytes(model) // 2)
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
    assert torch.equal(cm.runtime.fp32_value(record), dict(ref.named_parameters())[record.name].detach())
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
    downloads = []
    original = SimulatedDevice.download
    monkeypatch.setattr(SimulatedDevice, "download",
                        lambda self, device, host, label="": downloads.append(label) or original(self, device, host, label))
    for i, batch in enumerate(batches):
        mlp_loss(ref, batch).backward()
        mlp_loss(cm, batch).backward()
        grads = [g.chunks["grad"] for g in cm.runtime.groups()]
        assert not cm.runtime.placer.homes and all(c.landings for c in grads), "every gradient still landing"
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


def _prefetch_everything(self: Residency, chunk: Chunk, reason: str = "on-demand") -> torch.Tensor:
    return _to_device(self, chunk, "prefetch")


_to_device = Residency.to_device


@pytest.mark.parametrize("target,name,replacement", [
    (Chunk, "device", property(_unfenced_device)),  # readers of a device payload skip the upload's wait
    (Chunk, "host", property(_unfenced_host)),  # readers of a host payload skip the downloads' waits
    (Residency, "to_device", _prefetch_everything),  # the residency hands out every upload unwaited
], ids=["Chunk.device", "Chunk.host", "Residency.to_device"])
def test_a_wait_taken_out_of_the_runtime_fails(monkeypatch, target, name, replacement):
    model, batches = tiny_gpt2(), gpt2_batches(3)
    cm, opt = prepared(model, adamw, device_memory=param_bytes(model) // 3)
    monkeypatch.setattr(target, name, replacement)
    with pytest.raises(HazardError, match="chunkmem simulation"):
        for batch in batches:
            step(cm, opt, gpt2_loss(cm, batch))
        cm.state_dict()


def test_the_device_budget_reaches_the_device_layer():
    # On CUDA the runtime caps the caching allocator here (gpu_memory's Note on the budget); the simulated
    # device, having no allocator, records what it was told.
    model = mlp()
    cm, _ = prepared(model, adamw, device_memory=param_bytes(model))
    assert cm.runtime.device.memory_limit == param_bytes(model)
    unlimited, _ = prepared(model, adamw)
    assert unlimited.runtime.device.memory_limit is None


def test_a_zeroed_gradient_chunk_with_copies_landing_reads_as_zeros():
    # zero_grad right after backward, before anything waited: the chunk forgets its payloads.
    model = mlp()
    cm, opt = prepared(model, adamw, device_memory=int(param_bytes(model) * 0.3))
    mlp_loss(cm, mlp_batches(1)[0]).backward()
    opt.zero_grad()
    grads = [g.chunks["grad"] for g in cm.runtime.groups()]
    assert all(c.state is ChunkState.FREE for c in grads)
    assert all(torch.count_nonzero(c.payload()) == 0 for c in grads)
