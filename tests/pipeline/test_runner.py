"""Pipelines of chunk-managed stages on 2, 3 and 4 gloo ranks against one plain process.

Each spawn runs many cases in a loop (spawning costs seconds, a case milliseconds). Compared with
plain PyTorch on the whole mini-batch: the loss of every step, every gradient by name after the
first step, and every parameter after three steps (AdamW), over micro-batch counts, batch sizes
that do not divide, both schedules, every checkpoint mode, both loss reductions, and device budgets
below the stage's model data. The order each rank executed is checked against the textbook one.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import pickle
import re
import runpy
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import chunkmem
from chunkmem.errors import CheckpointDamaged, CheckpointError
from chunkmem.pipeline import pipeline
from chunkmem.pipeline.schedule import order_of, simulate, validate
from tests.multiproc import free_port, run_workers

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
BATCH = {1: 5, 3: 7, 4: 10, 8: 11}  # rows per mini-batch for each micro-batch count: never a multiple
STEPS = 3
WIDTH = 8


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())], nn.Linear(WIDTH, 3))


def loss_fn(reduction: str):
    return functools.partial(nn.functional.mse_loss, reduction=reduction)


def batches(rows: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, 3, generator=gen)) for _ in range(STEPS)]


def cases(stages: int) -> list[dict]:
    out = []
    for i, (m, schedule, ckpt) in enumerate(itertools.product(BATCH, ["gpipe", "1f1b"],
                                                              ["always", "except_last", "never"])):
        budget = i % 2 == 1
        out.append(dict(m=m, schedule=schedule, checkpoint=ckpt, budget=budget,
                        reduction="sum" if (i // 2) % 2 else "mean",
                        balance=[3, 4] if stages == 2 and budget else [2, 2, 3] if budget else "auto"))
    return out


def config(budget: bool, data_parallel: int = 1) -> chunkmem.Config:
    # 1 KiB with 80-element chunks: a module's chunks fit, the stage's model data (2-4 KiB) does not.
    # Sharded over 2 replicas, ZeRO's gathered and gradient buffers (2 chunks each) need another KiB.
    return chunkmem.Config(device="cpu", device_memory=1024 * data_parallel if budget else None,
                           chunk_size=80 if budget else None)


Data = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]


def run_case(case: dict, make: Callable[[], nn.Module] = model, data: Data = batches) -> dict:
    """A case of the grid on this rank: each step's loss, the first step's gradients, the order it ran."""
    pipe = pipeline(make(), ADAMW, loss_fn(case["reduction"]), n_microbatches=case["m"],
                    schedule=case["schedule"], balance=case["balance"], checkpoint=case["checkpoint"],
                    reduction=case["reduction"], config=config(case["budget"]))
    losses, grads = [], {}
    for step, (x, y) in enumerate(data(BATCH[case["m"]])):
        losses.append(pipe.step(x, y, update=step > 0))
        if step == 0:
            grads = pipe.gradients()
            pipe.optimizer.step()
            pipe.optimizer.zero_grad()
    state = pipe.state_dict()  # a collective: every rank takes part
    return {"losses": losses, "grads": grads, "state": state if pipe.stage == 0 else None,
            "order": list(pipe.last_order), "stats": pipe.model.memory_stats()}


def reference(case: dict, make: Callable[[], nn.Module] = model, data: Data = batches) -> dict:
    """Plain PyTorch on the whole mini-batches: the losses, the first step's gradients, the parameters."""
    plain = make()
    opt = ADAMW(plain.parameters())
    losses, grads = [], {}
    for step, (x, y) in enumerate(data(BATCH[case["m"]])):
        loss = loss_fn(case["reduction"])(plain(x), y)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {k: p.grad.clone() for k, p in plain.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "state": plain.state_dict()}


def activation_peaks(stages: int) -> dict:
    """Per schedule, each stage's peak of saved activations: one micro-batch of 2 rows alone, then 4."""
    out = {}
    for schedule, m in [("gpipe", 1), ("gpipe", 4), ("1f1b", 4)]:
        torch.manual_seed(0)
        layers = nn.Sequential(*[m_ for _ in range(stages) for m_ in (nn.Tanh(), nn.Linear(WIDTH, WIDTH))])
        pipe = pipeline(layers, ADAMW, loss_fn("mean"), n_microbatches=m, schedule=schedule,
                        balance=[2] * stages, config=chunkmem.Config(device="cpu"))
        pipe.step(torch.randn(2 * m, WIDTH), torch.randn(2 * m, WIDTH))
        out[(schedule, m)] = pipe.model.runtime.activations.peak
    return out


def grid_worker(rank: int, world: int, tmp: str) -> dict:
    out = {"cases": [run_case(c) for c in cases(world)], "peaks": activation_peaks(world)}
    if world == 2:
        out["resume"] = resume(Path(tmp))
        out["staging"] = state_dict_staging()
    return out


def state_dict_staging() -> dict:
    """What crosses between ranks while `state_dict` consolidates: the largest object collective (pickled
    bytes; under NCCL those are staged on the GPU) and the largest tensor, against the stage's tensors."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    pipe = pipeline(layers, ADAMW, loss_fn("mean"), n_microbatches=2, balance=[3, 2],
                    config=chunkmem.Config(device="cpu"))
    pipe.step(torch.randn(4, 64), torch.randn(4, 64))
    seen = {"object": 0, "tensor": 0}
    gather, broadcast = dist.all_gather_object, dist.broadcast

    def spy_gather(out: list, obj: object, group: object = None) -> None:
        seen["object"] = max(seen["object"], len(pickle.dumps(obj)))
        gather(out, obj, group=group)

    def spy_broadcast(tensor: torch.Tensor, src: int, group: object = None, **kwargs: object) -> object:
        seen["tensor"] = max(seen["tensor"], tensor.nbytes)
        return broadcast(tensor, src, group=group, **kwargs)

    dist.all_gather_object, dist.broadcast = spy_gather, spy_broadcast
    try:
        state = pipe.state_dict()
    finally:
        dist.all_gather_object, dist.broadcast = gather, broadcast
    own = pipe.model.state_dict()
    return seen | {"stage_bytes": sum(v.nbytes for v in own.values()), "largest": max(v.nbytes for v in state.values()),
                   "matches": all(torch.equal(state[k], v) for k, v in own.items()), "state": state}


def resume(tmp: Path) -> dict:
    """Train 3 steps straight, or 2 steps, save, and a fresh pipeline that loads and takes the third."""
    data = batches(7)
    def make():  # a fresh model each time: a pipeline prepares its stage's layers in place
        return pipeline(model(), ADAMW, loss_fn("mean"), n_microbatches=3, config=chunkmem.Config(device="cpu"))
    straight = make()
    for x, y in data:
        straight.step(x, y)
    first = make()
    for x, y in data[:2]:
        first.step(x, y)
    first.save_checkpoint(tmp / "ckpt")
    second = make()
    second.load_checkpoint(tmp / "ckpt")
    second.step(*data[2])
    return {"straight": straight.state_dict(), "resumed": second.state_dict()}


def assert_close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_matches_one_process_on_the_whole_batch(stages: int, tmp_path: Path) -> None:
    results = run_workers(grid_worker, stages, str(tmp_path), timeout=150)
    for i, case in enumerate(cases(stages)):
        what = f"case {case}"
        ranks = [r["cases"][i] for r in results]
        ref = reference(case)
        for got in ranks:
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
        assert_close({k: v for r in ranks for k, v in r["grads"].items()}, ref["grads"], what + " gradient")
        assert_close(ranks[0]["state"], ref["state"], what + " parameter")
        order = {s: r["order"] for s, r in enumerate(ranks)}
        validate(order, stages, case["m"])
        runs = "gpipe" if case["m"] < stages else case["schedule"]  # torch's 1F1B needs M >= K
        assert order == order_of(runs, stages, case["m"]), what
        if case["budget"]:
            for r in ranks:
                stats = r["stats"]
                assert stats["model_data_bytes"] > stats["device_limit_bytes"] and stats["h2d_bytes"] > 0, what
    check_activation_peaks(stages, [r["peaks"] for r in results])
    if stages == 2:
        assert_close(results[0]["resume"]["resumed"], results[0]["resume"]["straight"], "resumed")
        for staging in (r["staging"] for r in results):  # no stage's state dict crosses whole
            assert staging["matches"] and staging["tensor"] == staging["largest"]
            assert staging["object"] < 1024 < staging["largest"] < staging["stage_bytes"]
            assert_close(staging["state"], results[0]["staging"]["state"], "consolidated on every rank")
        assert len(results[0]["staging"]["state"]) == 6


def check_activation_peaks(stages: int, peaks: list[dict]) -> None:
    """1F1B: stage s holds min(M, K - s) micro-batches of activations (what chunkmem's meter saw); GPipe all M."""
    for s, peak in enumerate(peaks):
        one = peak[("gpipe", 1)]
        assert one > 0
        assert peak[("gpipe", 4)] == 4 * one, f"stage {s}"
        assert peak[("1f1b", 4)] == min(4, stages - s) * one, f"stage {s}"
    order = order_of("1f1b", stages, 4)
    assert simulate(order, stages).peak_in_flight == {s: min(4, stages - s) for s in range(stages)}


def dp_worker(rank: int, world: int) -> list[dict]:
    out = []
    for reduction, budget in [("mean", False), ("sum", True)]:
        pipe = pipeline(model(), ADAMW, loss_fn(reduction), n_microbatches=3, schedule="1f1b", balance=[3, 4],
                        reduction=reduction, config=config(budget, 2), data_parallel=2)
        losses, phases = [], []
        for x, y in batches(11):
            losses.append(pipe.step(x, y))
            phases.append(pipe.model.runtime.placer.phase.value)
        out.append({"losses": losses, "phases": phases, "state": pipe.state_dict(),
                    "model_data_bytes": pipe.model.memory_stats()["model_data_bytes"]})
    return out


def data_parallel_reference(plain: nn.Module, data: Iterable, reduction: str) -> tuple[nn.Module, list[float]]:
    """One process on the global batches, averaged over 2 replicas as DDP and ZeRO do: the model, the losses."""
    opt = ADAMW(plain.parameters())
    losses = []
    for x, y in data:
        loss = loss_fn(reduction)(plain(x), y)
        (loss if reduction == "mean" else loss / 2).backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return plain, losses


@pytest.mark.slow
def test_two_pipelines_of_two_stages_match_one_process() -> None:
    """Data parallel x pipeline on 4 ranks: each stage's model data is sharded over its 2 replicas (ZeRO)."""
    results = run_workers(dp_worker, 4, timeout=120)
    for i, reduction in enumerate(["mean", "sum"]):
        plain, expected = data_parallel_reference(model(), batches(11), reduction)
        for rank, result in enumerate(results):
            got = result[i]
            assert got["losses"] == pytest.approx(expected, rel=1e-5), (reduction, rank)
            # The first step's shape probe (a forward without gradients) must not leave gathered groups
            # behind: the plan recorded in step 0 is followed from then on, not re-recorded.
            assert got["phases"] == ["follow"] * len(got["phases"]), (reduction, rank)
            assert_close(got["state"], plain.state_dict(), f"{reduction} rank {rank}")
        full = [r[i]["model_data_bytes"] for r in results]
        assert full[0] < 0.75 * sum(full[:2]), "each replica persists about half its stage's model data"


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_torchrun.py"


@pytest.mark.slow
def test_the_torchrun_example_trains_like_plain_pytorch() -> None:
    """`torchrun --nproc-per-node 2 examples/pipeline_torchrun.py`: its losses are one process's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONPATH=str(EXAMPLE.parent.parent))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), str(EXAMPLE), "--steps", "3"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    printed = [float(v) for v in re.findall(r"step \d+ loss ([\d.]+)", out.stdout)]
    example = runpy.run_path(str(EXAMPLE))
    plain = example["build"](256, width=128, depth=6)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    gen, expected = torch.Generator().manual_seed(0), []
    for _ in range(3):
        tokens = torch.randint(0, 256, (10, 33), generator=gen)
        loss = example["next_token_loss"](plain(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    assert printed == pytest.approx(expected, abs=1e-4)  # printed with 4 decimals
    assert re.search(r"rank 1: stage 1 of 2, balance \[\d+, \d+\]", out.stdout)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(schedule="zigzag"), ValueError, r"schedule='zigzag': expected one of \['gpipe', '1f1b', 'interleaved'"),
    (dict(checkpoint="sometimes"), ValueError, r"checkpoint='sometimes'"),
    (dict(reduction="none"), ValueError, r"reduction='none'"),
    (dict(n_microbatches=0), ValueError, r"n_microbatches=0: expected a positive int"),
    (dict(balance=[3, 4]), ValueError, r"balance=\[3, 4\]: expected 'auto' or 1 positive layer counts"),
    (dict(data_parallel=3), ValueError, r"data_parallel=3 does not divide the world of 1"),
    (dict(config=chunkmem.Config(device="cpu", dtype="fp16")), ValueError, r"dtype='fp16' is not supported"),
    (dict(config=[chunkmem.Config(device="cpu")] * 2), ValueError, r"got 2 Configs for 1 stages"),
    (dict(virtual_stages=2), ValueError, r"virtual_stages=2 with schedule='1f1b': only \['interleaved'"),
    (dict(schedule="zbv", virtual_stages=3), ValueError, r"schedule='zbv' runs exactly 2 stages per rank"),
    (dict(schedule="interleaved", virtual_stages=1), ValueError, r"needs at least 2 stages per rank"),
])
def test_bad_arguments_say_what_to_change(one_rank_group: None, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        pipeline(model(), ADAMW, loss_fn("mean"), **kwargs)


def test_a_batch_smaller_than_the_micro_batch_count_and_a_non_sequential_model_are_refused(
        one_rank_group: None) -> None:
    pipe = pipeline(model(), ADAMW, loss_fn("mean"), n_microbatches=4, config=chunkmem.Config(device="cpu"))
    with pytest.raises(ValueError, match=r"a batch of 3 rows cannot be split into n_microbatches=4"):
        pipe.step(torch.randn(3, WIDTH), torch.randn(3, 3))
    twobw = pipeline(model(), ADAMW, loss_fn("mean"), schedule="2bw", config=chunkmem.Config(device="cpu"))
    with pytest.raises(ValueError, match=r"step\(update=False\) under schedule='2bw'"):
        twobw.step(torch.randn(8, WIDTH), torch.randn(8, 3), update=False)
    with pytest.raises(TypeError, match=r"splits an nn.Sequential .* got Linear"):
        pipeline(nn.Linear(WIDTH, 3), ADAMW, loss_fn("mean"))


def test_without_a_process_group_the_error_says_how_to_launch() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"launch with torchrun"):
        pipeline(model(), ADAMW, loss_fn("mean"))


def failed_save_worker(rank: int, world: int, tmp: str) -> dict:
    """Two steps, a save; a third step and a save in which stage 1's part cannot be written; then the checkpoint a
    fresh pipeline loads."""
    import chunkmem.checkpoint as ckpt

    data, path = batches(7), Path(tmp) / "ckpt"

    def make():
        return pipeline(model(), ADAMW, loss_fn("mean"), n_microbatches=3, config=chunkmem.Config(device="cpu"))

    pipe = make()
    for x, y in data[:2]:
        pipe.step(x, y)
    pipe.save_checkpoint(path)
    pipe.step(*data[2])
    write = ckpt.save_file
    if rank == 1:
        ckpt.save_file = functools.partial(_no_room, write)
    try:
        pipe.save_checkpoint(path)
        error = None
    except Exception as caught:  # noqa: BLE001  the test looks at it
        error = f"{type(caught).__name__}: {caught}"
    ckpt.save_file = write
    again = make()
    again.load_checkpoint(path)
    again.step(*data[2])  # builds the stages, which takes the load
    return {"error": error, "loaded": again.state_dict(), "stepped": pipe.state_dict()}


def _no_room(write: Callable, *args, **kwargs) -> None:
    raise OSError(28, "No space left on device")


def test_a_pipeline_save_one_stage_cannot_write_raises_on_every_rank_and_keeps_the_last_checkpoint(tmp_path) -> None:
    results = run_workers(failed_save_worker, 2, str(tmp_path), timeout=120)
    assert "No space left on device" in results[1]["error"]
    assert results[0]["error"].startswith("CheckpointError: another rank could not write its part of the pipeline "
                                          "checkpoint")
    # The fresh pipeline resumed from the first save and took the third step: the bits of the one that did not stop.
    for got in results:
        assert got["loaded"].keys() == got["stepped"].keys()
        assert all(torch.equal(got["loaded"][k], v) for k, v in got["stepped"].items())
    assert not (tmp_path / "ckpt.tmp").exists() or not (tmp_path / "ckpt.tmp" / "pipeline.json").exists()


def leftover_worker(rank: int, world: int, tmp: str) -> list[str]:
    data, path, users = batches(3), Path(tmp) / "ckpt", Path(tmp) / "mine"
    pipe = pipeline(model(), ADAMW, loss_fn("mean"), n_microbatches=3, config=chunkmem.Config(device="cpu"))
    pipe.step(*data[0])
    pipe.save_checkpoint(path)
    if rank == 0:  # what a run killed while stage 1 wrote its part leaves, and a folder of the user's
        (Path(tmp) / "ckpt.tmp" / "stage-1.tmp").mkdir(parents=True)
        (Path(tmp) / "ckpt.tmp" / "stage-1.tmp" / "state.safetensors").write_bytes(b"\0" * 100)
        users.mkdir()
        (users / "notes.txt").write_text("mine")
    dist.barrier()
    out = []
    for target in (path, users):
        try:
            pipe.save_checkpoint(target)
            out.append("saved")
        except CheckpointError as error:
            out.append(str(error))
    return out


def test_a_pipeline_save_clears_what_a_killed_save_left_and_refuses_a_users_folder_on_every_rank(tmp_path) -> None:
    # A stage's leftover part (stage-1.tmp) made rank 0 refuse the save, and a refusal on rank 0 alone left the other
    # ranks waiting at a barrier.
    for saved, refused in run_workers(leftover_worker, 2, str(tmp_path), timeout=120):
        assert saved == "saved"
        assert "mine" in refused and "not a chunkmem checkpoint" in refused or "rank 0 cannot save" in refused
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


class Tagged(nn.Module):
    """A layer with extra state that is not a tensor (`get_extra_state`), as a tokenizer-aware or quantised layer's."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def get_extra_state(self) -> dict:
        return {"tag": self.tag}

    def set_extra_state(self, state: dict) -> None:
        self.tag = state["tag"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def tagged() -> nn.Sequential:
    return nn.Sequential(*model(), Tagged("last stage"))


def extra_state_worker(rank: int, world: int, folder: str) -> dict:
    data = batches(4)
    pipe = pipeline(tagged(), ADAMW, loss_fn("mean"), n_microbatches=2, config=chunkmem.Config(device="cpu"))
    pipe.step(*data[0])
    pipe.save_checkpoint(Path(folder) / "ckpt")
    pipe.step(*data[1])
    again = pipeline(tagged(), ADAMW, loss_fn("mean"), n_microbatches=2, config=chunkmem.Config(device="cpu"))
    again.load_checkpoint(Path(folder) / "ckpt")
    with pytest.raises(RuntimeError, match=r"before the first step\(\): the stages do not hold its values yet"):
        again.state_dict()  # it returned the values from before the load
    again.step(*data[1])
    # A load the first step made that failed (another split) left the stages' own values: saving them replaced the
    # checkpoint it was to resume.
    saved = json.loads((Path(folder) / "ckpt" / "pipeline.json").read_text())["balance"]
    moved = 1 if saved[0] > 1 else -1
    other = pipeline(tagged(), ADAMW, loss_fn("mean"), n_microbatches=2, balance=[saved[0] - moved, saved[1] + moved],
                     config=chunkmem.Config(device="cpu"))
    other.load_checkpoint(Path(folder) / "ckpt")
    with pytest.raises(ValueError, match="was saved with balance"):
        other.step(*data[1])
    for call in (other.state_dict, lambda: other.save_checkpoint(Path(folder) / "ckpt")):
        with pytest.raises(RuntimeError, match=r"after the step that loaded it failed"):
            call()
    return {"state": pipe.state_dict(), "resumed": again.state_dict(),
            "kept": json.loads((Path(folder) / "ckpt" / "pipeline.json").read_text())["balance"] == saved}


def test_state_dict_and_checkpoints_keep_a_layers_extra_state(tmp_path: Path) -> None:
    # state_dict() raised AttributeError ('dict' object has no attribute 'shape') on every rank.
    expected = tagged().state_dict()
    for rank in run_workers(extra_state_worker, 2, str(tmp_path), timeout=90):
        assert rank["state"].keys() == rank["resumed"].keys() == expected.keys()
        assert rank["state"]["7._extra_state"] == rank["resumed"]["7._extra_state"] == {"tag": "last stage"}
        assert rank["kept"], "the checkpoint a failed load was to resume was replaced"
        for name, value in rank["state"].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(rank["resumed"][name], value), name


def damaged_stage_worker(rank: int, world: int, folder: str) -> tuple[str, bool]:
    """Two stages save; stage 1's part is then damaged, a step taken, and the checkpoint loaded: the error this rank
    got, and whether its stage kept the values of that step."""
    data, path = batches(4), Path(folder) / "ckpt"
    pipe = pipeline(model(), ADAMW, loss_fn("mean"), n_microbatches=2, config=chunkmem.Config(device="cpu"))
    pipe.step(*data[0])
    pipe.save_checkpoint(path)
    dist.barrier()
    if rank == 0:
        part = path / "stage-1" / "state.safetensors"
        damaged = bytearray(part.read_bytes())
        damaged[-3] ^= 1
        part.write_bytes(bytes(damaged))
    dist.barrier()
    pipe.step(*data[1])
    before = {k: v.clone() for k, v in pipe.model.state_dict().items()}
    try:
        pipe.load_checkpoint(path)
        error = "loaded"
    except CheckpointDamaged as caught:
        error = str(caught)
    after = pipe.model.state_dict()
    return error, all(torch.equal(v, after[k]) for k, v in before.items())


def test_a_pipeline_checkpoint_one_stage_cannot_load_is_loaded_by_no_stage(tmp_path: Path) -> None:
    # Stage 0 loaded its part while stage 1 refused its own: the stages held two steps' values, and trained on.
    (first, kept_first), (second, kept_second) = run_workers(damaged_stage_worker, 2, str(tmp_path), timeout=120)
    assert first.startswith("a rank could not load the checkpoint") and "has checksum" in second
    assert kept_first and kept_second


def unshared_load_worker(rank: int, world: int, folder: str) -> tuple[str, float]:
    """A pipeline of one stage over two data-parallel ranks saves, then loads on rank 0 and, on rank 1, from a path with
    nothing there (a node without the file system rank 0 wrote to): the error each rank got, and how long it took."""
    torch.manual_seed(0)
    pipe = pipeline(model(), functools.partial(torch.optim.AdamW, lr=1e-2), loss_fn("mean"), n_microbatches=1,
                    schedule="gpipe", balance=[len(model())], config=chunkmem.Config(device="cpu"), data_parallel=2)
    pipe.step(*batches(4)[0])
    path = Path(folder) / "ckpt"
    pipe.save_checkpoint(path)
    start = time.monotonic()
    try:
        pipe.load_checkpoint(path if rank == 0 else path.with_name("elsewhere"))
    except FileNotFoundError as error:
        return str(error), time.monotonic() - start
    return "loaded", time.monotonic() - start


@pytest.mark.slow
def test_a_pipeline_checkpoint_one_rank_cannot_find_is_loaded_on_no_rank(tmp_path: Path) -> None:
    # The rank that found none raised; the other loaded its part and waited for it in the stage's agreement, up to
    # CHUNKMEM_CHECKPOINT_TIMEOUT (6 h).
    (first, first_s), (second, second_s) = run_workers(unshared_load_worker, 2, str(tmp_path), timeout=90)
    assert first.startswith("a rank could not load the checkpoint") and second.startswith("no chunkmem checkpoint")
    assert max(first_s, second_s) < 30
