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


def test_a_device_op_on_a_parameter_whose_chunk_is_off_the_device_fails_as_on_a_gpu(sim_memory):
    """Issue 34: such a parameter is a host tensor. On a GPU an op that mixes it with device tensors fails; the
    simulation must fail too, not compute. Ops on it alone, copies to the device and 0-dim host scalars pass."""
    memory = sim_memory(1024)  # segments of 2 and 20 KiB for chunks of 5 KiB, and two 20 KiB ones of room a step
    model, batches = mlp(depth=8), mlp_batches(2)
    cm, opt = prepared(model, adamw, device_memory=int(param_bytes(model) * 0.3) + 2**17)
    for batch in batches:
        mlp_loss(cm, batch).backward()
        opt.step()
        opt.zero_grad()
    weights = [p for name, p in cm.module.named_parameters() if name.endswith("weight") and p.shape == (32, 32)]
    host = [p for p in weights if not memory.on_device(p)]
    device = [p for p in weights if memory.on_device(p)]
    assert host and device, "the budget leaves some chunks off the device and some on it"
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):
        device[0] + host[0]
    # A foreach op over both at one index (timm's EMA: helper-71): torch falls back to per-tensor ops, which fail.
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device"):
        torch._foreach_lerp_([device[0]], [host[0]], 0.1)
    with torch.no_grad():
        torch._foreach_mul([device[0], host[0]], 2.0)  # at different indices: grouped by device
        torch._foreach_copy_([device[0].clone()], [host[0]])  # a copy crosses devices
        assert torch.equal(host[0] * 2, host[0] + host[0])  # the host's own op
        uploaded = host[0].to("cpu", copy=True)
        assert torch.equal(device[0] + host[0].sum(), device[0] + host[0].sum().item())  # a 0-dim host scalar
    assert torch.equal(uploaded, host[0])


def test_a_module_run_on_its_own_and_interrupted_leaves_nothing_entered_after_the_next_forward() -> None:
    # torch runs no always_call forward hook after a KeyboardInterrupt (Ctrl-C in a notebook), so what a module run on
    # its own had entered stayed: chunkmem's torch-function mode, and `p.data` as PyTorch's (a change through it then
    # lost where the chunk is on the device), and no module run on its own entered again.
    from chunkmem.chunks import store

    cm, opt = prepared(mlp(), functools.partial(torch.optim.SGD, lr=0.1), dtype="bf16")
    batches = mlp_batches(3)
    mlp_loss(cm, batches[0]).backward()
    opt.step()
    layer = cm.module[2]

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    handle = layer.register_forward_pre_hook(interrupt)  # after ours, which entered
    with pytest.raises(KeyboardInterrupt):
        layer(torch.randn(2, 32, dtype=torch.bfloat16))
    handle.remove()
    mlp_loss(cm, batches[1]).backward()
    assert store._forwards == 0 and not torch._C._is_torch_function_mode_enabled()
    with torch.no_grad():
        layer.weight.data.fill_(0.5)  # outside a forward: seen, as a change through the parameter
    assert torch.all(cm.state_dict()["2.weight"] == 0.5)
