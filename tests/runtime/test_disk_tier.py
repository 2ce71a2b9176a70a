"""Training with the disk tier (Config(disk=...)): bit-identical to PyTorch with host memory below the model data,
under ZeRO too; checkpoints across runs with and without it; faults; files only under the directory, and gone."""

from __future__ import annotations

import copy
import errno
import functools
import os
import subprocess
import sys

import pytest
import torch

import chunkmem
from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.hostcache import HostCache
from chunkmem.chunks.state import ChunkState
from chunkmem.errors import DiskTierError, MemoryBudgetError
from chunkmem.memory import disk as disk_module
from chunkmem.memory.disk import IoToken
from tests.helpers import (assert_updates_close, gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss, tiny_gpt2, train,
                           updates)
from tests.multiproc import run_workers

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
CHUNK = 4096


def model_data(model: torch.nn.Module, states: int = 2) -> int:
    """Bytes of fp32 model data chunkmem lays out for `model` in chunks of CHUNK elements (param, grad, states)."""
    chunks = -(-sum(p.numel() for p in model.parameters()) // CHUNK) + 8  # generous: parameters never straddle
    return chunks * CHUNK * 4 * (2 + states)


def prepare(model, make_opt, directory, host_fraction: float | None = 0.6, **config):
    host = None if host_fraction is None else int(model_data(model) * host_fraction)
    m = copy.deepcopy(model)
    return chunkmem.prepare(m, make_opt(m.parameters()), chunkmem.Config(
        device="cpu", chunk_size=CHUNK, host_memory=host, disk=None if directory is None else str(directory),
        **config))


def reference(model, make_opt, batches, loss_fn):
    ref = copy.deepcopy(model)
    return train(ref, make_opt(ref.parameters()), batches, loss_fn), ref.state_dict()


@pytest.mark.parametrize("make_opt", [ADAMW, SGD], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("device_fraction", [None, 0.3])
def test_fp32_with_host_memory_below_model_data_is_bit_identical_to_pytorch(tmp_path, make_opt, device_fraction):
    model, batches = mlp(width=64, depth=6), mlp_batches(5, width=64)
    ref_losses, ref_state = reference(model, make_opt, batches, mlp_loss)
    states = 2 if make_opt is ADAMW else 1
    host = int(model_data(model, states) * 0.6)
    budget = None if device_fraction is None else int(model_data(model, states) * device_fraction / 2)
    m = copy.deepcopy(model)
    cm, opt = chunkmem.prepare(m, make_opt(m.parameters()), chunkmem.Config(
        device="cpu", chunk_size=CHUNK, host_memory=host, device_memory=budget, disk=str(tmp_path)))
    assert cm.runtime.host_cache is not None, "host memory below the model data: the disk tier must be on"
    assert train(cm, opt, batches, mlp_loss) == ref_losses
    state = cm.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())
    stats = cm.memory_stats()
    assert stats["model_data_bytes"] > host
    assert stats["host_cache_bytes_peak"] <= stats["host_cache_capacity_bytes"]
    assert stats["disk_read_bytes"] > 0 and stats["disk_write_bytes"] > 0
    assert stats["disk_prefetch_bytes"] > 0, "after warm-up the optimizer's next groups are read ahead"
    on_disk = cm.runtime.data.model_bytes()["disk"]
    assert set(on_disk) <= {"exp_avg", "exp_avg_sq", "momentum_buffer"}, "parameters and gradients stay in host memory"


def test_moments_rescan_the_read_ahead_only_once_a_write_it_waited_for_lands(tmp_path, monkeypatch):
    # hostcache's Note on the plan: between the optimizer's groups only landing writes change what can be read ahead.
    model, batches = mlp(width=64, depth=6), mlp_batches(3, width=64)
    cm, opt = prepare(model, ADAMW, tmp_path)
    train(cm, opt, batches[:2], mlp_loss)  # warm-up, then a step on the plan
    scans, moments = [], []
    scan, tick = HostCache._prefetch, HostCache.tick
    monkeypatch.setattr(HostCache, "_prefetch", lambda self: (scans.append(1), scan(self)))
    monkeypatch.setattr(HostCache, "tick", lambda self: (moments.append(1), tick(self)))
    monkeypatch.setattr(IoToken, "done", lambda self: False)  # no write lands during this backward
    mlp_loss(cm, batches[2]).backward()
    assert len(moments) > 10 and len(scans) == 1, (len(moments), len(scans))
    monkeypatch.undo()
    opt.step()
    assert cm.memory_stats()["disk_prefetch_bytes"] > 0


def test_gpt2_bf16_results_do_not_change_with_the_disk_tier(tmp_path):
    model, batches = tiny_gpt2(), gpt2_batches(4)
    runs: list = []
    for directory in (None, tmp_path):
        m = copy.deepcopy(model)
        host = int(runs[0][2] * 0.5) if runs else None
        cm, opt = chunkmem.prepare(m, ADAMW(m.parameters()), chunkmem.Config(
            device="cpu", dtype="bf16", host_memory=host, disk=directory and str(directory)))
        runs.append((train(cm, opt, batches, gpt2_loss), cm.state_dict(), cm.memory_stats()["model_data_bytes"]))
        if directory is not None:
            assert cm.runtime.host_cache is not None
            assert set(cm.runtime.data.model_bytes()["disk"]) & {"master", "exp_avg"}, "master weights go to disk too"
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], v) for k, v in runs[1][1].items())


def test_no_disk_tier_when_host_memory_holds_everything_and_a_clear_error_when_even_it_cannot_help(tmp_path):
    cm, _ = prepare(mlp(width=64), ADAMW, tmp_path, host_fraction=None)
    assert cm.runtime.host_cache is None and list(tmp_path.iterdir()) == []
    with pytest.raises(MemoryBudgetError, match="parameter and gradient chunks.*host_memory allows"):
        prepare(mlp(width=64), ADAMW, tmp_path, host_fraction=0.2)


def test_checkpoints_load_across_runs_with_and_without_the_disk_tier(tmp_path):
    model, batches = mlp(width=64, depth=6), mlp_batches(6, width=64)
    ref_losses, ref_state = reference(model, ADAMW, batches, mlp_loss)
    for first, second in ((tmp_path / "d1", None), (None, tmp_path / "d2")):
        for directory in (first, second):
            if directory is not None:
                directory.mkdir()
        cm, opt = prepare(model, ADAMW, first, host_fraction=0.6 if first else None)
        losses = train(cm, opt, batches[:3], mlp_loss)
        path = tmp_path / f"ckpt-{first is None}"
        chunkmem.save_checkpoint(path, cm, opt)
        resumed, opt2 = prepare(model, ADAMW, second, host_fraction=0.6 if second else None)
        chunkmem.load_checkpoint(path, resumed, opt2)
        losses += train(resumed, opt2, batches[3:], mlp_loss)
        assert losses == ref_losses, (first, second)
        state = resumed.state_dict()
        assert all(torch.equal(state[k], v) for k, v in ref_state.items())


def test_a_file_deleted_under_a_running_job_fails_clearly_and_the_last_checkpoint_loads(tmp_path):
    model, batches = mlp(width=64, depth=6), mlp_batches(4, width=64)
    (tmp_path / "disk").mkdir()
    cm, opt = prepare(model, ADAMW, tmp_path / "disk")
    train(cm, opt, batches[:2], mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "ckpt", cm, opt)
    saved = cm.state_dict()
    os.unlink(cm.runtime.host_cache.disk.file)
    with pytest.raises(DiskTierError, match=rf"{cm.runtime.host_cache.disk.file}.*was deleted"):
        train(cm, opt, batches[2:], mlp_loss)
    fresh, opt2 = prepare(model, ADAMW, tmp_path / "disk")
    chunkmem.load_checkpoint(tmp_path / "ckpt", fresh, opt2)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize("when", ["between steps", "right after step"])
def test_a_file_truncated_under_a_running_job_never_hands_zeros_to_the_optimizer(tmp_path, when):
    # The tier's file truncated to nothing and grown back (a write-back in flight may grow it again with holes):
    # reading it back gives zeros, which the optimizer would take as states. It must fail instead.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    batches = [(torch.randn(8, 256), torch.randn(8, 256)) for _ in range(4)]
    data = sum(p.numel() for p in model.parameters()) * 4 * 4
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", chunk_size=70_000, host_memory=int(0.7 * data), disk=str(tmp_path)))
    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    train(cm, opt, batches[:2], loss)
    file = cm.runtime.host_cache.disk.file
    with pytest.raises(DiskTierError, match=rf"{file}"):
        if when == "right after step":
            loss(cm, batches[2]).backward()
            opt.step()
            size = os.stat(file).st_size
            os.truncate(file, 0)
            os.truncate(file, size)
            opt.zero_grad()
            train(cm, opt, batches[3:], loss)
        else:
            size = os.stat(file).st_size
            os.truncate(file, 0)
            os.truncate(file, size)
            train(cm, opt, batches[2:], loss)


def test_a_step_the_disk_tier_failed_midway_leaves_values_nobody_can_read_as_the_models(tmp_path):
    # The step updated the groups before the one whose states read back wrong, and state_dict (save_pretrained too)
    # handed back that mix of two steps without a word (helper-88).
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    batches = [(torch.randn(4, 32), torch.randn(4, 32)) for _ in range(4)]
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", device_memory="16KiB", host_memory="120KiB", chunk_size=2112, disk=str(tmp_path)))
    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    train(cm, opt, batches[:3], loss)
    file = cm.runtime.host_cache.disk.file
    loss(cm, batches[3]).backward()
    file.write_bytes(bytes(range(256)) * (file.stat().st_size // 256))
    with pytest.raises(DiskTierError, match=rf"{file}"):
        opt.step()
    with pytest.raises(DiskTierError, match="a step failed .* mix two steps"):
        cm.state_dict()


TRAIN = """
import sys
from tests.runtime.test_disk_tier import ADAMW, mlp, mlp_batches, mlp_loss, prepare, train
cm, opt = prepare(mlp(width=64, depth=6), ADAMW, sys.argv[1])
train(cm, opt, mlp_batches(3, width=64), mlp_loss)
assert cm.memory_stats()["disk_read_bytes"] > 0
print(cm.runtime.host_cache.disk.file)
"""


def test_files_only_under_the_directory_and_removed_at_exit(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    before = set(tmp_path.rglob("*"))
    cm, opt = prepare(mlp(width=64, depth=6), ADAMW, root)
    train(cm, opt, mlp_batches(3, width=64), mlp_loss)
    written = set(tmp_path.rglob("*")) - before
    assert written and all(root in p.parents for p in written)
    cm.runtime.host_cache.close()
    assert list(root.iterdir()) == []
    done = subprocess.run([sys.executable, "-c", TRAIN, str(root)], capture_output=True, text=True,
                          env=dict(os.environ, CHUNKMEM_SIM_CHECK="0", PYTHONPATH=os.getcwd()))
    assert done.returncode == 0, done.stderr
    assert str(root) in done.stdout and list(root.iterdir()) == []


def zero_worker(rank: int, world: int, directory: str | None) -> dict:
    model = mlp(width=64, depth=6)
    batches = [tuple(t.chunk(world)[rank] for t in b) for b in mlp_batches(4, width=64)]
    host = int(model_data(model) * 0.6 / world) if directory else None
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(
        device="cpu", chunk_size=CHUNK, host_memory=host, disk=directory))
    losses = train(cm, opt, batches, mlp_loss)
    stats = cm.memory_stats()
    return {"losses": losses, "state": cm.state_dict(), "disk_read_bytes": stats.get("disk_read_bytes", 0),
            "tiered": cm.runtime.host_cache is not None}


@pytest.mark.slow
def test_zero_two_ranks_with_the_disk_tier_equal_zero_without_it_bit_for_bit(tmp_path):
    plain = run_workers(zero_worker, 2, None)
    disk = run_workers(zero_worker, 2, str(tmp_path))
    assert all(r["tiered"] and r["disk_read_bytes"] > 0 for r in disk)
    for a, b in zip(plain, disk):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["state"][k], v) for k, v in b["state"].items())
    # And ZeRO equals one process on the global batch as tests/zero checks it: its reductions sum in another order,
    # and Adam magnifies that last bit where a gradient is near zero, so the updates agree normwise.
    initial = mlp(width=64, depth=6).state_dict()
    _, ref_state = reference(mlp(width=64, depth=6), ADAMW, mlp_batches(4, width=64), mlp_loss)
    assert_updates_close(updates(initial, ref_state), updates(initial, disk[0]["state"]), rtol=2e-3)
    assert list(tmp_path.iterdir()) == [], "each rank removed its files at exit"


def _trained_cache(tmp_path) -> tuple[HostCache, str, Chunk]:
    """The disk tier of an MLP trained two steps, and the first chunk it holds in host memory (by name)."""
    model = mlp(width=64, depth=6)
    cm, opt = prepare(model, ADAMW, tmp_path)
    train(cm, opt, mlp_batches(2, width=64), mlp_loss)
    cache = cm.runtime.host_cache
    name = next(iter(cache.buffers))
    return cache, name, cache.chunks[name]


@pytest.mark.parametrize("seen", ["at its release", "where the chunk is read next"])
def test_a_failed_write_back_keeps_the_chunk_changed_in_host_memory_and_writes_it_next_time(tmp_path, monkeypatch,
                                                                                             seen):
    # The chunk was spilled at its next release as if written: a caller that went on after the error (to save a
    # checkpoint elsewhere) read the states of a step before.
    cache, name, chunk = _trained_cache(tmp_path)
    expected = chunk.settled().add_(1.0).clone()  # a step's change, not on disk yet
    cache.changed(chunk)
    original = disk_module.os.pwritev

    def broken(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_module.os, "pwritev", broken)
    with pytest.raises(DiskTierError, match="Input/output error"):
        if seen == "at its release":
            cache._release(name)
        else:  # the optimizer's use writes it back on its way out, and its next reader waits for the write
            with cache.using([chunk]):
                pass
            chunk.settled()
    assert name in cache.buffers and torch.equal(chunk.settled(), expected), "still in host memory, as changed"
    monkeypatch.setattr(disk_module.os, "pwritev", original)
    cache._release(name)  # written now
    assert name not in cache.buffers
    cache.needed(chunk)
    assert torch.equal(chunk.settled(), expected)


def test_a_failed_read_leaves_the_chunk_on_disk_and_the_next_access_reads_it_again(tmp_path, monkeypatch):
    # The read's error was raised once, and the chunk kept the buffer it had not filled: a caller that went on after the
    # error (to save a checkpoint) read those bytes as its optimizer states, and the checkpoint took them.
    cache, name, chunk = _trained_cache(tmp_path)
    expected = chunk.settled().clone()
    cache._release(name)  # written back, on disk alone
    original = disk_module.os.preadv

    def broken(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(disk_module.os, "preadv", broken)
    for _ in range(2):  # and again, rather than handing over the unfilled buffer
        with pytest.raises(DiskTierError, match=rf"reading {name} from .*\(Input/output error\)"):
            with cache.using([chunk]):
                chunk.host
        assert name not in cache.buffers and chunk.state is ChunkState.DISK
    monkeypatch.setattr(disk_module.os, "preadv", original)
    with cache.using([chunk]):
        assert torch.equal(chunk.host, expected)
