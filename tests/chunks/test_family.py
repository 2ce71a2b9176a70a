"""Chunk families declared once (chunks/family.py): the store, the placer, the budget checks and the moves all
read the one declaration."""

from __future__ import annotations

import copy

import pytest
import torch

import chunkmem
from chunkmem.chunks.family import Families, Role
from chunkmem.chunks.observe import Moment, Move
from chunkmem.chunks.store import layouts, planned_model_data_bytes
from chunkmem.errors import MemoryBudgetError
from chunkmem.pipeline.versions import WeightVersions
from tests.helpers import mlp, mlp_batches, mlp_loss, param_bytes, tiny_gpt2

ADAM_STATES = ("exp_avg", "exp_avg_sq")


class Moves:
    def __init__(self) -> None:
        self.moves: list[Move] = []

    def moment(self, moment: Moment) -> None:
        pass

    def moved(self, move: Move) -> None:
        self.moves.append(move)


def test_the_declaration_lists_each_family_once_with_its_role_and_dtype() -> None:
    bf16 = Families.declare(torch.bfloat16, ADAM_STATES, ("stale",))
    assert [(f.name, f.role, f.dtype) for f in bf16.trained] == [
        ("param", Role.PARAM, torch.bfloat16), ("grad", Role.GRAD, torch.bfloat16),
        ("master", Role.MASTER, torch.float32), ("exp_avg", Role.STATE, torch.float32),
        ("exp_avg_sq", Role.STATE, torch.float32), ("stale", Role.VERSION, torch.bfloat16)]
    assert [f.name for f in bf16.frozen] == ["param"]
    assert bf16.saved == ("exp_avg", "exp_avg_sq", "stale")
    assert [f.name for f in bf16.trained if f.disk_backed] == ["master", *ADAM_STATES]
    assert bf16.group_bytes(10) == 10 * (2 + 2 + 4 + 4 + 4 + 2)
    assert "master" not in Families.declare(torch.float32, ADAM_STATES).named(Role.MASTER)
    with pytest.raises(ValueError, match=r"\['param', 'grad', 'grad'\]: each name must be declared once"):
        Families.declare(torch.float32, ("grad",))


def test_a_declared_version_family_is_in_the_store_the_plan_the_budget_and_the_moves() -> None:
    model, batches = mlp(width=256), mlp_batches(3, width=256)
    budget = param_bytes(model) * 6  # of 5x in model data: some groups homed on the device, some streamed
    config = chunkmem.Config(device_memory=budget, chunk_size=65536)
    trained = copy.deepcopy(model)
    cm, opt = chunkmem.prepare(trained, torch.optim.AdamW(trained.parameters()), config, versions=("stale",))
    runtime, seen = cm.runtime, Moves()
    runtime.observers.append(seen)
    groups = list(runtime.store.trainable_groups())
    assert groups and all(set(g.chunks) == {"param", "grad", "exp_avg", "exp_avg_sq", "stale"} for g in groups)
    assert {g.chunks["stale"].name for g in groups} <= set(runtime.placer.chunks), "the one placer places them"
    families = Families.declare(torch.float32, ADAM_STATES, ("stale",))
    planned = planned_model_data_bytes(model, runtime.store.chunk_size, families)
    assert cm.memory_stats()["model_data_bytes"] == planned > planned_model_data_bytes(
        model, runtime.store.chunk_size, Families.declare(torch.float32, ADAM_STATES))
    versions = WeightVersions(cm, opt)
    for batch in batches:
        mlp_loss(cm, batch).backward()
        versions.update()  # keeps the newest weights in the stale chunks, then steps
    family = {c.name: f for g in runtime.store.groups for f, c in g.chunks.items()}
    assert seen.moves and all(m.kind == family[m.chunk] for m in seen.moves)
    assert any(m.kind == "stale" for m in seen.moves), "a homed group's older weights go down with the others"


def test_the_host_check_counts_a_declared_version_family() -> None:
    model, size = mlp(), 2048
    without = planned_model_data_bytes(model, size, Families.declare(torch.float32, ADAM_STATES))
    config = chunkmem.Config(host_memory=without + size * 4, chunk_size=size)  # one group's older weights more
    plain = copy.deepcopy(model)
    chunkmem.prepare(plain, torch.optim.AdamW(plain.parameters()), config)
    versioned = copy.deepcopy(model)
    groups = layouts(model, size)[0].num_chunks
    with pytest.raises(MemoryBudgetError, match=rf"model data needs {without + groups * size * 4} bytes .* "
                                                rf"Config.host_memory allows {without + size * 4}"):
        chunkmem.prepare(versioned, torch.optim.AdamW(versioned.parameters()), config, versions=("stale",))


def test_models_under_one_manager_share_one_declaration_and_never_one_chunk_name() -> None:
    manager = chunkmem.Manager(chunkmem.Config(chunk_size=16384))
    policy, reference = tiny_gpt2(layers=1), tiny_gpt2(layers=1, seed=1)
    manager.prepare(policy, torch.optim.AdamW(policy.parameters()))
    manager.prepare(reference)
    store = manager.runtime.store  # type: ignore[union-attr]
    names = [c.name for c in store.chunks()]
    assert len(names) == len(set(names))
    trained = {f.name for f in store.families.trained}
    for group in store.groups:
        assert set(group.chunks) == (trained if group.trainable else {"param"})
        assert all(chunk.family == name for name, chunk in group.chunks.items())
