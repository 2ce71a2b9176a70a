"""`p.grad` on a prepared model is the parameter's gradient, as on the plain model (runtime/grads.py): PyTorch's own
tools (torch.nn.utils' clipping and norms), reads and in-place changes, replacements, at every budget."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from chunkmem.chunks.planning import step_cost
from tests.helpers import gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss, param_bytes, prepared, tiny_gpt2

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
BUDGETS = [None, 1.0, 0.5, 0.3]


def budget(model: nn.Module, fraction: float | None) -> int | None:
    return None if fraction is None else int(param_bytes(model) * fraction)


def twins(model: nn.Module, fraction: float | None) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """Plain PyTorch and chunkmem, each with its optimizer: the same loop runs both."""
    plain = copy.deepcopy(model)
    return [(plain, ADAMW(plain.parameters())), prepared(model, ADAMW, device_memory=budget(model, fraction))]


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fraction", BUDGETS)
def test_pytorchs_clipping_and_norms_read_the_gradients_of_a_prepared_model(fraction):
    model, batches = tiny_gpt2(), gpt2_batches(4)
    pair = twins(model, fraction)
    (plain, _), (cm, _) = pair
    for batch in batches:
        results = []
        for net, optimizer in pair:
            gpt2_loss(net, batch).backward()
            seen = grads(net.module if net is cm else net)
            params = list(net.parameters())
            total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            clipped = torch.nn.utils.clip_grad_norm_(params, 0.5)
            torch.nn.utils.clip_grad_value_(params, 1e-3)
            optimizer.step()
            optimizer.zero_grad()
            results.append((seen, total, clipped))
        (plain_seen, plain_total, plain_clipped), (seen, total, clipped) = results
        assert torch.equal(total, plain_total) and torch.equal(clipped, plain_clipped) and total > 0
        for name, grad in plain_seen.items():
            assert grad is not None and torch.equal(seen[name], grad), name
    assert all(p.grad is None for p in cm.parameters()), "zero_grad clears them"
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("fraction", [None, 0.3])
def test_a_gradient_scaled_in_place_replaced_or_dropped_is_what_the_step_uses(fraction):
    model, batches = mlp(), mlp_batches(3)
    pair = twins(model, fraction)
    (plain, _), (cm, _) = pair
    for batch in batches:
        for net, optimizer in pair:
            mlp_loss(net, batch).backward()
            params = dict((net.module if net is cm else net).named_parameters())
            params["0.weight"].grad.mul_(0.5)  # in place: the chunk's range
            params["2.weight"].grad = params["2.weight"].grad * 3.0  # replaced: taken at the step
            params["4.bias"].grad = None  # dropped: this parameter does not step, as in torch.optim
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("fraction", [None, 0.3])
def test_accumulated_gradients_show_the_sum_and_count_once(fraction):
    model, batches = mlp(), mlp_batches(4)
    pair = twins(model, fraction)
    (plain, _), (cm, _) = pair
    for first, second in zip(batches[::2], batches[1::2]):
        seen = []
        for net, optimizer in pair:
            mlp_loss(net, first).backward()
            mlp_loss(net, second).backward()
            seen.append(grads(net.module if net is cm else net))
            optimizer.step()
            optimizer.zero_grad()
        assert all(torch.equal(seen[1][k], v) for k, v in seen[0].items())
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_a_second_backward_of_one_forward_adds_into_the_shown_gradient_once():
    model = mlp()
    plain = copy.deepcopy(model)
    cm, _ = prepared(model, ADAMW, device_memory=budget(model, 0.3))
    batch = mlp_batches(1)[0]
    for net in (plain, cm):
        out = net(batch[0]).float()
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
    expected = grads(plain)
    assert all(torch.equal(grads(cm.module)[k], v) for k, v in expected.items())


@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_accumulation_moves_what_the_plan_says_and_sees_parameters_changed_between_passes(fraction):
    """Between two backward passes a streamed group's parameters view the host beside their gradient, but their
    chunk's device copy stays (grads' Note): a steady accumulating step moves the bytes its plan predicts (it
    uploaded every streamed chunk again before), and a parameter changed in place between the passes is what
    the next pass uses, as in PyTorch."""
    model, batches = mlp(), mlp_batches(10)
    plain = copy.deepcopy(model)  # a group a layer, the budget a fraction of param, gradient and AdamW's states
    pair = [(plain, ADAMW(plain.parameters())),
            prepared(model, ADAMW, device_memory=int(4 * param_bytes(model) * fraction), chunk_size=32 * 33)]
    cm = pair[1][0]
    for step, (first, second) in enumerate(zip(batches[::2], batches[1::2])):
        before = cm.memory_stats()
        for net, optimizer in pair:
            mlp_loss(net, first).backward()
            params = dict((net.module if net is cm else net).named_parameters())
            assert all(p.grad is not None and p.grad.device == p.device for p in params.values())
            if step == 4:
                with torch.no_grad():
                    params["0.weight"].mul_(0.5)
            mlp_loss(net, second).backward()
            optimizer.step()
            optimizer.zero_grad()
        if step == 3:  # steady: planned two steps before
            after, placer = cm.memory_stats(), cm.runtime.placer
            moved = sum(after[k] - before[k] for k in ("h2d_bytes", "d2h_bytes"))
            assert placer.homes != {g.index for g in placer.groups}, "some group streams"
            assert moved == step_cost(placer.follower.step, placer.by_index, placer.sizes, passes=2)
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("fraction", [None, 0.5])
def test_after_a_backward_that_raised_the_next_backward_shows_its_gradients(fraction):
    """A backward that raises never reaches its end, where the gradients are shown: the next one must still reach
    its own (it did not: every later `p.grad` stayed None, so clipping clipped nothing)."""
    def fail(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: 1 / 0)  # late in backward: the embedding's output

    model, batches = tiny_gpt2(), gpt2_batches(3)
    shown = []
    for net, opt in twins(model, fraction):
        core = getattr(net, "module", net)
        handle = core.transformer.wte.register_forward_hook(fail)
        with pytest.raises(ZeroDivisionError):
            gpt2_loss(net, batches[0]).backward()
        handle.remove()
        opt.zero_grad()
        gpt2_loss(net, batches[1]).backward()
        shown.append(grads(core))
    expected, got = shown
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad is not None and got[name] is not None and torch.equal(got[name], grad), name


@pytest.mark.parametrize("share", [0.5, 0.3])
def test_a_second_backward_of_a_retained_graph_adds_into_streamed_groups_gradients_shown_on_the_host(share, sim_memory):
    """GPT-2 whose groups stream, with CUDA's allocator modelled (two 2 MiB segments for activations, `share` of the
    model data for chunks): after the first backward, a streamed group's `p.grad` is shown on the host, with its
    parameters. A second backward of the retained graph, no forward between, hides them first (a pre-hook on the
    outputs' grad_fn): before, autograd added a gradient made on the device into the host one, which the simulated
    memory refuses as CUDA does. The gradients and the steps are plain PyTorch's."""
    sim_memory(1)
    model, tokens = tiny_gpt2(), gpt2_batches(2)
    plain = copy.deepcopy(model)
    twins = [(plain, ADAMW(plain.parameters())),
             prepared(model, ADAMW, device_memory=(4 << 20) + int(share * 4 * param_bytes(model)))]
    runs = []
    for net, optimizer in twins:
        for batch in tokens:
            loss = gpt2_loss(net, batch)
            loss.backward(retain_graph=True)
            (2 * loss).backward()
            runs.append(grads(getattr(net, "module", net)))
            optimizer.step()
            optimizer.zero_grad()
    assert twins[1][0].memory_stats()["h2d_bytes"] > 0, "groups stream"
    assert all(torch.equal(c[k], v) for p, c in zip(runs[:2], runs[2:]) for k, v in p.items())


class _Branchy(nn.Module):
    """Two layers and a head; `use_b` False skips the second layer (a branch not taken, an expert not routed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.head(torch.tanh(self.b(h)) if self.use_b else h)


@pytest.mark.parametrize("chunk_size", [None, 32 * 32 + 32])  # one chunk, or one per layer (b's alone in its own)
@pytest.mark.parametrize("fraction", [None, 0.5])
def test_a_parameter_without_a_gradient_since_zero_grad_to_zeros_shows_zeros_as_pytorch(fraction, chunk_size):
    # zero_grad(set_to_none=False) leaves zeros in p.grad, and a parameter that gets no gradient from the next backward
    # keeps them. Its gradient chunk is freed meanwhile (grads.py's forget_zeros): `p.grad` showed None where b was
    # alone in its chunk, and bytes nobody wrote where it shared a streamed one (NaN in the checked simulation), so
    # clipping made every parameter NaN; an edit made through it (an L2 term added by hand) was lost.
    model = _Branchy()
    plain = copy.deepcopy(model)
    pair = [(plain, ADAMW(plain.parameters())),
            prepared(model, ADAMW, device_memory=budget(model, fraction), chunk_size=chunk_size)]
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)]
    seen = []
    for net, opt in pair:
        inner = getattr(net, "module", net)
        shown = []
        for i, (x, y) in enumerate(batches):
            inner.use_b = i % 2 == 0
            nn.functional.mse_loss(net(x), y).backward()
            shown.append(grads(inner))
            for p in net.parameters():
                p.grad.add_(p.detach(), alpha=1e-2)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
        seen.append((shown, {n: p.detach().clone() for n, p in inner.named_parameters()}))
    (plain_shown, plain_values), (shown, values) = seen
    for step, (want, got) in enumerate(zip(plain_shown, shown)):
        for name, grad in want.items():
            assert got[name] is not None and torch.equal(got[name], grad), (step, name)
    assert all(torch.equal(values[n], v) for n, v in plain_values.items())


def test_zeros_shown_for_a_layer_skipped_stay_beside_its_parameters_on_the_device():
    # Showing them brings the freed gradient chunk back to the device, which made room by evicting what was used
    # least recently: that layer's own parameter chunk, so p.grad and p were on two devices (at 3x the parameter bytes,
    # one chunk per layer).
    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers, self.head, self.skip = nn.ModuleList(nn.Linear(32, 32) for _ in range(6)), nn.Linear(32, 4), ()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for index, layer in enumerate(self.layers):
                x = x if index in self.skip else torch.tanh(layer(x))
            return self.head(x)

    model = Skips()
    plain = copy.deepcopy(model)
    pair = [(plain, ADAMW(plain.parameters())),
            prepared(model, ADAMW, device_memory=budget(model, 3.0), chunk_size=32 * 32 + 32)]
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(5)]
    for net, opt in pair:
        inner = getattr(net, "module", net)
        for step, (x, y) in enumerate(batches):
            inner.skip = (1, 4) if step == 3 else ()
            nn.functional.mse_loss(net(x), y).backward()
            for p in net.parameters():
                p.grad.add_(p.detach(), alpha=1e-2)
            opt.step()
            opt.zero_grad(set_to_none=False)
    want, got = plain.state_dict(), pair[1][0].state_dict()
    assert all(torch.equal(v, got[k]) for k, v in want.items())


@pytest.mark.parametrize("fraction", [None, 0.3])
@pytest.mark.parametrize("buffer", ["flat", "own"])
def test_a_gradient_the_user_assigned_stays_p_grad_and_backward_adds_into_it(fraction, buffer):
    """A `p.grad` set to a tensor of the user's (a view of a flat gradient buffer, as apex and fairseq do, or
    zeros_like) is p.grad from then on, as in PyTorch: each backward adds into it, and zeroing it in place is what
    clears the gradient (before, the step took it into the chunk and p.grad showed the chunk: zeroing the buffer
    cleared nothing, and the gradients of a streamed model added up from step to step)."""
    model, batches = mlp(), mlp_batches(4)
    seen = []
    for net, optimizer in twins(model, fraction):
        params = list(net.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        if buffer == "flat":
            views = flat.split([p.numel() for p in params])
            buffers = [view.view_as(p) for view, p in zip(views, params)]
        else:
            buffers = [torch.zeros_like(p) for p in params]
        for p, own in zip(params, buffers):
            p.grad = own
        norms = []
        for batch in batches:
            mlp_loss(net, batch).backward()
            assert all(p.grad is own for p, own in zip(params, buffers))
            norms.append([own.clone() for own in buffers])
            optimizer.step()
            for own in buffers:
                own.zero_()
        seen.append((norms, copy.deepcopy(net.state_dict())))
    (plain_norms, plain_state), (norms, state) = seen
    for plain_step, step in zip(plain_norms, norms):
        assert all(torch.equal(a, b) for a, b in zip(plain_step, step))
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())


def test_p_grad_zeroed_in_place_after_a_step_that_moved_its_chunk_off_the_device_clears_the_gradient():
    """fp16 at twice the parameter bytes, its first step skipped (an overflow): the steps after evict the gradient
    chunk of a homed group to update another, while `p.grad` shows the device memory it left. Zeroed in place there
    (no zero_grad), the change goes into the chunk when gradients are next taken (ShownGrads.left_device): before, the
    next backward added into the old gradients."""
    model, batches = mlp(), mlp_batches(6)
    runs = []
    for zero in ("zero_grad", "in place"):
        net, optimizer = prepared(copy.deepcopy(model), ADAMW, device_memory=budget(model, 2.0), dtype="fp16")
        read = []
        for i, batch in enumerate(batches):
            (mlp_loss(net, batch) * (1e30 if i == 0 else 1)).backward()
            read += [p.grad.clone() for p in net.parameters()] if i else []  # (not the first's: inf and nan)
            optimizer.step()
            if zero == "in place":
                for p in net.parameters():
                    p.grad.zero_()
            else:
                optimizer.zero_grad(set_to_none=False)
        runs.append((read, copy.deepcopy(net.state_dict())))
    (first, first_state), (second, second_state) = runs
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(second_state[k], v) for k, v in first_state.items())


@pytest.mark.parametrize("fraction, dtype", [(None, "fp32"), (0.3, "fp32"), (2.0, "fp32"), (1.5, "fp32"),
                                             (None, "fp16"), (0.3, "fp16"), (2.0, "fp16")])
def test_a_gradient_kept_across_zero_grad_to_zeros_reads_the_next_backwards_gradient(fraction, dtype):
    """`p.grad` kept by the user (a logger holding the gradients) across zero_grad(set_to_none=False) is zeroed, then
    added into by the next backward, as in PyTorch (where its chunk was on the device, it read zeros for good: the
    chunk, holding zeros, was freed, and the next backward wrote another). Kept anew after each backward, and not
    those of the first step: it streams every group, and one the plan then homes on the device has its gradient there
    (the README). fp16 against chunkmem's own loop reading `p.grad` anew (its loss scale has no plain twin). At 1.5 and
    2x the parameter bytes a homed group's gradient chunk on the device is a payload, not lent tensors: zero_grad
    showed new views of it, and those the user kept were not known when its zeros were freed; fp16 with no budget:
    the step's overflow check assembled the chunks lending autograd's tensors, which `p.grad` kept then viewed."""
    model, batches = mlp(), mlp_batches(4)
    seen = []
    pair = twins(model, fraction) if dtype == "fp32" else \
        [prepared(model, ADAMW, device_memory=budget(model, fraction), dtype=dtype) for _ in range(2)]
    for run, (net, optimizer) in enumerate(pair):
        kept: list[torch.Tensor] | None = None
        read = []
        for batch in batches:
            mlp_loss(net, batch).backward()
            if kept is not None:  # the reference reads `p.grad` anew; chunkmem's run, the tensors kept
                read.append([p.grad.clone() for p in net.parameters()] if run == 0 else [k.clone() for k in kept])
            kept = [p.grad for p in net.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        seen.append(read)
    for reference, step in list(zip(*seen))[1:]:  # not those kept in the first step (the docstring)
        assert all(torch.equal(a, b) for a, b in zip(reference, step))


@pytest.mark.parametrize("fraction", [None, 0.3])
@pytest.mark.parametrize("loop", ["clip", "zero before backward", "edit then penalty"])
def test_a_flat_gradient_buffer_of_the_users_is_what_clipping_zeroing_and_a_penalty_see(fraction, loop):
    """Views of one flat buffer set as `p.grad` share one version counter: clipping (the model's own, which scales the
    chunks), the buffer zeroed between the forward and the backward, and an edit in place before a backward that
    writes some gradients alone (a penalty on weights) give PyTorch's gradients and steps."""
    model, batches = mlp(), mlp_batches(3)
    seen = []
    for net, optimizer in twins(model, fraction):
        params = list(net.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        for p, view in zip(params, flat.split([p.numel() for p in params])):
            p.grad = view.view_as(p)
        read = []
        for batch in batches:
            loss = mlp_loss(net, batch)
            if loop == "zero before backward":
                flat.zero_()
            loss.backward()
            if loop == "clip":
                clip = getattr(net, "clip_grad_norm_", None) or \
                    functools.partial(torch.nn.utils.clip_grad_norm_, params)
                read.append(clip(0.05))  # chunkmem's own scales the chunks
            elif loop == "edit then penalty":
                flat.mul_(0.5)
                sum(p.pow(2).sum() for p in params if p.dim() > 1).backward()
            read.append(flat.clone())
            optimizer.step()
            if loop != "zero before backward":
                flat.zero_()
        seen.append((read, copy.deepcopy(net.state_dict())))
    (plain_read, plain_state), (read, state) = seen
    assert all(torch.equal(a, b) for a, b in zip(plain_read, read))
    assert all(torch.equal(state[k], v) for k, v in plain_state.items())


def test_gradients_autograd_left_in_p_grad_while_hooks_were_off_are_not_taken_for_the_users():
    """A resident step (hooks off) whose gradients a forward hid, then a penalty on the parameters alone: autograd
    leaves that penalty's gradients in `p.grad` until the step (Runtime.adopt_grads), and the next forward must not
    take them for tensors of the user's (which the next backward's end writes over the chunk: the first backward's
    gradients were lost). The sums come in another order than PyTorch's (the Note: the forward hid the first), so
    equal to rounding."""
    model, batches = mlp(), mlp_batches(6)
    states = []
    for net, optimizer in twins(model, None):
        for first, metric, second in zip(batches[::3], batches[1::3], batches[2::3]):
            mlp_loss(net, first).backward()
            net(metric[0])  # gradients enabled, no backward: the gradients are hidden
            sum(p.pow(2).sum() for p in net.parameters()).backward()
            mlp_loss(net, second).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(copy.deepcopy(net.state_dict()))
    assert all(torch.allclose(states[1][k], v, rtol=1e-5, atol=1e-6) for k, v in states[0].items())


@pytest.mark.parametrize("fraction", [None, 0.3])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("clear", ["in place", "to None"])
def test_in_fp16_zeroing_p_grad_in_place_clears_as_zero_grad_does(fraction, clip, clear):
    """fp16 gradients carry the loss scale: `p.grad.zero_()` after the step (no zero_grad) clears them as
    zero_grad(set_to_none=False) does, after the model's clipping unscaled them too (Runtime._scale_kept): before, the
    next backward added scaled gradients into unscaled ones. With no budget the step's overflow check assembled the
    chunks lending autograd's tensors (chunk's Note on lent ranges), and `p.grad` was their memory no longer: every
    step after the first added into the old gradients. `p.grad = None` for every parameter after clipping left no
    gradient to scale again, and the next backward raised (an empty list to torch._foreach_mul_)."""
    model, batches = mlp(), mlp_batches(4)
    runs = []
    for zero in ("zero_grad", clear):
        net, optimizer = prepared(copy.deepcopy(model), ADAMW, device_memory=budget(model, fraction), dtype="fp16")
        read = []
        for batch in batches:
            mlp_loss(net, batch).backward()
            read += [p.grad.clone() for p in net.parameters()]
            if clip:
                read.append(net.clip_grad_norm_(0.05))
            optimizer.step()
            if zero == "in place":
                for p in net.parameters():
                    p.grad.zero_()
            elif zero == "to None":
                for p in net.parameters():
                    p.grad = None
            else:
                optimizer.zero_grad(set_to_none=clear == "to None")
        runs.append((read, copy.deepcopy(net.state_dict())))
    (first, first_state), (second, second_state) = runs
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(second_state[k], v) for k, v in first_state.items())
