"""Ranks that prepare different models, dtypes, chunk sizes or optimizers fail at prepare, alike, at once."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import chunkmem
from chunkmem.zero.agreement import as_agreed, check_agreed, fingerprints, initial_values
from tests.helpers import mlp, mlp_batches, mlp_loss, train
from tests.multiproc import run_workers

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
# What rank 1 does differently, and what every rank's error must name.
CASES = {
    "depth": (dict(depth=5), "the model"),
    "dtype": (dict(dtype="bf16"), "the Config"),
    "chunk_size": (dict(chunk_size=8192), "the Config"),
    "lr": (dict(lr=1e-3), "the optimizer"),
    "seed": (dict(seed=1), "the initial values"),  # each rank's chunks took its own values: a mix of the two models
    "same": ({}, None),  # and ranks that agree train
}


def worker(rank: int, world: int) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for case, (change, _) in CASES.items():
        mine = change if rank == 1 else {}
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


def test_fingerprints_tell_apart_what_must_match_and_ignore_the_budgets() -> None:
    model = mlp()
    base = fingerprints(model, chunkmem.Config(device="cpu"), ADAMW(model.parameters()))
    other = mlp(seed=5)
    assert base == fingerprints(other, chunkmem.Config(device="cpu", device_memory="1GiB", host_memory="2GiB"),
                                ADAMW(other.parameters())), "budgets may differ between ranks"
    # The values, compared under ZeRO alone: the embedding of GPT-2's vocabulary once sampled past its end (float32
    # indices), and a sparse parameter could not be sampled.
    assert initial_values(other) != initial_values(model) == initial_values(mlp())
    big = torch.nn.Embedding(50257, 768)
    big.register_parameter("adjacency", torch.nn.Parameter(torch.eye(4).to_sparse(), requires_grad=False))
    with torch.device("meta"):  # weights loaded after prepare (finetune's): nothing to compare yet
        big.register_parameter("empty", torch.nn.Parameter(torch.empty(3)))
    assert initial_values(big) != initial_values(torch.nn.Embedding(50257, 768))
    model[0].requires_grad_(False)
    frozen = fingerprints(model, chunkmem.Config(device="cpu"), ADAMW(model.parameters()))
    assert [a == b for a, b in zip(base.values(), frozen.values())] == [False, True, True]
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
