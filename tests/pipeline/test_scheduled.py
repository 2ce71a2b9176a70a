"""Interleaved 1F1B, interleaved zero bubble and ZBV (scheduled.py): two stages per rank, on 2 and 3 gloo
ranks, against one plain process on the whole mini-batch.

The grid of test_runner.py's GPipe and 1F1B: the loss of every step, every gradient by name after the
first step, every parameter after three steps (AdamW), over micro-batch counts and batch sizes that do
not divide, every checkpoint mode, both reductions and device budgets below the stage's model data; the
order each rank ran is torch's own (schedule.torch_order), complete and runnable (schedule.validate).
The model is deeper than test_runner's: 2K stages each need a layer with parameters.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from chunkmem.pipeline import pipeline
from chunkmem.pipeline.schedule import merge, torch_order, validate
from tests.multiproc import run_workers
from tests.pipeline import test_runner as runner
from tests.pipeline.test_runner import (ADAMW, BATCH, STEPS, WIDTH, assert_close, config, data_parallel_reference,
                                        loss_fn)

SCHEDULES = ("interleaved", "zero-bubble", "zbv")


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())], nn.Linear(WIDTH, 3))


def batches(rows: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, 3, generator=gen)) for _ in range(STEPS)]


def cases(ranks: int) -> list[dict]:
    out = []
    for i, (schedule, m) in enumerate(itertools.product(SCHEDULES, BATCH)):
        budget = i % 2 == 1
        out.append(dict(m=m, schedule=schedule, checkpoint=("always", "except_last", "never")[i % 3], budget=budget,
                        reduction="sum" if (i // 2) % 2 else "mean",
                        balance=([4, 3, 3, 3] if ranks == 2 else [2, 2, 2, 2, 2, 3]) if budget else "auto"))
    return out


def run_case(case: dict) -> dict:
    return runner.run_case(case, model, batches)


def worker(rank: int, world: int) -> list[dict]:
    return [run_case(case) for case in cases(world)]


def reference(case: dict) -> dict:
    return runner.reference(case, model, batches)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_virtual_stage_schedules_match_one_process(ranks: int) -> None:
    results = run_workers(worker, ranks, timeout=200)
    for i, case in enumerate(cases(ranks)):
        what = f"case {case}"
        got = [r[i] for r in results]
        ref = reference(case)
        for r in got:
            assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
        assert_close({k: v for r in got for k, v in r["grads"].items()}, ref["grads"], what + " gradient")
        assert_close(got[0]["state"], ref["state"], what + " parameter")
        order = merge({rank: r["order"]} for rank, r in enumerate(got))
        validate(order, 2 * ranks, case["m"])
        assert order == torch_order(case["schedule"], ranks, case["m"], 2), what
        if case["budget"]:
            for r in got:
                stats = r["stats"]
                assert stats["model_data_bytes"] > stats["device_limit_bytes"] >= stats["device_chunk_bytes_peak"], what
                assert stats["h2d_bytes"] > 0, what


def dp_worker(rank: int, world: int) -> list[dict]:
    out = []
    for reduction, budget in [("mean", False), ("sum", True)]:
        pipe = pipeline(model(), ADAMW, loss_fn(reduction), n_microbatches=4, schedule="interleaved",
                        balance=[4, 3, 3, 3], reduction=reduction, config=config(budget, 2), data_parallel=2)
        out.append({"losses": [pipe.step(x, y) for x, y in batches(11)], "state": pipe.state_dict()})
    return out


@pytest.mark.slow
def test_two_interleaved_pipelines_of_two_ranks_match_one_process() -> None:
    """Data parallel x interleaved 1F1B on 4 ranks: each rank's two stages sharded over 2 replicas (ZeRO)."""
    results = run_workers(dp_worker, 4, timeout=150)
    for i, reduction in enumerate(["mean", "sum"]):
        plain, expected = data_parallel_reference(model(), batches(11), reduction)
        for rank, result in enumerate(results):
            got = result[i]
            assert got["losses"] == pytest.approx(expected, rel=1e-5), (reduction, rank)
            for name, value in plain.state_dict().items():  # sums of ~30: Adam shows the order of the reductions
                torch.testing.assert_close(got["state"][name], value, rtol=1e-4, atol=1e-5)
