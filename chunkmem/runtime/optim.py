"""The optimizer of a prepared model: torch.optim's own update rules, applied chunk group by group.

The update of each chunk group runs where its fp32 master lives (device or host), by calling
torch.optim's functional Adam/AdamW/SGD on views into the master, gradient and state chunks. So the
arithmetic is PyTorch's: in fp32 the result is bit-identical to the plain optimizer on that device.
`param_groups` are the user's own dicts, so LR schedulers and manual edits take effect. The rules and the
updates made together are rules.py's; `optimizer.state` is statecopy.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import torch
from torch.optim import Optimizer

from chunkmem.chunks.placement import update_scratch
from chunkmem.chunks.state import ChunkState, TensorState
from chunkmem.chunks.store import ChunkGroup, ParamRecord
from chunkmem.errors import DiskTierError, MemoryBudgetError
from chunkmem.memory import native
from chunkmem.runtime.ahead import Ahead
from chunkmem.runtime.runtime import Runtime
from chunkmem.runtime.rules import (Rule, Together, adam, check_flags, pieces, run_scratch, same_step_slices,
                                    single_tensor, unpacked, widened, zero_steps)
from chunkmem.runtime.statecopy import ChunkStates

_log = logging.getLogger("chunkmem")

# Elements a slice of a homed update starts at a multiple of (_room_on_device): where a whole range's vector loops
# would, for CPU kernels treat a loop's tail apart (torch's fused Adam on the CPU rounds it otherwise).
SLICE_ALIGN = 1024
_NOT_IN_MODEL = ("the optimizer holds a parameter that is not in the model passed to chunkmem.prepare, or was added "
                 "to it after (prepare laid out chunks for the parameters the model had then): build the model "
                 "whole, then the optimizer (and its param groups) from model.parameters(), then prepare")


# torch.optim's hooks of an optimizer (register_step_pre_hook, register_state_dict_post_hook, ...)
HOOKS = [f"_optimizer_{kind}_{when}_hooks" for kind in ("step", "state_dict", "load_state_dict")
         for when in ("pre", "post")]
LOSS_SCALER = "chunkmem_loss_scaler"  # the key of state_dict() that holds the fp16 loss scaler's state


def _listed_twice(record: ParamRecord) -> ValueError:
    return ValueError(f"the optimizer's param groups list parameter {record.name} more than once: torch.optim updates "
                      "it once per listing (and warns), chunkmem once in all; list each parameter once "
                      "(dict.fromkeys(params) drops repeats and keeps their order)")


def _described(value: Any) -> str:
    return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}" if isinstance(
        value, torch.Tensor) else repr(value)


def is_step_count(value: Any) -> TypeGuard[float | torch.Tensor]:
    """Whether `value` is a step count as an optimizer state holds it (a number or a one-element tensor): a whole
    number, at least 0."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta else value
    if not isinstance(number, numbers.Real) or isinstance(number, bool):  # numpy's numbers too
        return False
    count = float(number)
    return math.isfinite(count) and count >= 0 and count.is_integer()


# A range of a chunk group's chunks (start, end) the native kernel updates in one pass, with the param group and the
# parameters in it (`ChunkOptimizer.spans`).
Span = tuple[int, int, dict, list[ParamRecord]]


def _through(hooks: Mapping[int, Callable], optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` through torch.optim's state dict hooks that may replace it (one returning None leaves it)."""
    for hook in hooks.values():
        result = hook(optimizer, state_dict)
        state_dict = state_dict if result is None else result
    return state_dict


def retire(optimizer: Optimizer, prepared: ChunkOptimizer) -> None:
    """After a prepare succeeded, the user's own optimizer refuses to step: it would update the parameters where the
    chunks lend them, with states of its own, beside the prepared optimizer. An LR scheduler made on it before prepare
    still works: the prepared optimizer shares its list of param groups (a group added to the prepared one after
    prepare is the scheduler's too; one added to the user's is added to the prepared one), and says when it stepped
    (ChunkOptimizer.step). Step and state dict hooks registered on either, before prepare or after, run at the prepared
    one's steps and state dicts: the two share them too. Its state_dict, load_state_dict and zero_grad are the prepared
    one's (a load gave it a list of its own, and a scheduler on it then changed groups nothing trained with)."""
    optimizer.param_groups = prepared.param_groups  # the same dicts, in the same order, until now in two lists
    optimizer.add_param_group = prepared.add_param_group  # type: ignore[method-assign]  # with its checks and states
    for hooks in HOOKS:
        setattr(prepared, hooks, getattr(optimizer, hooks))
    def step(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"this {type(optimizer).__name__} was given to chunkmem.prepare, which returned the optimizer that steps "
            "the model: call step() on that one (model, optimizer = chunkmem.prepare(model, optimizer))")

    # An LR scheduler's mark, made on it or not: one made before prepare warns if its wrapper went, and one made after
    # wraps no step (the prepared one's says it stepped: `_opt_called`).
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign, assignment]
    optimizer.state_dict = prepared.state_dict  # type: ignore[method-assign]  # the states are in its chunks
    # torch's would set `p.grad` to None, unseen between a forward and its backward (grads.py's Note)
    optimizer.zero_grad = prepared.zero_grad  # type: ignore[method-assign]
    optimizer.load_state_dict = prepared.load_state_dict  # type: ignore[method-assign]


class ChunkOptimizer(Optimizer):
    """Drop-in for the user's optimizer; its state lives in chunks (`state` reads them: ChunkStates)."""

    def __init__(self, runtime: Runtime, optimizer: Optimizer, rule: Rule,
                 model: torch.nn.Module | None = None) -> None:
        """model: the one of a manager's models this optimizer trains (None: the runtime's only one)."""
        self.runtime = runtime
        self.own = None if model is None else frozenset(model.parameters())
        self.rule = rule
        self.wrapped_type = type(optimizer)
        self.original = optimizer  # the user's, whose param groups this one shares (`retire`)
        self.steps: dict[ParamRecord, torch.Tensor] = {}  # filled by add_param_group, which __init__ calls
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._states = ChunkStates(self)
        self.native = native.load() if runtime.config.uses_native_optimizer else None
        self.native_steps = 0  # chunk-group updates the native kernel made (or adopted, made ahead)
        self.steps_adam = rule.update is adam
        self.state_writes = 0  # steps, loads and changes made through optimizer.state: what its copies follow
        self.restarted: set[ParamRecord] = set()  # whose step count optimizer.state set (to 0, say) since a load
        self._parts: dict[int, int] = {}  # chunk group -> elements its device update last had room for at a time
        self.warned_scaled = False  # that p.grad was changed in place while it held scaled fp16 gradients
        self.warned_hidden = False  # that a forward after backward hid p.grad before this step (ShownGrads)
        self._make_ahead()

    @property  # type: ignore[override]
    def state(self) -> ChunkStates:
        return self._states

    @state.setter
    def state(self, value: Any) -> None:
        if hasattr(self, "_states"):  # Optimizer.__init__ sets an empty one first
            self._states._refuse()

    def _make_ahead(self) -> None:
        """Host updates made ahead of step() (ahead.py), where Config.overlap_update asks and they can be."""
        runtime = self.runtime
        if not runtime.config.overlap_update:
            return
        why = ("the native kernel is unavailable" if self.native is None else
               "it updates Adam and AdamW only" if not self.steps_adam else
               "a disk tier updates groups in turn" if runtime.host_cache is not None else
               "ZeRO shards reduce gradients after backward" if runtime.shards is not None else None)
        if why is None:
            runtime.ahead = Ahead(runtime, self)
        else:
            _log.warning("chunkmem: Config.overlap_update=True is ignored: %s", why)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, before or after prepare: every parameter of the prepared model has its chunks'
        slots for optimizer state already (trainable ones; frozen ones get no gradient to step with)."""
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # torch.optim refuses a set
            param_group["params"] = params = list(params)  # a generator is read once: here, not also in torch.optim's
        given = [params] if isinstance(params, torch.Tensor) else params
        listed: list[Any] = [p[1] if isinstance(p, tuple) else p for p in given]  # (name, param): named_parameters()
        seen: set[torch.Tensor] = set()
        for param in listed:
            self._check_own(param)
            if param in seen:
                raise _listed_twice(self.runtime.store.records[param])
            seen.add(param)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_flags(self.wrapped_type.__name__, group)
            self._check_momentum(group)
        except ValueError:
            self.param_groups.pop()
            raise
        records = self.runtime.store.records
        for param in group["params"]:
            if records[param] not in self.steps:
                self.steps[records[param]] = zero_steps()

    def _check_own(self, param: Any) -> None:
        """`param` is one of the model's this optimizer was prepared with; under a manager, not another model's
        (whose own optimizer steps it, or which is frozen)."""
        records = self.runtime.store.records
        if param not in records:
            raise ValueError(_NOT_IN_MODEL)
        if self.own is not None and param not in self.own:
            raise ValueError(f"the optimizer holds parameter {records[param].name} of another model this "
                             "chunkmem.Manager prepared: give each trained model an optimizer over its own "
                             "parameters (model.parameters())")

    def move_to(self, runtime: Runtime) -> None:
        """Step `runtime`'s chunks from now on: a manager laid its models out again, before any step."""
        self.runtime = runtime
        self.steps = {}
        self.group_of()  # a zero step count for each parameter
        self._make_ahead()

    def set_states(self, steps: dict[ParamRecord, float], states: dict[tuple[ParamRecord, str], torch.Tensor]) -> None:
        """Every parameter's step count, and its states of each kind, from `states` (those it lacks: zeros). One
        given states at a count of 0 has them, as torch.optim's (`restarted`)."""
        data = self.runtime.data
        self.state_writes += 1
        self.restarted = {record for record, _ in states if steps[record] <= 0}
        for record, step in self.steps.items():
            step.fill_(steps[record])
            for kind in self.runtime.store.families.saved if record.group.owned and record.group.trainable else ():
                chunk = record.group.chunks[kind]  # a frozen parameter's group has none: it never steps
                value = states.get((record, kind))
                if value is not None or chunk.state is not ChunkState.FREE:
                    view = record.view(data.writable(chunk, chunk.state.on_device))
                    view.copy_(value) if value is not None else view.zero_()

    @torch.no_grad()
    def read_state(self, record: ParamRecord, kind: str) -> torch.Tensor:
        """`record`'s state `kind` ("step": its step count) as `optimizer.state` gives it: an fp32 copy on the host."""
        if kind == "step":
            return self.steps[record].clone()
        return record.view(self.runtime.data.read(record.group.chunks[kind])).to("cpu", torch.float32, copy=True)

    @torch.no_grad()
    def write_state(self, record: ParamRecord, kind: str, value: torch.Tensor) -> None:
        """`value`, `record`'s state `kind` changed in place through `optimizer.state`, into its chunk. A step count
        set to 0 leaves the parameter's states in `state` and the state dict, as torch.optim's (`restarted`)."""
        self.state_writes += 1
        if kind == "step":
            self.steps[record].copy_(value)
            self.restarted.add(record)
            return
        chunk = record.group.chunks[kind]
        record.view(self.runtime.data.writable(chunk, chunk.state.on_device)).copy_(value)

    def group_of(self) -> dict[ParamRecord, dict]:
        """Each parameter's param group, as `param_groups` says now (they may have been edited since prepare)."""
        records, own = self.runtime.store.records, self.own
        out = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param not in records or (own is not None and param not in own):
                    self._check_own(param)  # raises
                if records[param] in out:  # appended to `params` by hand
                    raise _listed_twice(records[param])
                out[records[param]] = group
                if records[param] not in self.steps:
                    self.steps[records[param]] = zero_steps()
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        try:
            return self._step(closure)
        except DiskTierError as error:  # some groups may have updated, others not: the values may mix two steps
            self.runtime.step_failed = str(error)
            raise

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        self.original._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler made on it looks for
        self.state_writes += 1
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        runtime = self.runtime
        self._warn_hidden()
        runtime.adopt_data()
        runtime.adopt_grads(assigned=True)
        runtime.grads.take()  # a p.grad replaced or set to None since backward (grads.py's Note)
        runtime.grads.forward_over()
        self._check_still_frozen()
        for group in self.param_groups:  # flags set after prepare too
            check_flags(self.wrapped_type.__name__, group)
            self._check_momentum(group)
        if runtime.shards is not None:
            runtime.shards.check_order()
        group_of = self.group_of()  # refuses a parameter of another model before anything changes
        inv_scale = 1.0
        if runtime.scaler is not None:
            scale = runtime.scaler.scale  # the factor backward put into the gradients
            found_inf = self._found_inf(group_of)
            if runtime.shards is not None:  # every rank must skip the same steps
                found_inf = bool(runtime.shards.all_reduce(torch.tensor(float(found_inf), device="cpu")).item())
            if runtime.grads_scaled and runtime.shards is None and not self.warned_scaled and runtime.grads.edited():
                self.warned_scaled = True
                _log.warning("chunkmem: p.grad was changed in place since backward, and under dtype='fp16' it holds "
                             "each gradient times the loss scale (%g): a change that reads it (torch.nn.utils."
                             "clip_grad_norm_, whose fp16 norm of scaled values is often inf, clipping every gradient "
                             "to zero) sees scaled values; clip with model.clip_grad_norm_, which unscales first",
                             scale)
            runtime.scaler.update(found_inf)
            if found_inf:
                runtime.optimizer_done(self)
                return loss
            inv_scale = 1.0 / scale if runtime.grads_scaled else 1.0
        # On the device (its temporaries reserved under a budget; without one, the device's own limit: nothing to hold
        # against, and a launch-bound step pays nothing for it); a run on the host.
        reserve = self._reserve_run if runtime.config.device_memory is not None else None
        together, hosted = Together(self.rule, reserve), Together(self.rule)
        runtime.residency.before_leave = together.leaving
        stepped: list[ParamRecord] = []
        try:
            for chunk_group in runtime.groups():
                members = [r for r in chunk_group.members if r.grad_state is TensorState.HOLD and r in group_of]
                if members:
                    self._visit(chunk_group, members, group_of, inv_scale, together, hosted)
                    stepped += members
            self._finish_host_run(hosted)
            together.update()
        finally:
            runtime.residency.before_leave = None
        if runtime.shards is not None:  # every rank's parameters moved, so their versions move on every rank (a
            # backward through them raises on all or none): which got a gradient is agreed per step
            stepped += [r for g in runtime.store.groups if g.trainable and not g.owned for r in g.members
                        if r.grad_state is TensorState.HOLD and r in group_of]
        runtime.rewrote(stepped)
        runtime.optimizer_done(self)
        runtime.fence_params()  # parameters sent up during the step are read next, maybe outside forward (an EMA)
        return loss

    def _visit(self, chunk_group: ChunkGroup, members: list[ParamRecord], group_of: dict[ParamRecord, dict],
               inv_scale: float, together: Together, hosted: Together) -> None:
        """A chunk group's turn: updated now, or with those on the device or with its run on the host (rules.py's
        Note on updates made together)."""
        runtime = self.runtime
        homed = runtime.placer.homed(chunk_group.index)
        if homed:  # its access may move chunks: the host run goes first, its uploads too
            self._finish_host_run(hosted)
        runtime.emit("pre_optimizer", "optim", chunk_group.master.name)
        later = self._step_group(chunk_group, members, group_of, inv_scale, together if homed else hosted)
        if not homed:
            if later:
                hosted.after.append(chunk_group.param)
            else:
                runtime.placer.updated_on_host(chunk_group.param)
        runtime.emit("post_optimizer", "optim", chunk_group.master.name)

    def _finish_host_run(self, hosted: Together) -> None:
        """Update the run of host groups made together so far, then send their parameter chunks up."""
        hosted.update()
        for chunk in hosted.after:
            self.runtime.placer.updated_on_host(chunk)
        hosted.after.clear()

    def _check_momentum(self, group: dict) -> None:
        """An SGD optimizer with momentum=0 in every group at prepare has no momentum buffers in its chunks: momentum
        a group gets later (added, or set by hand) would start afresh at every step, silently."""
        if group.get("momentum") and "momentum_buffer" not in self.rule.states:
            raise ValueError(f"a param group has momentum={group['momentum']}, and the SGD optimizer given to "
                             "chunkmem.prepare had momentum=0 in every group, so it has no momentum buffers: make the "
                             "optimizer with the momentum it will have (a group may start at momentum=0 set after "
                             "prepare)")

    def _warn_hidden(self) -> None:
        """Where p.grad showed no gradient before this step, though the chunks hold some: after a forward that hid
        them (grads.py's Note), or a backward that raised (its end, which shows them, never came)."""
        runtime = self.runtime
        raised = bool(runtime.queued) and torch._C._current_graph_task_id() == -1  # not a step inside a backward
        hidden = {r for r in runtime.grads.hidden_by_forward if self.own is None or r.param in self.own}
        if (hidden or raised) and not self.warned_hidden and runtime.grads.unseen(self.own):
            self.warned_hidden = True
            why, fix = (("a backward raised before it ended (its end shows the gradients in p.grad)",
                         "or drop them with zero_grad()") if raised else
                        ("a forward with gradients enabled ran after backward() and before step(), with no backward of "
                         "its own", "or run that forward under torch.no_grad()"))
            _log.warning("chunkmem: %s: p.grad was None until this step (chunkmem keeps the gradients in their chunks, "
                         "and this step used them), so what read p.grad meanwhile saw no gradient (torch.nn.utils."
                         "clip_grad_norm_ clipped nothing); clip with model.clip_grad_norm_, which reads the chunks, "
                         "%s", why, fix)
        runtime.grads.hidden_by_forward -= hidden  # another model's, a manager's, are its optimizer's to warn of

    def _check_still_frozen(self) -> None:
        """A parameter frozen at prepare has no gradient, master or state chunk: unfreezing it later would
        train nothing, silently."""
        for record in self.runtime.store.records.values():
            if not record.group.trainable and record.param.requires_grad:
                raise ValueError(f"parameter {record.name} was frozen (requires_grad=False) when chunkmem.prepare "
                                 "laid out the chunks and requires a gradient now: chunkmem keeps no gradient or "
                                 "optimizer state for it, so it would never change. Set requires_grad before "
                                 "prepare (prepare a fresh copy of the model to train it)")

    def _step_group(self, chunk_group: ChunkGroup, members: list[ParamRecord],
                    group_of: dict[ParamRecord, dict], inv_scale: float, together: Together) -> bool:
        """Update one chunk group now, or add it to `together` (True)."""
        runtime, on_device = self.runtime, self.runtime.placer.homed(chunk_group.index)
        needed = dict.fromkeys([chunk_group.param, chunk_group.grad, chunk_group.master,
                                *(chunk_group.chunks[k] for k in self.rule.states)])
        runtime.placer.access(list(needed), "optim", chunk_group.index)
        # With a disk tier, master and states stay in host memory while they update, then are written back.
        with runtime.host_cache.using(needed) if runtime.host_cache is not None else contextlib.nullcontext():
            return self._update(chunk_group, members, group_of, inv_scale, on_device, together)

    def _update(self, chunk_group: ChunkGroup, members: list[ParamRecord], group_of: dict[ParamRecord, dict],
                inv_scale: float, on_device: bool, together: Together) -> bool:
        runtime = self.runtime
        lowp = "master" in chunk_group.chunks
        host_native = self.native is not None and not on_device
        # One param group at one step count: one pass of the native kernel, or one update of the packed range.
        uniform = self.uniform(chunk_group, members, group_of) if lowp or host_native else None
        numel = part = sum(r.slot.numel for r in members)
        if on_device and lowp:
            room = self._room_on_device(chunk_group, numel, sliceable=uniform is not None)
            # No room (0): this step on the host, as a streamed group's; its chunks come back when next needed.
            on_device, part = room > 0, room or numel
            host_native = self.native is not None and not on_device
        if host_native:
            self._native_step(chunk_group, self.spans(chunk_group, members, group_of, uniform), inv_scale)
            return False
        grads = runtime.data.grads(members, on_device)
        master = runtime.data.writable(chunk_group.master, on_device)
        states = {k: runtime.data.writable(chunk_group.chunks[k], on_device) for k in self.rule.states}
        later = False
        if lowp and uniform is not None:
            # One update of the chunk's packed range (layout.pack: members from offset 0, in order) rather than one
            # per parameter: Adam and SGD are elementwise, so the bits are the same, for a few launches a group
            # rather than a few a parameter.
            self._update_flat(members, uniform, grads, inv_scale, master, states, part)
        else:
            grads = unpacked(widened(grads, inv_scale), grads) if lowp else grads
            later = self._update_each(chunk_group, members, group_of, grads, master, states, on_device, together)
        if lowp:
            runtime.data.writable(chunk_group.param, on_device).copy_(master)
        return later

    def _update_each(self, chunk_group: ChunkGroup, members: list[ParamRecord], group_of: dict[ParamRecord, dict],
                     grads: list[torch.Tensor], master: torch.Tensor, states: dict[str, torch.Tensor],
                     on_device: bool, together: Together) -> bool:
        """The update rule over each param group's parameters, as views; added to `together` instead (True) for
        an fp32 group (rules.py's Note on updates made together)."""
        # A low-precision group updates now, so that one fp32 copy of a gradient is alive at a time.
        later = "master" not in chunk_group.chunks and self.runtime.host_cache is None
        if later and on_device:
            together.chunks.update([chunk_group.grad, chunk_group.master,
                                    *(chunk_group.chunks[k] for k in self.rule.states)])
        grad_of = dict(zip(members, grads))
        for group in {id(group_of[r]): group_of[r] for r in members}.values():
            subset = [r for r in members if group_of[r] is group]
            lists = ([r.view(master) for r in subset], [grad_of[r] for r in subset],
                     {k: [r.view(flat) for r in subset] for k, flat in states.items()}, [self.steps[r] for r in subset])
            if later:
                together.add(group, *lists)
            else:
                self.rule.update(group, *lists)
        return later

    def _reserve_run(self, together: Together) -> int | None:
        """Room for the temporaries of the fp32 run updated together on the device (rules.py's Note on updates made
        together and planning.py's on update scratch), reserved before any of it changes: it cannot be redone once
        begun. None: room for the whole run. Where the budget has not that, room for those of its largest parameter, and
        the run updates a parameter per call (the number returned: its size); where not even that, for slices of
        its contiguous parameters, halved in multiples of SLICE_ALIGN down to a 64th of the largest (the update is
        elementwise, so the bits are the same; vector tails as in one call). Where it has none of these, a clear
        error, the run's parameters as they were."""
        segment_for, residency = self.runtime.device.segment_for, self.runtime.residency
        runs = [(group, params) for group, params, *_ in together.lists.values()]
        largest = part = max(p.numel() for _, params in runs for p in params)
        try:
            residency.reserve([n for group, params in runs for n in run_scratch(group, params, segment_for)],
                              together.chunks)
            # torch's single-tensor loop keeps a parameter's last temporary alive while the next one allocates
            # its two: in one call, three blocks, in whatever holes the two reserved leave (the budget sweep's
            # ResNet at its whole model data ran out so); a call per parameter frees all of them in between.
            return largest if any(single_tensor(group, params) for group, params in runs) else None
        except torch.OutOfMemoryError:
            pass
        while True:
            one = max((run_scratch(group, [p], segment_for, part) for group, params in runs for p in params), key=sum)
            try:  # chunks give way for the largest parameter's; its slices try the room left
                residency.reserve(one, together.chunks, fall_back=part == largest)
                break
            except torch.OutOfMemoryError as error:
                if part <= max(largest // 64, SLICE_ALIGN):
                    raise MemoryBudgetError(
                        f"the optimizer step's temporaries on the device ({sum(one)} bytes for {part} elements of "
                        f"an fp32 parameter updated there) do not fit beside the chunks in Config.device_memory="
                        f"{self.runtime.limit} bytes; those parameters were not updated. Raise device_memory, or "
                        "construct the optimizer with fused=True (torch's fused kernel allocates no temporaries). "
                        f"The allocator said: {error}") from error
                part = -(-part // (2 * SLICE_ALIGN)) * SLICE_ALIGN  # half, in whole vectors (as _room_on_device)
        residency.stats.update_runs_split += 1
        return part

    def _room_on_device(self, chunk_group: ChunkGroup, numel: int, sliceable: bool) -> int:
        """How many of the `numel` elements of a homed low-precision group's update to make at a time on the device
        (planning's Note on update scratch); 0: none, the update runs on the host. It allocates, and cannot be
        redone once begun, so its blocks are reserved first (Residency.reserve): for the whole range where it fits,
        else, if `sliceable` (one param group, one step count: a packed range), for slices of it, halved until they
        fit in the holes this step's allocations left (the last size that fitted is tried first next step), down to
        a 64th of the range, which evicts chunks to fit. Without a budget, nothing to reserve: a launch-bound step
        pays nothing for it."""
        if self.runtime.config.device_memory is None:
            return numel
        residency, keep = self.runtime.residency, chunk_group.chunks.values()
        part = min(numel, self._parts.get(chunk_group.index, numel)) if sliceable else numel
        while sliceable and part > max(numel // 64, SLICE_ALIGN):
            try:
                residency.reserve(update_scratch(part), keep, fall_back=False)
                break
            except torch.OutOfMemoryError:
                part = -(-part // (2 * SLICE_ALIGN)) * SLICE_ALIGN  # half, in whole vectors
        else:
            try:
                residency.reserve(update_scratch(part), keep)
            except torch.OutOfMemoryError:
                residency.stats.updates_moved_to_host += 1
                return 0
        self._parts[chunk_group.index] = part
        residency.stats.updates_sliced += part < numel
        return part

    def _update_flat(self, members: list[ParamRecord], group: dict, grads: list[torch.Tensor], inv_scale: float,
                     master: torch.Tensor, states: dict[str, torch.Tensor], part: int) -> None:
        """The update rule over the packed range of a chunk group whose `members` all step in `group`, at one step
        count, `part` elements at a time, each slice's gradients widened to fp32 as it comes (`grads`: the members',
        low precision): the update is elementwise, so slices give the same bits."""
        used = sum(g.numel() for g in grads)
        counter = self.steps[members[0]]
        for cut in same_step_slices(used, part, counter):
            wide = widened(grads if part >= used else pieces(grads, cut.start, cut.stop), inv_scale)
            self.rule.update(group, [master[cut]], [wide], {k: [flat[cut]] for k, flat in states.items()}, [counter])
        if len(members) > 1:
            torch._foreach_copy_([self.steps[r] for r in members[1:]], [counter] * (len(members) - 1))

    def uniform(self, chunk_group: ChunkGroup, members: list[ParamRecord],
                 group_of: dict[ParamRecord, dict]) -> dict | None:
        """The one param group of a chunk whose parameters all step now, at one step count; else None."""
        groups = {id(group_of[r]) for r in members}
        steps = {self.steps[r].item() for r in members}
        if len(members) != len(chunk_group.members) or len(groups) != 1 or len(steps) != 1:
            return None
        return group_of[members[0]]

    def spans(self, chunk_group: ChunkGroup, members: list[ParamRecord], group_of: dict[ParamRecord, dict],
              uniform: dict | None) -> list[Span]:
        """A chunk group's stepping `members` (in chunk order, as layouts pack them) as runs of parameters that lie end
        to end in the chunk, in one param group at one step count, for the native kernel, which updates a range: the
        whole chunk where they all step in param group `uniform` (`self.uniform`); else Hugging Face's decay and
        no-decay param groups (chunkmem finetune's too) alternate within a chunk, weight and bias, and such a chunk
        updated through torch.optim instead, a few passes over its bytes rather than one. Where every parameter steps,
        the last run takes the chunk's tail too, as one pass over the whole chunk does."""
        if uniform is not None:
            return [(0, chunk_group.master.numel, uniform, members)]
        spans: list[Span] = []
        for record in members:
            end = record.slot.offset + record.slot.numel
            if spans:
                start, last_end, group, run = spans[-1]
                if group_of[record] is group and last_end == record.slot.offset and \
                        self.steps[record].item() == self.steps[run[-1]].item():
                    spans[-1] = (start, end, group, [*run, record])
                    continue
            spans.append((record.slot.offset, end, group_of[record], [record]))
        if len(members) == len(chunk_group.members):
            start, _, group, run = spans[-1]
            spans[-1] = (start, chunk_group.master.numel, group, run)
        return spans

    def _found_inf(self, group_of: dict[ParamRecord, dict]) -> bool:
        """Whether a gradient of this optimizer's parameters is inf or nan, as torch's GradScaler.unscale_(optimizer)
        looks at its own alone: a gradient outside it, which its zero_grad leaves, once overflowed skipped every step
        after (fp16 BERT with some biases left out of the optimizer never stepped), as did another model's under a
        manager. One read of the verdicts per device: a read per group waited for the device at each."""
        data = self.runtime.data
        finite: list[torch.Tensor] = []
        for group in self.runtime.groups():
            mine = [r for r in group.members if r in group_of and r.grad_state is TensorState.HOLD]
            if not mine or group.grad.state is ChunkState.FREE:
                continue
            if group.grad.lending:  # autograd's tensors, left lent: `p.grad` zeroed in place is still the chunk's
                parts = data.grads(mine, on_device=True)
            else:
                flat = data.read(group.grad)
                parts = [flat] if all(r in group_of for r in group.members) else [r.view(flat) for r in mine]
            finite.extend(torch.isfinite(part).all() for part in parts)
        devices = {verdict.device for verdict in finite}
        return not all(torch.stack([v for v in finite if v.device == device]).all().item() for device in devices)

    def adam_args(self, members: list[ParamRecord], group: dict, inv_scale: float) -> dict[str, Any]:
        """What the native Adam kernel is given for `members`, a span's, which all step in param group `group`."""
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), weight_decay=group["weight_decay"], maximize=group["maximize"],
                    grad_scale_inv=inv_scale, beta1=beta1, beta2=beta2, eps=group["eps"],
                    decoupled=group.get("decoupled_weight_decay", False), step=int(self.steps[members[0]].item()) + 1)

    def _native_step(self, chunk_group: ChunkGroup, spans: list[Span], inv_scale: float) -> None:
        """One pass of the native kernel for each of the chunk's `spans` (one over the whole chunk where its parameters
        all step in one param group): fp32 master, states and the cast copy; or the update made ahead of the step,
        adopted (ahead.py). The update is elementwise, so a range gives the bits of the whole."""
        runtime = self.runtime
        flats = {"grad": runtime.residency.to_host(chunk_group.grad),
                 "master": runtime.data.writable(chunk_group.master, False),
                 **{k: runtime.data.writable(chunk_group.chunks[k], False) for k in self.rule.states}}
        param_out = runtime.data.writable(chunk_group.param, False) if "master" in chunk_group.chunks else None
        if param_out is not None:
            flats["param"] = param_out
        if self.rule.update is adam:
            ranges: list[native.Range] = [(start, end, self.adam_args(members, group, inv_scale))
                                          for start, end, group, members in spans]
            ahead = runtime.ahead
            if ahead is None or param_out is None or not ahead.adopt(chunk_group, ranges, flats["grad"], param_out):
                native.adam_ranges(ranges, flats["master"], flats["grad"], flats["exp_avg"], flats["exp_avg_sq"],
                                   param_out)
        else:
            for start, end, group, members in spans:
                part = {k: flat[start:end] for k, flat in flats.items()}
                step = int(self.steps[members[0]].item()) + 1
                common = dict(lr=float(group["lr"]), weight_decay=group["weight_decay"], maximize=group["maximize"],
                              grad_scale_inv=inv_scale)
                # Groups share one layout of state chunks: a group without momentum leaves its buffer unused.
                buffer = part.get("momentum_buffer") if group["momentum"] else None
                native.sgd_step(part["master"], part["grad"], buffer, part.get("param"), momentum=group["momentum"],
                                dampening=group["dampening"], nesterov=group["nesterov"], first_step=step == 1,
                                **common)
        for _, _, group, members in spans:
            if self.rule.update is adam or group["momentum"]:  # SGD counts its steps with momentum (sgd)
                torch._foreach_add_([self.steps[r] for r in members], 1)
        self.native_steps += 1

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled or deep-copied, it kept the parameters its model lends, its states in that model's chunks: the copy
        could not step, and read no state."""
        raise TypeError("pickling or copying an optimizer chunkmem prepared (torch.save(optimizer), copy.deepcopy): "
                        "save optimizer.state_dict() or chunkmem.save_checkpoint(...) instead")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of this optimizer's parameters only, as torch.optim does (`model.zero_grad()`: all)."""
        self.runtime.zero_grad(set_to_none, only=set(self.group_of()))

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format, as a Hugging Face Trainer or accelerate saves it with torch.save: the states of each
        parameter that has stepped (`state`: fp32 copies on the host) under its index in the param groups, the
        groups' options, and under fp16 the loss scaler's state (a key torch.optim's own loading ignores). Not under
        ZeRO, where each rank holds a share of every state (chunkmem.save_checkpoint). Its hooks run as torch.optim's."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        index: dict[int, int] = {}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index.setdefault(id(p), len(index)) for p in group["params"]]}
                  for group in self.param_groups]
        state = {index[id(p)]: self._states.snapshot(p) for group in self.param_groups for p in group["params"]
                 if p in self.state}
        scaler = self.runtime.scaler
        out = {"state": state, "param_groups": groups,
               **({LOSS_SCALER: dataclasses.asdict(scaler)} if scaler is not None else {})}
        return _through(self._optimizer_state_dict_post_hooks, self, out)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's: `state_dict` (this optimizer's `state_dict()`, or a plain one's over the same parameters in
        the same groups) gives each trainable parameter its step count and states, those it lacks starting afresh,
        each group its options (keys it lacks are dropped), and the loss scaler its state where it has one. Checked
        whole before anything changes (but by its pre-hooks, which run first, as torch.optim's). Not under ZeRO
        (chunkmem.load_checkpoint)."""
        self._states._not_sharded()
        state_dict = _through(self._optimizer_load_state_dict_pre_hooks, self, state_dict.copy())
        self.group_of()  # every parameter of the groups has a step count, and is this model's
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the loaded state dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}: load one saved from an optimizer over the same groups")
        records = self.runtime.store.records
        by_index, merged = {}, []
        for number, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"parameter group {number} of the loaded state dict has {len(saved['params'])} "
                                 f"parameters, this optimizer's {len(group['params'])}")
            by_index.update({index: records[param] for index, param in zip(saved["params"], group["params"])})
            # torch.optim's: the saved group's options replace the group's (a key it lacks is dropped, an option the
            # optimizer has is at its default), its parameters and their names stay
            names = {"param_names": group["param_names"]} if "param_names" in group else {}
            merged.append({**self.defaults, **names, **saved, "params": group["params"]})
            check_flags(self.wrapped_type.__name__, merged[-1])  # amsgrad, which the chunks have no room for
            self._check_momentum(merged[-1])
        steps = dict.fromkeys(self.steps, 0.0)  # one with no state saved starts afresh, as torch.optim's loading
        states = {}
        for index, values in saved_state.items():
            record = by_index.get(index)
            if record is None:
                raise ValueError(f"the loaded state dict has states for parameter {index}, which none of its "
                                 "parameter groups holds")
            # Frozen at prepare: it never steps, and has no state chunks. Or torch's SGD stepped it in a group without
            # momentum, which keeps None: it starts afresh.
            if not record.group.trainable or ("momentum_buffer" in values and values["momentum_buffer"] is None):
                continue
            for kind in self.runtime.store.families.saved:
                value = values.get(kind)
                if not isinstance(value, torch.Tensor) or value.shape != record.shape or \
                        not value.dtype.is_floating_point or value.is_meta:
                    raise ValueError(f"the loaded state of parameter {index} ({record.name}, {tuple(record.shape)}) "
                                     f"has {kind}={_described(value)}: expected a float tensor of its shape")
                states[record, kind] = value
            step = values.get("step", None if self.steps_adam else 1)  # SGD keeps none: 1, its momentum buffer is made
            if not is_step_count(step):
                raise ValueError(f"the loaded state of parameter {index} ({record.name}) has step={_described(step)}: "
                                 "expected a step count (a whole number, at least 0)")
            steps[record] = float(step)
        scaler, saved_scaler = self.runtime.scaler, state_dict.get(LOSS_SCALER)
        problem = None if scaler is None or saved_scaler is None else scaler.problem(saved_scaler)
        if problem is not None:
            raise ValueError(f"the loaded state dict's {LOSS_SCALER} is {saved_scaler!r}: {problem}")
        self.set_states(steps, states)
        for group, options in zip(self.param_groups, merged):
            group.clear()
            group.update(options)
        if scaler is not None and saved_scaler is not None:
            scaler.__dict__.update(saved_scaler)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
