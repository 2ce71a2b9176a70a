"""`chunkmem.Manager`: several models (a trained policy, a frozen reference, a reward model) under one device
budget, one host budget, one warm-up record and one plan.

[Note: one runtime for several models]
A manager lays every model it prepares into one store, the models side by side in a `ModelSet`, so one
residency keeps all their chunks within one budget and one placer records and plans the accesses of all of
them in the order the step runs them: a reference model's forward is more accesses in the policy's step, and
a chunk of one model leaves for a chunk of another when the plan says the other is needed sooner. A step ends
once every trained model's optimizer has stepped (an actor's and a critic's), so one plan covers both updates
(`Runtime.optimizer_done`); with one trained model, at its optimizer's `step()`, as for one model.

Each `prepare` builds the runtime again over every model so far, their chunks laid out anew from the values
they hold now (and the step counts and states of an optimizer that has some: a checkpoint loaded between two
prepares), and points the models and optimizers returned before at it. So the budget check of the last
`prepare` sees all the models and refuses a budget too small for them there, with the bytes needed; and a
`prepare` that raises leaves every model as it was (the earlier ones on the runtime they had). Building again
is allowed only before the first forward of a step: afterwards the record, the plan and optimizer states exist.

A model prepared without an optimizer is frozen (its parameters stop requiring gradients, so its chunks hold
parameters only) and scores in the step: its forwards belong to the plan, as a reference model's do in every
step. A trained model's forwards without gradients (evaluation, `generate`) are served off the plan.
Trained models share the optimizer's families (chunks/family.py): the same torch.optim class, with the same
states. Under ZeRO (a process group, as `chunkmem.prepare` takes it) every rank prepares the same models in the
same order: each `prepare` gathers the values laid out before, a collective. Not yet: fp16 loss scaling with
more than one trained model.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import nn
from torch.optim import Optimizer

from chunkmem.checkpoint import optimizer_states, steps_by_name
from chunkmem.chunks.family import Families
from chunkmem.chunks.store import ModelSet, outside_inference_mode, put_data
from chunkmem.config import Config
from chunkmem.memory.device import collect_garbage
from chunkmem.runtime.hooks import Hooks
from chunkmem.runtime.optim import ChunkOptimizer, retire
from chunkmem.runtime.rules import Rule, rule_for
from chunkmem.runtime.reporting import report_device
from chunkmem.runtime.runtime import Runtime
from chunkmem.wrapper import ChunkedModel, Snapshot, check_fresh, shard_group
from chunkmem.zero.agreement import fingerprints


class Manager:
    """Prepares several models into one runtime (the Note above): `model, opt = cm.prepare(model, opt)` for a
    trained model, `ref = cm.prepare(ref)` for a frozen one."""

    def __init__(self, config: Config | None = None, group: Any = None) -> None:
        """group: the process group to shard the models' data over, as `chunkmem.prepare` takes it."""
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"chunkmem.Manager's config is {type(config).__name__} {config!r:.80}: expected a "
                            "chunkmem.Config (chunkmem.Config(**options) makes one from a dict of its fields)")
        self.config = config or Config()
        self.group = shard_group(group, self.config)
        self.models: list[ChunkedModel] = []
        self.optimizers: list[ChunkOptimizer | None] = []
        self.rule: Rule | None = None  # the trained models' optimizers' (they share their chunk families)
        self.runtime: Runtime | None = None

    @overload
    def prepare(self, model: nn.Module) -> ChunkedModel: ...

    @overload
    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[ChunkedModel, ChunkOptimizer]: ...

    @outside_inference_mode
    def prepare(self, model: nn.Module, optimizer: Optimizer | None = None
                ) -> ChunkedModel | tuple[ChunkedModel, ChunkOptimizer]:
        check_fresh(model, optimizer)
        rule = rule_for(optimizer) if optimizer is not None else None
        self._check_can_add(model, rule)
        before = Snapshot.of(model)
        earlier = [m.module for m in self.models]
        stepped = [_stepped(o) for o in self.optimizers]
        values = _off_device(self.runtime) if self.runtime is not None else {}
        views = Snapshot.of(ModelSet(earlier))
        hooked: list[ChunkedModel] = []
        try:
            for param, value in values.items():  # the new layout reads them
                put_data(param, value)
            if optimizer is None:
                model.requires_grad_(False)
            trained = rule or self.rule
            families = Families.declare(self.config.torch_dtype, trained.states if trained else ())
            models = ModelSet([*earlier, model])
            optimizers = [o for o in [*self.optimizers, optimizer] if o is not None]
            runtime = Runtime(models, self.config, families, self.group, fingerprints(models, self.config, *optimizers))
            hooked.append(ChunkedModel(model, runtime))
            prepared = ChunkOptimizer(runtime, optimizer, rule, model) if optimizer is not None and rule is not None \
                else None
        except BaseException:  # a prepare that raises changes nothing: earlier models keep their runtime
            for done in hooked:
                done.hooks.remove()
            before.restore()
            views.restore()
            if self.runtime is not None:  # their parameters view host payloads again, which uploads may still read
                self.runtime.fence_params()
            raise
        wrapped = hooked[0]
        if self.runtime is not None and self.runtime.scaler is not None and runtime.scaler is not None:
            runtime.scaler.__dict__.update(self.runtime.scaler.__dict__)
        for earlier_model, earlier_optimizer, state in zip(self.models, self.optimizers, stepped):
            earlier_model.hooks.remove()
            earlier_model.runtime = runtime
            earlier_model.hooks = Hooks(earlier_model.module, runtime)
            report_device(earlier_model.module, runtime.device)
            if earlier_optimizer is None:
                continue
            earlier_optimizer.move_to(runtime)
            if state is not None:  # by parameter: the records are the new runtime's
                records, (steps, states) = runtime.store.records, state
                earlier_optimizer.set_states({records[p]: n for p, n in steps.items()},
                                             {(records[p], kind): v for (p, kind), v in states.items()})
        self.models.append(wrapped)
        self.optimizers.append(prepared)
        self.rule = trained
        for member, member_optimizer in zip(self.models, self.optimizers):
            member.hooks.own = frozenset(runtime.store.records[p] for p in member.module.parameters())
            member.hooks.scores_in_step = member_optimizer is None
        runtime.optimizers = sum(o is not None for o in self.optimizers)
        self.runtime = runtime
        collect_garbage()  # the runtime before, and its device memory, go now
        if optimizer is not None and prepared is not None:
            retire(optimizer, prepared)
        return wrapped if prepared is None else (wrapped, prepared)

    def memory_stats(self) -> dict[str, int]:
        """What `ChunkedModel.memory_stats` gives, for all the models together (they share one runtime)."""
        if self.runtime is None:
            raise RuntimeError("this chunkmem.Manager has prepared no model yet")
        return self.runtime.memory_stats()

    def _check_can_add(self, model: nn.Module, rule: Rule | None) -> None:
        runtime = self.runtime
        if runtime is not None and (runtime.step_count or runtime.placer.events):
            raise RuntimeError("chunkmem.Manager.prepare after the models started running: prepare every model "
                               "before the first forward (one plan covers them all, and is laid out at prepare)")
        if rule is not None and self.rule is not None:
            if rule.states != self.rule.states:
                raise ValueError(f"this optimizer keeps {list(rule.states) or 'no states'}, the one this manager "
                                 f"trains with keeps {list(self.rule.states) or 'none'}: the trained models of one "
                                 "manager share their chunk families, so give them the same torch.optim class "
                                 "(and momentum for SGD), or prepare this model with a manager of its own")
            if self.config.dtype == "fp16":
                raise NotImplementedError("fp16 with more than one trained model per chunkmem.Manager: their "
                                          "optimizers would share one loss scaler; use dtype='bf16'")
        ours = {p for m in self.models for p in m.module.parameters()}
        shared = next((n for n, p in model.named_parameters() if p in ours), None)
        if shared is not None:
            raise ValueError(f"parameter {shared} belongs to a model this manager prepared already: models of one "
                             "manager share no parameters (prepare a copy, copy.deepcopy)")


Stepped = tuple[dict[nn.Parameter, float], dict[tuple[nn.Parameter, str], torch.Tensor]]


def _stepped(optimizer: ChunkOptimizer | None) -> Stepped | None:
    """An earlier optimizer's step counts and states by parameter, where it has steps (a checkpoint loaded before
    this prepare), for the new layout to start from; None where it has none. Under ZeRO a collective, as every rank
    prepares the same models in the same order."""
    if optimizer is None:
        return None
    counts = steps_by_name(optimizer)
    kept = {r for r in optimizer.steps if counts[r.name] > 0 or r in optimizer.restarted}  # those with states
    if not kept:
        return None
    states = {(record.param, kind): value for (record, kind), value in optimizer_states(optimizer).items()
              if record in kept}
    return {record.param: counts[record.name] for record in optimizer.steps}, states


def _off_device(runtime: Runtime) -> dict[nn.Parameter, torch.Tensor]:
    """Every parameter's fp32 value in `runtime`, for a new layout to read: a view of its chunk's host payload, once
    every chunk has left the device, so that their memory is free for the new one (the runtime stays usable). A
    value given other storage since (`p.data = t`) goes into its chunks first."""
    runtime.adopt_data()
    for chunk in list(runtime.residency.resident.values()):
        runtime.residency.evict(chunk)
    runtime.device.arena.release()
    if runtime.shards is not None:  # other ranks own some: gathered, a collective every rank makes at this prepare
        return {record.param: value for record, value in runtime.data.values().items()}
    return {param: record.view(runtime.residency.to_host(record.group.master))
            for param, record in runtime.store.records.items()}
