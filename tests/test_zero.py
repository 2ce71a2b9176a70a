"""ZeRO data parallel on 2 and 3 gloo ranks against one process on the whole batch."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

import chunkmem
from tests.helpers import gpt2_loss, mlp, mlp_loss, tiny_gpt2, train, updates
from tests.multiproc import run_workers

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def mlp_case(frozen: bool = False) -> torch.nn.Module:
    model = mlp(width=32, depth=5)
    if frozen:
        model[2].requires_grad_(False)
    return model


def global_batches(kind: str, steps: int, world_batch: int = 12) -> list:
    gen = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [(torch.randn(world_batch, 32, generator=gen), torch.randn(world_batch, 4, generator=gen))
                for _ in range(steps)]
    return [torch.randint(0, 128, (world_batch, 16), generator=gen) for _ in range(steps)]


def shard(batch, rank: int, world: int):
    if isinstance(batch, tuple):
        return tuple(shard(b, rank, world) for b in batch)
    return batch.chunk(world)[rank]


def build(kind: str, frozen: bool) -> torch.nn.Module:
    return mlp_case(frozen) if kind == "mlp" else tiny_gpt2()


def worker(rank: int, world: int, kind: str, frozen: bool, accumulate: int, clip: float | None, steps: int,
           budget_fraction: float | None) -> dict:
    model = build(kind, frozen)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    budget = None if budget_fraction is None else int(sum(p.numel() * 4 for p in model.parameters()) * budget_fraction)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", device_memory=budget))
    loss_fn = mlp_loss if kind == "mlp" else gpt2_loss
    local = [shard(b, rank, world) for b in global_batches(kind, steps)]
    losses = train(cm, opt, local, loss_fn, clip=clip, accumulate=accumulate)
    averaged = []
    for value in losses:
        t = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(t)
        averaged.append(t.item() / world)
    return {"losses": averaged, "updates": updates(initial, cm.state_dict()),
            "model_data_bytes": cm.memory_stats()["model_data_bytes"]}


def single(kind: str, frozen: bool, accumulate: int, clip: float | None, steps: int) -> dict:
    model = build(kind, frozen)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    losses = train(cm, opt, global_batches(kind, steps), mlp_loss if kind == "mlp" else gpt2_loss,
                   clip=clip, accumulate=accumulate)
    group_bytes = max(sum(c.nbytes for c in g.chunks.values()) for g in cm.runtime.store.groups)
    return {"losses": losses, "updates": updates(initial, cm.state_dict()),
            "model_data_bytes": cm.memory_stats()["model_data_bytes"], "group_bytes": group_bytes}


def assert_matches(ref: dict, got: dict) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for name, update in ref["updates"].items():
        scale = update.norm().clamp_min(1e-12)
        assert (got["updates"][name] - update).norm() / scale < 2e-3, name


CASES = [  # kind, world, frozen, accumulate, clip, budget
    ("mlp", 2, False, 1, None, None),
    ("mlp", 3, True, 2, 0.5, 0.5),
    ("gpt2", 2, False, 1, 1.0, None),
    ("gpt2", 3, False, 1, None, 0.5),
]


@pytest.mark.parametrize("kind,world,frozen,accumulate,clip,budget", CASES)
def test_sharded_training_equals_one_process_on_the_whole_batch(kind, world, frozen, accumulate, clip, budget):
    steps = 4
    ref = single(kind, frozen, accumulate, clip, steps)
    results = run_workers(worker, world, kind, frozen, accumulate, clip, steps, budget)
    for got in results:
        assert_matches(ref, got)
    # Each rank persists 1/N of the model data, give or take the rounding of the trainable and the
    # frozen chunk counts up to a multiple of N (one chunk group each at most).
    for got in results:
        assert got["model_data_bytes"] <= ref["model_data_bytes"] / world + 2 * ref["group_bytes"]
        assert got["model_data_bytes"] < ref["model_data_bytes"] / world * 2


def save_worker(rank: int, world: int, path: str, steps: int) -> None:
    model = mlp_case()
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    train(cm, opt, [shard(b, rank, world) for b in global_batches("mlp", steps)], mlp_loss)
    chunkmem.save_checkpoint(path, cm, opt)


def resume_worker(rank: int, world: int, path: str, steps: int) -> dict:
    model = mlp_case()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    chunkmem.load_checkpoint(path, cm, opt)
    train(cm, opt, [shard(b, rank, world) for b in global_batches("mlp", steps)[steps // 2:]], mlp_loss)
    return {"updates": updates(initial, cm.state_dict())}


def test_checkpoint_saved_by_2_ranks_resumes_on_3(tmp_path):
    ref = single("mlp", False, 1, None, 4)
    run_workers(save_worker, 2, str(tmp_path / "ckpt"), 2)
    for got in run_workers(resume_worker, 3, str(tmp_path / "ckpt"), 4):
        for name, update in ref["updates"].items():
            assert (got["updates"][name] - update).norm() / update.norm() < 2e-3, name


def failing_worker(rank: int, world: int) -> None:
    model = mlp_case()
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    if rank == 1:
        raise ValueError("rank 1 cannot read its data shard")
    train(cm, opt, [shard(b, rank, world) for b in global_batches("mlp", 2)], mlp_loss)


def test_a_failing_rank_fails_the_job_with_its_traceback_and_no_hang():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*ValueError: rank 1 cannot read its data shard"):
        run_workers(failing_worker, 2, timeout=60)
    assert time.monotonic() - start < 60
