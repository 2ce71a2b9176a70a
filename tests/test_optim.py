"""The prepared optimizer behaves as torch.optim's: whose gradients zero_grad clears, param groups added later."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import chunkmem
from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, train

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def outside_the_optimizer(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of modules 2 and 4 stay out of the optimizer: their gradients accumulate, step after step,
    and count in the clipping norm."""
    return [p for name, p in model.named_parameters() if name.split(".")[0] not in ("2", "4")]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_zero_grad_clears_only_its_parameters_as_pytorch_does(set_to_none: bool) -> None:
    model, batches = mlp(), mlp_batches(5)
    ref = copy.deepcopy(model)
    ref_opt = ADAMW(outside_the_optimizer(ref))
    cm, opt = chunkmem.prepare(model, ADAMW(outside_the_optimizer(model)),
                               chunkmem.Config(device="cpu", device_memory=param_bytes(model) // 2))
    for prepared, optimizer in ((ref, ref_opt), (cm, opt)):
        optimizer.zero_grad = functools.partial(optimizer.zero_grad, set_to_none=set_to_none)
    expected = train(ref, ref_opt, batches, mlp_loss, clip=0.5)
    assert train(cm, opt, batches, mlp_loss, clip=0.5) == expected
    state = cm.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    kept = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(kept) == {"2.weight", "2.bias", "4.weight", "4.bias"} | (
        set() if set_to_none else {n for n, _ in ref.named_parameters()})
    assert torch.equal(cm.clip_grad_norm_(1e9), torch.nn.utils.get_total_norm(list(kept.values())))


def test_model_zero_grad_clears_every_gradient() -> None:
    model, batches = mlp(), mlp_batches(4)
    ref = copy.deepcopy(model)
    ref_opt = ADAMW(outside_the_optimizer(ref))
    cm, opt = chunkmem.prepare(model, ADAMW(outside_the_optimizer(model)),
                               chunkmem.Config(device="cpu", device_memory=param_bytes(model) // 2))
    for prepared, optimizer in ((ref, ref_opt), (cm, opt)):
        optimizer.zero_grad = prepared.zero_grad
    assert train(cm, opt, batches, mlp_loss, clip=0.5) == train(ref, ref_opt, batches, mlp_loss, clip=0.5)
    assert cm.runtime.grad_views() == []


def test_fp16_gradients_kept_across_a_clipped_step_keep_their_scale() -> None:
    # Clipping unscales every gradient; those zero_grad keeps must carry the loss scale again, as the next
    # backward's will, or they would count 1/scale of their value from then on.
    model, batches = mlp(), mlp_batches(3)
    ref = copy.deepcopy(model)
    train(ref, ADAMW(outside_the_optimizer(ref)), batches, mlp_loss, clip=0.5)
    cm, opt = chunkmem.prepare(model, ADAMW(outside_the_optimizer(model)), chunkmem.Config(device="cpu", dtype="fp16"))
    cm.runtime.scaler.scale = 1024.0  # no overflow: every step is taken, as in fp32
    train(cm, opt, batches, mlp_loss, clip=0.5)
    kept = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
    assert cm.clip_grad_norm_(1e9).item() == pytest.approx(kept.item(), rel=0.02)
