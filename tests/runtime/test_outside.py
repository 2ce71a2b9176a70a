"""Parameters read outside `forward`: an EMA after `step()`, a log line between forward and backward. Every read
of chunk bytes waits for the copies that write them (SPEC section 3), here as inside the hooks."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, prepared

adamw = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_parameters_read_between_forward_and_backward_and_after_step_hold_plain_pytorchs_values(fraction):
    model, batches = mlp(depth=8), mlp_batches(4)
    plain = copy.deepcopy(model)
    plain_opt = adamw(plain.parameters())
    cm, opt = prepared(model, adamw, device_memory=int(param_bytes(model) * fraction))
    for batch in batches:
        losses = []
        for net, optimizer in ((plain, plain_opt), (cm.module, opt)):
            loss = mlp_loss(cm if net is cm.module else net, batch)
            between = _values(net)  # a log line (or a penalty's read) between forward and backward
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append((loss.item(), between, _values(net)))  # an EMA's read after step()
        (plain_loss, plain_between, plain_after), (loss, between, after) = losses
        assert loss == plain_loss
        for name, value in plain_between.items():
            assert torch.equal(between[name], value), f"between forward and backward: {name}"
            assert torch.equal(after[name], plain_after[name]), f"after step(): {name}"
    assert cm.memory_stats()["h2d_bytes"] > 0
