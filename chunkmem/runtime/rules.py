"""torch.optim's update rules as chunkmem calls them: on lists of views into a chunk group's chunks, with the
steps counted apart, and fp32 groups updated together (the Note), later than their turn.

[Note: updates made together]
A call of the update rule costs more than its arithmetic: on the CPU simulation, a chunk group updated in
its turn, between its neighbours' bookkeeping, cost 0.1-0.2 ms more than in one call with them (16 groups
of a 16x1024 MLP: 2 ms of a 70 ms step; on CUDA, each foreach kernel also launches once for them all). So
fp32 groups update together (`Together`), later than their turn; the update is the same elementwise
arithmetic on the same payloads, so the bits are the same. That is safe as long as those payloads stay
where the views point and nothing else reads or writes them first:
- Groups on the device update at the end of the step, or as soon as one of their chunks is about to leave
  the device (read back, dropped or reset: `Residency.before_leave`), whichever comes first. Nothing is
  pinned, so an access that needs room gets it as before, the updates made first.
- A run of groups updated on the host by torch.optim updates when a group homed on the device comes or the
  step ends. Their payloads are theirs alone meanwhile: their master and state chunks left the device when
  claimed for the host, their gradient chunk is read on the host, and a host group's access runs no plan
  action. A homed group's access may (evictions, prefetches, a prefetch of a run's parameter chunk among
  them), so the run updates first, then sends its parameter chunks up (`Placer.updated_on_host`) in group
  order. On CUDA the native kernel, its default there, updates group by group, each upload overlapping the
  next group's update; with torch.optim a run's uploads start once it is done (a 4 MiB chunk took 0.08 ms
  at the lent H100's 46-55 GB/s), and the next forward waits only for those it reaches before they land.
Not with a disk tier (a group's chunks are in host memory only during its turn), nor in low precision
(one fp32 copy of a gradient alive at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim.adam import adam as adam_update
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_scalar_dtype
from torch.optim.sgd import sgd as sgd_update

from chunkmem.chunks.chunk import Chunk

SUPPORTED = (Adam, AdamW, SGD)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What an optimizer keeps per parameter and how it updates a list of them."""

    states: tuple[str, ...]
    update: Callable[[dict, list[torch.Tensor], list[torch.Tensor], dict[str, list], list[torch.Tensor]], None]


def rule_for(optimizer: Optimizer) -> Rule:
    if optimizer is None:
        raise TypeError("chunkmem.prepare(model, optimizer) needs the optimizer that trains the model (e.g. "
                        "torch.optim.AdamW(model.parameters())); a model nothing trains (a frozen reference) is "
                        "prepared by a chunkmem.Manager: chunkmem.Manager(config).prepare(model)")
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(f"torch.optim.{t.__name__}" for t in SUPPORTED)
        raise TypeError(f"chunkmem cannot drive {type(optimizer).__module__}.{type(optimizer).__qualname__}: "
                        f"supported optimizers are {names}")
    for group in optimizer.param_groups:
        check_flags(type(optimizer).__name__, group)
    if isinstance(optimizer, SGD):
        momentum = any(g["momentum"] for g in optimizer.param_groups)
        return Rule(("momentum_buffer",) if momentum else (), sgd)
    return Rule(("exp_avg", "exp_avg_sq"), adam)


def check_flags(name: str, group: dict) -> None:
    """Refuse options of optimizer `name`'s param group `group` that chunkmem cannot step (AMSGrad's states have no
    chunks), whenever they are set."""
    for flag in ("amsgrad", "differentiable", "capturable"):
        if group.get(flag):
            raise ValueError(f"{name}({flag}=True) is not supported by chunkmem (a param group has {flag}="
                             f"{group[flag]!r}): construct the optimizer with {flag}=False, and leave it so")


def adam(group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
         states: dict[str, list], steps: list[torch.Tensor]) -> None:
    """torch.optim's Adam and AdamW over these lists, with the step counts kept on the host (`fused_steps`)."""
    beta1, beta2 = group["betas"]
    counted = fused_steps(group, params, steps)
    adam_update(params, grads, states["exp_avg"], states["exp_avg_sq"], [], counted,
                foreach=group.get("foreach"), fused=group.get("fused"),
                decoupled_weight_decay=group.get("decoupled_weight_decay", False),
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
    if counted is not steps:
        torch._foreach_add_(steps, 1.0)  # the kernel counted the step on the device copies


def zero_steps() -> torch.Tensor:
    """A parameter's step count before its first step, as torch.optim keeps it: in fp32 (fp64 where that is the default
    dtype), on the host, whatever the default dtype and device (`torch.set_default_dtype(torch.bfloat16)` made it
    bf16, which counts no further than 256)."""
    return torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")


def fused_steps(group: dict, params: list[torch.Tensor], steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """The step counters to hand torch's fused Adam: its CUDA kernel reads them by address on the device, so for
    parameters there, copies on their device (chunkmem keeps one counter per parameter on the host, wherever its
    group updates); else `steps` themselves."""
    if not group.get("fused") or not params or params[0].device.type == "cpu":
        return steps
    return list(torch.stack(steps).to(params[0].device, torch.float32, non_blocking=True).unbind(0))  # as torch's


def sgd(group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
        states: dict[str, list], steps: list[torch.Tensor]) -> None:
    """torch.optim's SGD over these lists, its momentum buffers in the chunks."""
    # torch.optim.SGD starts a momentum buffer as a copy of the first gradient a step with momentum takes: pass None
    # until then. SGD's step counts are the steps taken with momentum (torch's SGD counts none), so a group given
    # momentum after steps without (a schedule's, or by hand) starts its buffers as torch's would.
    buffers = states.get("momentum_buffer")
    given: list[torch.Tensor | None] = [b if s.item() > 0 else None for b, s in zip(buffers, steps)] \
        if buffers else [None] * len(params)
    sgd_update(params, grads, given, foreach=group.get("foreach"), fused=group.get("fused"),
               weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
               dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
    for buffer, new in zip(buffers or [], given):
        if new is not None and new.data_ptr() != buffer.data_ptr():
            buffer.copy_(new)
    if group["momentum"]:
        for step in steps:
            step += 1


def run_scratch(group: dict, params: list[torch.Tensor], segment_for: Callable[[int], int],
                part: int | None = None) -> list[int]:
    """The blocks (bytes) torch.optim allocates on the device updating `params` of param group `group` in one call:
    none fused; with foreach, a temporary of each parameter at once; else two at a time, each parameter's size: two
    of the largest of each pool (CUDA's allocator keeps blocks for small requests apart: `segment_for`'s class), a
    call per parameter (`ChunkOptimizer._reserve_run`: in one call over several, a third stays alive). With `part`,
    contiguous parameters update in slices of at most that many elements (`Together.update`)."""
    sizes = [(p.numel() if part is None or not p.is_contiguous() else min(part, p.numel())) * p.element_size()
             for p in params]
    if not single_tensor(group, params):
        return [] if group.get("fused") else sizes
    small = segment_for(1)
    largest = {segment_for(n) == small: n for n in sorted(sizes)}  # the largest of each pool, last written
    return [n for n in largest.values() for _ in range(2)]


def single_tensor(group: dict, params: list[torch.Tensor]) -> bool:
    """Whether torch.optim updates `params` of param group `group` one at a time (neither fused nor foreach, as
    set or by torch's default for where they are)."""
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused is None and foreach is None:
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return not (fused or foreach)


def widened(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """fp32 copies of low-precision gradients (unscaled by `inv_scale`), packed in one buffer in their order: one
    allocation and one multi-tensor copy for a chunk group rather than one of each per parameter (kernel launches
    are what a GPU waits on when tensors are small)."""
    flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.float32, device=grads[0].device)
    wide = unpacked(flat, grads)
    torch._foreach_copy_(wide, grads)
    if inv_scale != 1.0:
        torch._foreach_mul_(wide, inv_scale)
    return flat


def same_step_slices(numel: int, part: int, step: torch.Tensor) -> Iterator[slice]:
    """Slices of `part` elements of a range of `numel`, in order, each updated from the same step count: `step` is
    set back before each but the first (Adam and SGD are elementwise, so slices give the bits of one call)."""
    before = step.clone() if part < numel else None
    for start in range(0, numel, part):
        if before is not None:
            step.copy_(before)
        yield slice(start, min(start + part, numel))


def pieces(tensors: list[torch.Tensor], start: int, stop: int) -> list[torch.Tensor]:
    """Flat views of elements [start, stop) of `tensors` laid end to end, in order."""
    out, offset = [], 0
    for tensor in tensors:
        low, high = max(start - offset, 0), min(stop - offset, tensor.numel())
        if low < high:
            out.append(tensor.reshape(-1)[low:high])
        offset += tensor.numel()
    return out


def unpacked(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat`, packed in order, shaped as `like`."""
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like)]


class Together:
    """Updates of chunk groups made in one call of the update rule per param group, later than each group's
    turn (the Note on updates made together). `chunks` are those the pending updates use on the device: one of
    them about to leave it makes them all now (`leaving`). `after` are host-updated parameter chunks to send up
    once the updates are made."""

    def __init__(self, rule: Rule, reserve: Callable[[Together], int | None] | None = None) -> None:
        self.rule = rule
        # On the device: room for the run's temporaries, before any of it changes; a number: room for those of
        # that many elements at a time only, and the run updates a parameter, or a slice of one, per call.
        self.reserve = reserve
        self.lists: dict[int, tuple[dict, list[torch.Tensor], list[torch.Tensor], dict[str, list], list]] = {}
        self.chunks: set[Chunk] = set()
        self.after: list[Chunk] = []

    def add(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], states: dict[str, list],
            steps: list[torch.Tensor]) -> None:
        _, all_params, all_grads, all_states, all_steps = self.lists.setdefault(
            id(group), (group, [], [], {k: [] for k in states}, []))
        all_params += params
        all_grads += grads
        for kind, views in states.items():
            all_states[kind] += views
        all_steps += steps

    def update(self) -> None:
        part = self.reserve(self) if self.reserve is not None and self.lists else None
        lists, self.lists = self.lists, {}
        self.chunks.clear()
        for group, params, grads, states, steps in lists.values():
            if part is None:
                self.rule.update(group, params, grads, states, steps)
                continue
            # A parameter, or a slice of a contiguous one, per call, with one slice's temporaries at a time (a
            # slice of a whole range's length, over a tensor's first dimension, is all of it).
            for i, step in enumerate(steps):
                tensors = [params[i], grads[i], *(v[i] for v in states.values())]
                numel = params[i].numel()
                sliceable = all(t.is_contiguous() for t in tensors)
                views = [t.view(-1) for t in tensors] if sliceable else tensors
                for cut in same_step_slices(numel, part if sliceable else numel, step):
                    param, grad, *kinds = [t[cut] for t in views]
                    self.rule.update(group, [param], [grad], {k: [t] for k, t in zip(states, kinds)}, [step])

    def leaving(self, chunk: Chunk) -> None:
        """Residency.before_leave: `chunk`'s device payload is about to be read back, dropped or reset."""
        if chunk in self.chunks:
            self.update()
