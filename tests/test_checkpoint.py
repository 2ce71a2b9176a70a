"""Checkpoints resume bit-identically, survive a crash during save, and load with another layout."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

import chunkmem
import chunkmem.checkpoint as ckpt
from tests.helpers import gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss, param_bytes, tiny_gpt2, train

CASES = {
    "adamw-fp32": (mlp, mlp_batches, mlp_loss, functools.partial(torch.optim.AdamW, lr=1e-2), "fp32"),
    "sgd-fp32": (mlp, mlp_batches, mlp_loss, functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9), "fp32"),
    "adamw-gpt2-bf16": (tiny_gpt2, gpt2_batches, gpt2_loss, functools.partial(torch.optim.AdamW, lr=1e-3), "bf16"),
    "adam-gpt2-fp16": (tiny_gpt2, gpt2_batches, gpt2_loss, functools.partial(torch.optim.Adam, lr=1e-3), "fp16"),
}


def make(model, make_opt, dtype, **config):
    model = copy.deepcopy(model)
    return chunkmem.prepare(model, make_opt(model.parameters()),
                            chunkmem.Config(device="cpu", dtype=dtype, **config))


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bit_identical_to_uninterrupted_training(case, tmp_path):
    build, batches_fn, loss_fn, make_opt, dtype = CASES[case]
    model, batches = build(), batches_fn(6)
    full, full_opt = make(model, make_opt, dtype)
    full_losses = train(full, full_opt, batches, loss_fn)

    first, first_opt = make(model, make_opt, dtype, device_memory=param_bytes(model) // 2)
    losses = train(first, first_opt, batches[:3], loss_fn)
    chunkmem.save_checkpoint(tmp_path / "ckpt", first, first_opt)
    # Resume in a fresh process-like setting: another chunk size and another budget.
    second, second_opt = make(build(seed=99), make_opt, dtype, chunk_size=first.memory_stats()["chunk_size"] * 2)
    chunkmem.load_checkpoint(tmp_path / "ckpt", second, second_opt)
    losses += train(second, second_opt, batches[3:], loss_fn)

    assert losses == full_losses
    expected, got = full.state_dict(), second.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_checkpoint_is_safetensors_and_json(tmp_path):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(1), mlp_loss)
    path = chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "state.safetensors"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == ckpt.FORMAT and meta["steps"]["0.weight"] == 1.0
    from safetensors import safe_open
    with safe_open(str(path / "state.safetensors"), "pt") as f:
        assert "optim/exp_avg/0.weight" in f.keys() and "model/0.weight" in f.keys()


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(1), mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    saved = model.state_dict()
    train(model, opt, mlp_batches(2, seed=5), mlp_loss)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    monkeypatch.undo()
    chunkmem.load_checkpoint(tmp_path / "c", model, opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())


def test_interrupted_swap_falls_back_to_the_old_checkpoint(tmp_path):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(1), mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    (tmp_path / "c").rename(tmp_path / "c.old")  # the crash came between the two renames
    meta = chunkmem.load_checkpoint(tmp_path / "c", model, opt)
    assert meta["format"] == ckpt.FORMAT


def test_missing_checkpoint_and_wrong_objects_are_clear_errors(tmp_path):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    with pytest.raises(FileNotFoundError, match="no chunkmem checkpoint at"):
        chunkmem.load_checkpoint(tmp_path / "nothing", model, opt)
    with pytest.raises(TypeError, match="returned by chunkmem.prepare"):
        chunkmem.save_checkpoint(tmp_path / "c", model.module, opt)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    other, sgd = make(mlp(), functools.partial(torch.optim.SGD, lr=0.1), "fp32")
    with pytest.raises(ValueError, match="checkpoint holds AdamW state but the optimizer is SGD"):
        chunkmem.load_checkpoint(tmp_path / "c", other, sgd)
