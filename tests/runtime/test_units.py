"""Access units (units.py's Note): the outermost called module whose parameters lie in one chunk (or two, where both
are a small share of the budget) acquires them all, the modules inside it nothing; one inside a unit that runs outside
a forward acquires its subtree's itself."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import chunkmem
from chunkmem.runtime.units import UNIT_CHUNK_SHARE, access_units
from tests import zoo
from tests.helpers import least_accepted, param_bytes, prepared, train

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


@pytest.fixture(autouse=True)
def units_at_any_budget(monkeypatch):
    """These tiny models stream only under budgets a few chunks large: units there too (runtime's UNIT_CHUNK_SHARE)."""
    monkeypatch.setattr("chunkmem.runtime.runtime.UNIT_CHUNK_SHARE", 1.0)


def _chunks(cm: nn.Module, module: nn.Module) -> set[str]:
    return {cm.runtime.store.records[p].group.param.name for p in module.parameters()}


@pytest.mark.parametrize("arch", [a for a in zoo.available() if a.name in ("llama", "t5", "swin")],
                         ids=lambda a: a.name)
def test_every_parameter_is_acquired_once_on_its_path_by_a_unit_in_one_chunk_or_its_own_module(arch):
    model = arch.build()
    largest = max(p.numel() for p in model.parameters())
    cm, _ = prepared(model, ADAMW, device_memory=param_bytes(model), chunk_size=3 * largest)
    runtime, names = cm.runtime, {m: n for n, m in cm.module.named_modules()}
    assert len(runtime.store.groups) > 1, "chunks enough that units are smaller than the model"

    def walk(module: nn.Module, held: frozenset[nn.Parameter], seen: set[nn.Module]) -> None:
        if module in seen:  # a shared module: acquired where it is reached first
            return
        seen.add(module)
        acquired = set(runtime.module_records.get(module, ()))
        params = {runtime.store.records[p] for p in module.parameters(recurse=False)}
        if module in runtime.idle_modules:  # what it would acquire run on its own: its subtree's
            assert params <= held or not list(module.parameters()), names[module]
            assert acquired == {runtime.store.records[p] for p in module.parameters()}, names[module]
            acquired = set()
        else:
            assert params <= acquired, f"{names[module]} acquires its own parameters"
            assert not acquired & held, f"{names[module]} acquires what a module around it holds"
            if len(acquired) > len(params):  # a unit: two chunks at most (any budget here), its parent's span more
                assert len(_chunks(cm, module)) <= 2, names[module]
        for child in module.children():
            walk(child, held | acquired, seen)

    walk(cm.module, frozenset(), set())
    units = [m for m, records in runtime.module_records.items()
             if m not in runtime.idle_modules and len(records) > len(list(m.parameters(False)))]
    assert units and runtime.idle_modules


@pytest.mark.parametrize("arch", [a for a in zoo.available()
                                  if a.name in ("llama", "gpt2", "t5", "mixtral", "bert", "vit")], ids=lambda a: a.name)
def test_a_streaming_architecture_in_units_trains_on_plain_pytorchs_bits(arch):
    model, batches = arch.build(), arch.batches(4)
    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, zoo.loss)
    largest = max(p.numel() for p in model.parameters())
    config = dict(chunk_size=2 * largest)
    cm, opt = prepared(model, ADAMW, device_memory=least_accepted(model, ADAMW, low=param_bytes(model) // 2, **config),
                       **config)
    assert train(cm, opt, batches, zoo.loss) == expected
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert cm.runtime.idle_modules and cm.memory_stats()["evictions"] > 0
    assert cm.runtime.lean_allowed, "every parameter acquired by a unit or its own module: none fetched by the mode"


class Block(nn.Module):
    """A pre-norm MLP block whose MLP is checkpointed on its own (finer than a Hugging Face layer's checkpoint)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.mlp, self.norm(x), use_reentrant=False)


def _blocks(width: int = 16, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), *[Block(width) for _ in range(depth)], nn.Linear(width, 1))


def test_modules_inside_a_unit_recomputed_in_backward_and_called_on_their_own_hold_plain_pytorchs_bits():
    model = _blocks()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(4)]

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    ref = copy.deepcopy(model)
    expected = train(ref, ADAMW(ref.parameters()), batches, loss)
    config = dict(chunk_size=2 * sum(p.numel() for p in model[1].parameters()))  # about two blocks a chunk
    # Two chunks: an MLP across two is re-computed whole, and its backward holds both (the next test)
    budget = least_accepted(model, ADAMW, **config) + 4 * config["chunk_size"]
    cm, opt = prepared(model, ADAMW, device_memory=budget, **config)
    assert train(cm, opt, batches, loss) == expected
    runtime = cm.runtime
    inner = [b.mlp for b in cm.module[1:-1] if b.mlp in runtime.idle_modules]
    assert inner, "some blocks are units: their checkpointed MLP acquires nothing in a forward"
    assert runtime.memory_stats()["evictions"] > 0, "chunks must move"
    # Recomputed in backward, each acquired its parameters: none was left for the torch-function mode to fetch.
    assert runtime.lean_allowed and runtime.lean_forwards > 0
    chunk_of = {mlp: runtime.store.records[mlp[0].weight].group.param for mlp in inner}
    off = {chunk_of[mlp].name: mlp for mlp in inner if not chunk_of[mlp].state.on_device}  # one a chunk
    assert off, "a unit's chunk is off the device"
    with torch.no_grad():  # called on its own, outside forward: its chunk comes to the device
        for mlp in off.values():
            plain = ref.get_submodule(next(n for n, m in cm.module.named_modules() if m is mlp))
            x, uploaded = torch.randn(2, 16, generator=gen), runtime.memory_stats()["h2d_bytes"]
            assert torch.equal(mlp(x), plain(x))
            assert runtime.memory_stats()["h2d_bytes"] > uploaded
    assert all(torch.equal(cm.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_a_re_computation_with_no_room_for_its_next_chunk_says_checkpointing_holds_the_others():
    """At the least budget prepare accepts, one chunk: an MLP checkpointed in a forward prepare cannot see, whose
    parameters span two chunks, holds the first through its backward while its re-computation needs the second. It
    trained with both on the device, over the budget (placement.py's `_floor`); the error said only which chunks were
    in use (bug hunt): it names the re-computation and what holds them."""
    model = _blocks()
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    config = dict(chunk_size=2 * sum(p.numel() for p in model[1].parameters()))
    cm, opt = prepared(model, ADAMW, device_memory=least_accepted(model, ADAMW, **config), **config)
    with pytest.raises(chunkmem.MemoryBudgetError, match=r"held by chunks in use .*\. This was backward re-computing "
                       r"\d\.mlp\.\d under activation checkpointing: .*checkpointing smaller"):
        train(cm, opt, batches, lambda m, x: m(x).square().mean())


class Moments:
    wants_moments = True

    def __init__(self) -> None:
        self.where: list[str] = []

    def moment(self, moment) -> None:
        if moment.name == "pre_forward":
            self.where.append(moment.where)

    def moved(self, move) -> None:
        pass


def test_a_steady_step_has_moments_inside_units_for_a_trace_only_and_the_same_accesses_either_way():
    model = _blocks()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, generator=gen) for _ in range(3)]
    config = dict(chunk_size=2 * sum(p.numel() for p in model[1].parameters()))
    budget = least_accepted(model, ADAMW, **config) + 4 * config["chunk_size"]  # as the test above's
    accesses, moments = [], []
    for traced in (False, True):
        cm, opt = prepared(model, ADAMW, device_memory=budget, **config)
        train(cm, opt, batches, lambda m, x: m(x).sum())  # the warm-up and steady steps
        assert cm.runtime.placer.steady and cm.runtime.idle_modules
        observer = Moments()
        if traced:
            cm.runtime.observers.append(observer)
        cm(batches[0]).sum().backward()
        accesses.append([(e.kind, e.chunks) for e in cm.runtime.placer.events])
        moments.append(cm.runtime.moment_index)
        modules = {n or type(cm.module).__name__ for n, _ in cm.module.named_modules()}
        assert (set(observer.where) == modules) == traced, observer.where
    assert accesses[0] == accesses[1] and moments[0] < moments[1]


def test_a_model_in_one_chunk_is_one_unit_and_in_a_chunk_per_parameter_each_module_acquires_its_own():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)), nn.ModuleList([nn.Linear(4, 4)]))
    acquires, idle = access_units(model, lambda p: "one")
    assert acquires[model] == list(model.parameters()) and idle == set(model.modules()) - {model}
    assert acquires[model[2]] == list(model[2].parameters())  # run on its own
    acquires, idle = access_units(model, lambda p: "list" if p in set(model[3].parameters()) else str(id(p)))
    assert acquires[model[0]] == list(model[0].parameters()) and acquires[model[1]] == [] and acquires[model[2]] == []
    assert acquires[model[2][0]] == list(model[2][0].parameters()) and not idle & {*model[:3], model[2][0]}
    assert acquires[model[3]] == [] and acquires[model[3][0]] == list(model[3][0].parameters())  # a list is not called
    other = nn.Linear(4, 4)
    shared = nn.Sequential(model[0], nn.Sequential(model[0], nn.Linear(4, 4)), other)  # model[0] met first on its own
    acquires, idle = access_units(shared, lambda p: "other" if p in set(other.parameters()) else "one")
    assert shared[1] not in idle and shared[1][1] in idle and model[0] not in idle  # a unit wherever it is called


class _Using(nn.Module):
    """`shared` after modules of its own (`width` of them), in one forward."""

    def __init__(self, shared: nn.Module, width: int) -> None:
        super().__init__()
        self.own = nn.Sequential(*[nn.Linear(16, 16) for _ in range(width)])
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.own(x)))


def test_no_unit_over_two_chunks_holds_a_module_called_elsewhere_too():
    # Idle inside such a unit, the shared module acquired nothing where the other module called it: the torch-function
    # mode fetched it there, and forwards ran lean no more (helper-72; a block Zamba2 shares between its layers).
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    model = nn.Sequential(_Using(shared, 1), _Using(shared, 3), nn.Linear(16, 1))
    cm, opt = prepared(model, ADAMW, chunk_size=272, device_memory=272 * 4 * 5)  # a Linear a chunk
    assert len(_chunks(cm, cm.module[0])) == 2 and cm.module[0] not in cm.runtime.idle_modules
    gen = torch.Generator().manual_seed(1)
    train(cm, opt, [torch.randn(4, 16, generator=gen) for _ in range(4)], lambda m, x: m(x).square().mean())
    assert cm.runtime.lean_allowed and cm.runtime.lean_forwards > 0 and cm.memory_stats()["evictions"] > 0


def test_a_unit_spans_two_chunks_only_where_both_are_a_small_share_of_the_budget(monkeypatch):
    monkeypatch.setattr("chunkmem.runtime.runtime.UNIT_CHUNK_SHARE", UNIT_CHUNK_SHARE)  # the rule itself
    model = _blocks()
    block = sum(p.numel() for p in model[1].parameters())
    config = dict(chunk_size=3 * block // 2)  # a block and a half a chunk: every other block lies across two
    two = int(2 * 4 * config["chunk_size"] / UNIT_CHUNK_SHARE)
    for budget, span in ((two, 2), (two - 1, 1)):
        cm, _ = prepared(model, ADAMW, device_memory=budget, **config)
        runtime = cm.runtime
        units = [m for m, records in runtime.module_records.items()
                 if m not in runtime.idle_modules and len(records) > len(list(m.parameters(recurse=False)))]
        assert max(len(_chunks(cm, m)) for m in units) == span, budget
        straddling = [b for b in cm.module[1:-1] if len(_chunks(cm, b)) == 2]
        assert straddling and all((b in units) == (span == 2) for b in straddling), budget


def test_units_are_made_only_where_a_chunk_is_a_small_share_of_the_budget(monkeypatch):
    monkeypatch.setattr("chunkmem.runtime.runtime.UNIT_CHUNK_SHARE", UNIT_CHUNK_SHARE)  # the rule itself
    model = _blocks()
    config = dict(chunk_size=2 * sum(p.numel() for p in model[1].parameters()))
    chunk_bytes = 4 * config["chunk_size"]
    for budget, units in ((None, True), (int(chunk_bytes / UNIT_CHUNK_SHARE), True),
                          (int(chunk_bytes / UNIT_CHUNK_SHARE) - 1, False)):
        cm, _ = prepared(model, ADAMW, device_memory=budget, **config)
        assert bool(cm.runtime.idle_modules) == units, budget
        assert all(set(records) == {cm.runtime.store.records[p] for p in m.parameters(recurse=False)}
                   for m, records in cm.runtime.module_records.items()) != units
