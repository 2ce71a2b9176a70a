"""Ranks that prepare different models, dtypes, chunk sizes or optimizers fail at prepare, alike, at once; ranks that
build different values of the same model train the first rank's, as under DDP."""

from __future__ import annotations

import contextlib
import functools
import time
from unittest import mock

import pytest
import torch

import chunkmem
from chunkmem.zero.agreement import as_agreed, check_agreed, fingerprints
from tests.helpers import mlp, mlp_batches, mlp_loss, tiny_gpt2, train
from tests.multiproc import run_workers

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
# What rank 1 does differently, and what every rank's error must name.
CASES = {
    "depth": (dict(depth=5), "the model"),
    "dtype": (dict(dtype="bf16"), "the Config"),
    "chunk_size": (dict(chunk_size=8192), "the Config"),
    "lr": (dict(lr=1e-3), "the optimizer"),
    "meta": (dict(meta=True), "the model"),  # rank 0 broadcast values rank 1 had no place for: a hang
    "same": ({}, None),  # and ranks that agree train
}


def worker(rank: int, world: int) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for case, (change, _) in CASES.items():
        mine = change if rank == 1 else {}
        with torch.device("meta") if mine.get("meta") else contextlib.nullcontext():
            model = mlp(depth=mine.get("depth", 4), seed=mine.get("seed", 0))
        config = chunkmem.Config(device="cpu", dtype=mine.get("dtype", "fp32"), chunk_size=mine.get("chunk_size"))
        try:
            cm, opt = chunkmem.prepare(model, ADAMW(model.parameters(), lr=mine.get("lr", 1e-2)), config)
            train(cm, opt, [tuple(t[rank::world] for t in b) for b in mlp_batches(2)], mlp_loss)
            out[case] = None
        except ValueError as error:
            out[case] = str(error)
    return out


def test_ranks_that_disagree_fail_at_prepare_with_the_same_error_and_no_hang() -> None:
    start = time.monotonic()
    ranks = run_workers(worker, 2, timeout=90)
    assert time.monotonic() - start < 90
    for case, (_, names) in CASES.items():
        assert ranks[0][case] == ranks[1][case], case
        if names is None:
            assert ranks[0][case] is None
        else:
            assert ranks[0][case] is not None and f"disagree at chunkmem.prepare on {names}" in ranks[0][case], case


def seeded(seed: int) -> torch.nn.Module:
    """An MLP with BatchNorm's buffers, a non-contiguous parameter, a bool and an fp16 buffer, seeded by rank."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    model.register_parameter("skew", torch.nn.Parameter(torch.randn(6, 4).t()))
    model.register_buffer("mask", torch.rand(5) > 0.5)
    model.register_buffer("scale", torch.randn(3).half())
    model.register_buffer("wide", torch.randn(1, 3).expand(4, 3))  # its elements overlap: cannot be written in place
    model[1].running_mean.normal_()
    return model


def values_worker(rank: int, world: int) -> dict:
    from chunkmem.zero import agreement

    agreement.BROADCAST_BUCKET = 100  # bytes: values split over several broadcasts
    model = seeded(rank)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with mock.patch("chunkmem.runtime.runtime.Shards", side_effect=RuntimeError("a failure after the broadcast")), \
            pytest.raises(RuntimeError, match="after the broadcast"):
        chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    unchanged = all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    cm, _ = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu"))
    return {"prepared": cm.state_dict(), "unchanged": unchanged}  # parameters consolidated, buffers this rank's own


def test_ranks_seeded_apart_take_the_first_ranks_values_as_under_ddp() -> None:
    # They were refused at prepare, and so was a rank that loads its weights after prepare from a checkpoint; before
    # that check, each rank's chunks took their values from its own model: a mix of the two. A prepare that fails after
    # the broadcast leaves each rank's model as it was.
    first = seeded(0).state_dict()
    assert not torch.equal(seeded(1)[0].weight, first["0.weight"])
    ranks = run_workers(values_worker, 2, timeout=90)
    assert all(rank["unchanged"] for rank in ranks), "a prepare that failed after the broadcast changed the model"
    for rank in ranks:
        assert rank["prepared"].keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(rank["prepared"][name], value), name


def disk_worker(rank: int, world: int, folder: str) -> dict:
    """bf16 with master weights on a disk tier: chunks a tier wrote to disk while prepare loaded them took rank 0's
    values in host memory, unmarked, and the tier dropped them: half of each rank's master weights were its own."""
    model = tiny_gpt2(seed=rank)
    data = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", dtype="bf16"))[0].memory_stats()["model_data_bytes"]
    model = tiny_gpt2(seed=rank)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", dtype="bf16", host_memory=int(data * 0.5), disk=f"{folder}/{rank}"))
    assert cm.runtime.host_cache is not None and cm.runtime.data.model_bytes()["disk"].get("master")
    return cm.state_dict()


def test_ranks_seeded_apart_train_the_first_ranks_master_weights_from_a_disk_tier(tmp_path) -> None:
    first = tiny_gpt2(seed=0).state_dict()
    for rank in run_workers(disk_worker, 2, str(tmp_path), timeout=120):
        differ = [name for name, value in first.items() if not torch.equal(rank[name], value)]
        assert not differ, f"{len(differ)} of {len(first)} differ from the first rank's, {differ[:3]}"


def meta_worker(rank: int, world: int) -> list[dict]:
    states = []
    for meta in (True, False):
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = mlp(depth=3)
        cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", chunk_size=1056))
        cm.load_state_dict(mlp(depth=3, seed=4).state_dict())  # weights loaded after prepare, as finetune's
        train(cm, opt, [tuple(t[rank::world] for t in b) for b in mlp_batches(2)], mlp_loss)
        states.append(cm.state_dict())
    return states


def test_a_model_built_on_the_meta_device_and_loaded_after_prepare_trains_as_one_built_whole() -> None:
    # Every rank raised at prepare: a group another rank owns pointed its meta parameters at a placeholder with
    # `.data =`, which refuses to leave the meta device.
    for meta, built in run_workers(meta_worker, 2, timeout=90):
        assert all(torch.equal(value, built[name]) for name, value in meta.items())


def test_fingerprints_tell_apart_what_must_match_and_ignore_the_budgets() -> None:
    model = mlp()
    base = fingerprints(model, chunkmem.Config(device="cpu"), ADAMW(model.parameters()))
    other = mlp(seed=5)
    assert base == fingerprints(other, chunkmem.Config(device="cpu", device_memory="1GiB", host_memory="2GiB"),
                                ADAMW(other.parameters())), "budgets may differ between ranks"
    model[0].requires_grad_(False)
    frozen = fingerprints(model, chunkmem.Config(device="cpu"), ADAMW(model.parameters()))
    assert [a == b for a, b in zip(base.values(), frozen.values())] == [False, True, True, True]
    check_agreed(base, as_agreed(base))  # agreed with itself: nothing to raise
    low = {k: min(base[k], frozen[k]) for k in base}
    high = {k: max(base[k], frozen[k]) for k in base}
    with pytest.raises(ValueError, match=r"disagree at chunkmem.prepare on the model \(parameter names"):
        check_agreed(base, list(low.values()) + [-v for v in high.values()])


def fp16_worker(rank: int, world: int) -> float:
    model = mlp()
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", dtype="fp16"))
    train(cm, opt, [tuple(t[rank::world] for t in b) for b in mlp_batches(2)], mlp_loss)
    return float(sum(v.double().sum() for v in cm.state_dict().values()))


def test_ranks_train_in_fp16() -> None:
    # step() read p.grad's version counters to see a change made to scaled gradients; under ZeRO p.grad is a
    # ShardedGrad, whose every use raises: every fp16 step did.
    first, second = run_workers(fp16_worker, 2)
    assert first == second
