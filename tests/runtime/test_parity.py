"""chunkmem against plain PyTorch on deep copies: losses, parameters, across budgets and optimizers."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch

import chunkmem
from chunkmem.memory.landing import idle_priority_available
from tests import zoo
from tests.helpers import (gpt2_batches, gpt2_loss, least_accepted, mlp, mlp_batches, mlp_loss, param_bytes, prepared,
                           tiny_gpt2, train)

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2, weight_decay=0.01),
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "nesterov": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True),
    "plain_sgd": functools.partial(torch.optim.SGD, lr=0.05),
}
BUDGETS = [None, 1.0, 0.5, 0.3]


def reference(model: torch.nn.Module, make_opt, batches, loss_fn, **kw) -> tuple[list[float], dict]:
    ref = copy.deepcopy(model)
    losses = train(ref, make_opt(ref.parameters()), batches, loss_fn, **kw)
    return losses, ref.state_dict()


def budget(model: torch.nn.Module, fraction: float | None) -> int | None:
    return None if fraction is None else int(param_bytes(model) * fraction)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mlp_fp32_is_bit_identical_to_pytorch_at_every_budget(name):
    # The optimizer runs torch.optim's own functional update on views, so fp32 matches exactly.
    model, make_opt, batches = mlp(), OPTIMIZERS[name], mlp_batches(5)
    ref_losses, ref_state = reference(model, make_opt, batches, mlp_loss)
    for fraction in BUDGETS:
        cm, opt = prepared(model, make_opt, device_memory=budget(model, fraction))
        assert train(cm, opt, batches, mlp_loss) == ref_losses, fraction
        state = cm.state_dict()
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), (fraction, key)
        stats = cm.memory_stats()
        assert stats["device_chunk_bytes_peak"] <= stats["device_limit_bytes"]


def test_gpt2_tied_embeddings_fp32_bit_identical_at_every_budget():
    model, make_opt, batches = tiny_gpt2(), OPTIMIZERS["adamw"], gpt2_batches(4)
    ref_losses, ref_state = reference(model, make_opt, batches, gpt2_loss)
    for fraction in [None, 0.5, 0.25]:
        cm, opt = prepared(model, make_opt, device_memory=budget(model, fraction))
        assert train(cm, opt, batches, gpt2_loss) == ref_losses, fraction
        state = cm.state_dict()
        assert state.keys() == ref_state.keys()
        assert state["lm_head.weight"] is state["transformer.wte.weight"]
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), (fraction, key)
        if fraction == 0.25:
            assert cm.memory_stats()["evictions"] > 0, "a quarter budget must force chunks off the device"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_loss_curve_tracks_fp32(dtype):
    model, make_opt, batches = tiny_gpt2(), functools.partial(torch.optim.AdamW, lr=3e-3), gpt2_batches(3) * 4
    fp32_losses, _ = reference(model, make_opt, batches, gpt2_loss)
    results = []
    for fraction in [None, 0.3]:
        cm, opt = prepared(model, make_opt, dtype=dtype, device_memory=budget(model, fraction))
        losses = train(cm, opt, batches, gpt2_loss)
        assert all(abs(a - b) / b < 0.02 for a, b in zip(losses, fp32_losses)), (losses, fp32_losses)
        assert losses[-1] < losses[0] - 0.3, "training must make progress"
        results.append((losses, cm.state_dict()))
    assert results[0][0] == results[1][0], "low precision must also be identical across budgets"


def test_lr_scheduler_drives_live_param_groups():
    model, make_opt, batches = mlp(), OPTIMIZERS["adamw"], mlp_batches(6)
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.1)
    ref = copy.deepcopy(model)
    ref_opt = make_opt(ref.parameters())
    ref_losses = train(ref, ref_opt, batches, mlp_loss, scheduler=sched(ref_opt))
    cm, opt = prepared(model, make_opt, device_memory=budget(model, 0.4))
    s = sched(opt)
    assert train(cm, opt, batches, mlp_loss, scheduler=s) == ref_losses
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1**3)


def test_gradient_accumulation_and_clipping_match_pytorch():
    model, make_opt, batches = mlp(), OPTIMIZERS["adam"], mlp_batches(6)
    ref_losses, ref_state = reference(model, make_opt, batches, mlp_loss, clip=0.05, accumulate=3)
    cm, opt = prepared(model, make_opt, device_memory=budget(model, 0.4))
    assert train(cm, opt, batches, mlp_loss, clip=0.05, accumulate=3) == ref_losses
    for key, value in ref_state.items():
        assert torch.equal(cm.state_dict()[key], value), key


def test_clip_grad_norm_returns_the_global_norm():
    model, batches = mlp(), mlp_batches(1)
    ref = copy.deepcopy(model)
    mlp_loss(ref, batches[0]).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    cm, _ = prepared(model, OPTIMIZERS["adamw"], device_memory=budget(model, 0.4))
    mlp_loss(cm, batches[0]).backward()
    assert torch.equal(cm.clip_grad_norm_(1e-3), expected)
    assert torch.equal(cm.clip_grad_norm_(1e9), torch.nn.utils.get_total_norm(
        [p.grad for p in ref.parameters()])), "the second call sees the clipped gradients"


class Awkward(torch.nn.Module):
    """A weight used outside its module, a module called twice, a branch without gradient, frozen weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, 32)
        self.block = torch.nn.Linear(32, 32)
        self.head_source = torch.nn.Linear(32, 32)  # never called: its weight is used by forward directly
        self.unused = torch.nn.Linear(32, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        h = torch.nn.functional.linear(h, self.head_source.weight)
        h = self.frozen(h)
        if use_branch:
            h = h + self.unused(h)
        return self.out(h)


def test_awkward_model_matches_pytorch_under_a_tight_budget():
    model, make_opt = Awkward(), OPTIMIZERS["adamw"]
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)]
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0], use_branch=False), b[1])  # noqa: E731
    ref_losses, ref_state = reference(model, make_opt, batches, loss_fn)
    cm, opt = prepared(model, make_opt, device_memory=budget(model, 0.35))
    assert train(cm, opt, batches, loss_fn) == ref_losses
    state = cm.state_dict()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    assert torch.equal(state["unused.weight"], model.unused.weight), "no gradient: untouched"
    assert torch.equal(state["frozen.weight"], model.frozen.weight), "frozen: untouched"
    store = cm.runtime.store
    frozen_record = store.records[cm.module.frozen.weight]
    assert not frozen_record.group.trainable and set(frozen_record.group.chunks) == {"param"}


def test_a_weight_read_in_another_modules_forward_beyond_the_budget_names_a_budget_that_trains():
    # Perceiver's decoder reads the word embeddings' weight beside its own bias: two chunks at once, which prepare
    # cannot see (helper-70: budgets up to twice the least it accepted raised in every step, advising smaller chunks)
    from transformers import PerceiverConfig, PerceiverForMaskedLM

    torch.manual_seed(0)
    model = PerceiverForMaskedLM(PerceiverConfig(
        vocab_size=128, d_model=32, d_latents=32, num_latents=8, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=2, num_cross_attention_heads=2, max_position_embeddings=8, qk_channels=32,
        v_channels=32, attention_probs_dropout_prob=0.0))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 128, (2, 8), generator=gen) for _ in range(3)]
    loss_fn = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    expected, _ = reference(model, OPTIMIZERS["adamw"], batches, loss_fn)
    cm, opt = prepared(model, OPTIMIZERS["adamw"], device_memory=int(1.3 * least_accepted(model, OPTIMIZERS["adamw"])))
    with pytest.raises(chunkmem.MemoryBudgetError, match="embeddings.weight, read outside its module inside "
                       "embedding_decoder") as refused:
        train(cm, opt, batches, loss_fn)
    named = re.search(r"raise Config.device_memory above (\d+) with Config.chunk_size=(\d+)", str(refused.value))
    cm, opt = prepared(model, OPTIMIZERS["adamw"], device_memory=int(named.group(1)) + 1,
                       chunk_size=int(named.group(2)))
    assert train(cm, opt, batches, loss_fn) == expected
    assert cm.memory_stats()["evictions"] > 0, "chunks moved"


@pytest.mark.parametrize("fraction", [None, 0.35])
def test_a_parameter_without_gradient_reads_zero_in_its_chunk_and_no_fp16_step_is_skipped(fraction):
    # Its part of the gradient chunk is never written, so never zeroed until read (chunk's Note on unwritten
    # ranges). The fp16 overflow scan reads whole chunks: anything but zeros there would skip every step.
    model, make_opt = Awkward(), OPTIMIZERS["adamw"]
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)]
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1])  # noqa: E731
    cm, opt = prepared(model, make_opt, dtype="fp16", device_memory=budget(model, fraction))
    for batch in batches:
        loss_fn(cm, batch).backward()
        record = cm.runtime.store.records[cm.module.unused.weight]
        chunk = record.group.chunks["grad"]
        # On the device the chunk lends its payload to the gradients autograd made (chunk's Note on lent ranges)
        # and has none to leave unwritten yet; this part is not lent. Streamed, the end of backward zeroed it (the
        # shown gradients view the host payload: grads.py).
        assert record.slot.offset not in chunk.lent
        assert torch.count_nonzero(record.view(cm.runtime.data.read(chunk))) == 0
        assert chunk.unwritten == [], "read once, zeroed once"
        opt.step()
        opt.zero_grad()
    assert cm.runtime.scaler.good_steps == len(batches), "no step overflowed"
    assert not torch.equal(cm.state_dict()["block.weight"], model.block.weight.half())


def test_gradients_of_groups_on_the_device_are_lent_not_copied_and_train_as_pytorch():
    # chunk's Note on lent ranges: autograd's gradient tensors stand in for the gradient chunks' payloads. A
    # second backward adds onto them, clipping scales them, and a chunk pushed out between backward and
    # step carries them to the host: each lands on plain PyTorch's bits.
    model, make_opt, batches = mlp(), OPTIMIZERS["adamw"], mlp_batches(6)
    ref_losses, ref_state = reference(model, make_opt, batches, mlp_loss, clip=0.5, accumulate=2)
    cm, opt = prepared(model, make_opt, chunk_size=2200)  # two layers a chunk
    chunks = [g.chunks["grad"] for g in cm.runtime.groups()]
    assert len(chunks) > 2
    losses = []
    for i, batch in enumerate(batches):
        loss = mlp_loss(cm, batch)
        loss.backward()
        losses.append(loss.item())
        assert all(c.lending and c.device_unfenced is None for c in chunks), "no gradient payload allocated"
        assert sum(len(c.lent) for c in chunks) == len(list(model.parameters()))
        if i % 2 == 0:
            continue
        if i == 3:
            cm.runtime.residency.evict(chunks[1])
            assert chunks[1].state.name == "HOST" and chunks[1].lent == {}
        cm.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    assert losses == ref_losses
    state = cm.state_dict()
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key


def test_nothing_moves_after_the_first_iteration_when_the_model_fits():
    model, make_opt, batches = tiny_gpt2(), OPTIMIZERS["adamw"], gpt2_batches(4)
    for dtype in ["fp32", "bf16"]:
        cm, opt = prepared(model, make_opt, dtype=dtype)
        train(cm, opt, batches[:1], gpt2_loss)
        before = cm.memory_stats()
        train(cm, opt, batches[1:], gpt2_loss)
        after = cm.memory_stats()
        assert (after["h2d_bytes"], after["d2h_bytes"]) == (before["h2d_bytes"], before["d2h_bytes"]), dtype
        # Everything but the gradients (freed by zero_grad, re-made on the device) stays resident.
        assert all(c.state.on_device for c in cm.runtime.store.chunks() if not c.name.startswith("grad"))


def test_model_data_bytes_counts_every_family():
    model = mlp()
    numel = sum(p.numel() for p in model.parameters())
    cm, _ = prepared(model, OPTIMIZERS["adamw"], dtype="bf16", chunk_size=4096)
    chunks = cm.memory_stats()["num_chunks"]
    # bf16 param + bf16 grad + fp32 master + two fp32 Adam states per element, in whole chunks.
    assert cm.memory_stats()["model_data_bytes"] == chunks // 5 * 4096 * (2 + 2 + 4 + 4 + 4)
    assert chunks // 5 * 4096 >= numel


@pytest.mark.parametrize("landing", ["random:1", "random:2", "background"])
def test_copies_landing_at_random_moments_change_nothing(monkeypatch, landing):
    # CUDA lands a copy at any moment after it is issued; the simulation lands each at a random later
    # device call here (in stream order), or on its copy thread as soon as a core is idle, instead of at
    # the latest moment it may.
    monkeypatch.setenv("CHUNKMEM_SIM_LANDING", landing)
    model, make_opt, batches = tiny_gpt2(), OPTIMIZERS["adamw"], gpt2_batches(4)
    ref_losses, ref_state = reference(model, make_opt, batches, gpt2_loss, accumulate=2)
    threads = []
    for fraction in [0.5, 0.25]:
        cm, opt = prepared(model, make_opt, device_memory=budget(model, fraction))
        device = cm.runtime.device
        assert device._random is not None or device._background or not idle_priority_available()
        assert train(cm, opt, batches, gpt2_loss, accumulate=2) == ref_losses, fraction
        threads += [device._copy_thread] if device._copy_thread is not None else []
        state = cm.state_dict()
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), (fraction, key)
    # Over both runs: an idle-priority thread may find no idle core through one of them on a loaded machine.
    assert not threads or sum(t.landed for t in threads) > 0, "copies landed beside compute"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_batch_norm_trains_in_low_precision_with_fp32_running_statistics(dtype):
    # Buffers keep their precision: BatchNorm normalises a low-precision input against fp32 statistics.
    arch = zoo.by_name("resnet")
    model, make_opt, batches = arch.build(), functools.partial(torch.optim.AdamW, lr=3e-3), arch.batches(3) * 3
    fp32_losses, fp32_state = reference(model, make_opt, batches, zoo.loss)
    cm, opt = prepared(model, make_opt, dtype=dtype, device_memory=budget(model, 0.5))
    losses = train(cm, opt, batches, zoo.loss)
    assert losses[-1] < losses[0] - 0.5, "training must make progress"
    if dtype == "bf16":  # fp16 skips its first step (the loss scale starts too high), so it lags fp32 by one
        assert all(abs(a - b) <= 0.03 * b + 0.02 for a, b in zip(losses, fp32_losses)), (losses, fp32_losses)
    state = cm.state_dict()
    for name, buffer in cm.module.named_buffers():
        assert buffer.dtype == model.get_buffer(name).dtype == state[name].dtype, name
        if buffer.is_floating_point():  # updated, and in bf16 near fp32's (the weights they follow differ a little)
            assert not torch.equal(state[name], model.get_buffer(name)), name
            assert dtype == "fp16" or (state[name] - fp32_state[name]).norm() <= 0.15 * fp32_state[name].norm() + 0.05
    cm.eval()
    with torch.no_grad():
        assert cm(batches[0]["pixel_values"]).logits.dtype == cm.runtime.config.torch_dtype


def test_a_bf16_model_trains_in_fp32_like_pytorch_after_float():
    # Buffers below the compute dtype are raised to it, as model.float() does, and never lowered.
    arch = zoo.by_name("resnet")
    model, make_opt, batches = arch.build().to(torch.bfloat16), OPTIMIZERS["adamw"], arch.batches(3)
    ref_losses, ref_state = reference(copy.deepcopy(model).float(), make_opt, batches, zoo.loss)
    cm, opt = prepared(model, make_opt, device_memory=budget(model, 1.0))
    assert train(cm, opt, batches, zoo.loss) == ref_losses
    state = cm.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())


class CheckpointedBatchNorm(torch.nn.Module):
    """A convolution and BatchNorm re-computed in backward (activation checkpointing), outside forward's hooks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm, self.head = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.norm(self.conv(t))), x, use_reentrant=False)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_batch_norm_recomputed_in_backward_trains(dtype):
    model, make_opt = CheckpointedBatchNorm(), OPTIMIZERS["adamw"]
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(3)] * 2
    ref_losses, ref_state = reference(model, make_opt, batches, mlp_loss)
    cm, opt = prepared(model, make_opt, dtype=dtype, device_memory=least_accepted(model, make_opt, dtype=dtype))
    losses = train(cm, opt, batches, mlp_loss)
    if dtype == "fp32":
        assert losses == ref_losses and all(torch.equal(cm.state_dict()[k], v) for k, v in ref_state.items())
    else:
        assert all(abs(a - b) <= 0.03 * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)
