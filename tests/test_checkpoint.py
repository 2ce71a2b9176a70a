"""Checkpoints resume bit-identically, survive a crash during save, and load with another layout."""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import pytest
import torch

import chunkmem
import chunkmem.checkpoint as ckpt
from chunkmem.errors import CheckpointDamaged, CheckpointError
from tests.helpers import gpt2_batches, gpt2_loss, mlp, mlp_batches, mlp_loss, param_bytes, tiny_gpt2, train

def partly_frozen_mlp(seed: int = 0) -> torch.nn.Module:
    """An MLP with a frozen layer, given to the optimizer all the same (`AdamW(model.parameters())`, as plain PyTorch
    allows): its parameters never step. Loading a checkpoint of it raised KeyError, the model already changed."""
    model = mlp(seed=seed)
    model[2].requires_grad_(False)
    return model


CASES = {
    "adamw-fp32": (mlp, mlp_batches, mlp_loss, functools.partial(torch.optim.AdamW, lr=1e-2), "fp32"),
    "adamw-frozen-layer-fp32": (partly_frozen_mlp, mlp_batches, mlp_loss, functools.partial(torch.optim.AdamW, lr=1e-2),
                                "fp32"),
    "sgd-fp32": (mlp, mlp_batches, mlp_loss, functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9), "fp32"),
    # A tensor lr came back a float, which torch.optim's Adam rounds otherwise: the resumed run drifted by 4e-9.
    "adam-tensor-lr-fp32": (mlp, mlp_batches, mlp_loss, functools.partial(
        torch.optim.Adam, lr=torch.tensor(0.01), foreach=False, betas=(torch.tensor(0.9), torch.tensor(0.99))), "fp32"),
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


def test_a_run_resumed_with_an_lr_scheduler_the_saved_run_lacked_loads_its_checkpoint(tmp_path):
    # A scheduler's `initial_lr` in the groups was taken for another optimizer configuration (torch.optim's
    # load_state_dict takes the same states). An option the saved groups lack (one a later torch added, as AdamW's
    # `decoupled_weight_decay`) is at the optimizer's default, as optimizer.load_state_dict leaves it: it was refused.
    model, batches = mlp(), mlp_batches(4)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    full, full_opt = make(model, adamw, "fp32")
    full_losses = train(full, full_opt, batches, mlp_loss)
    first, first_opt = make(model, adamw, "fp32")
    losses = train(first, first_opt, batches[:2], mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "ckpt", first, first_opt)
    second, second_opt = make(mlp(seed=99), adamw, "fp32")
    torch.optim.lr_scheduler.LambdaLR(second_opt, lambda _: 1.0)
    chunkmem.load_checkpoint(tmp_path / "ckpt", second, second_opt)
    assert second_opt.param_groups[0]["initial_lr"] == 1e-2
    assert losses + train(second, second_opt, batches[2:], mlp_loss) == full_losses
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    del meta["param_groups"][0]["weight_decay"]
    meta["meta_checksum"] = ckpt.meta_checksum(meta)
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(meta))
    second_opt.param_groups[0]["weight_decay"] = 0.5
    chunkmem.load_checkpoint(tmp_path / "ckpt", second, second_opt)
    assert second_opt.param_groups[0]["weight_decay"] == second_opt.defaults["weight_decay"] == 1e-2


class _Scaled(torch.nn.Module):
    """An MLP with a float buffer of low precision, which a prepared model holds in the wider of its dtype and the
    compute dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale.to(x.dtype)


@pytest.mark.parametrize("saved,resumed", [("fp32", "bf16"), ("bf16", "fp32"), ("fp16", "bf16")])
def test_a_model_with_a_low_precision_buffer_resumes_in_another_dtype(tmp_path, saved, resumed):
    # The buffer's dtype follows the run's, and a checkpoint of another dtype's was refused as written by something
    # else (model.load_state_dict took it).
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    model, opt = make(_Scaled(), adamw, saved)
    train(model, opt, mlp_batches(2), mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "ckpt", model, opt)
    other, other_opt = make(_Scaled(), adamw, resumed)
    chunkmem.load_checkpoint(tmp_path / "ckpt", other, other_opt)
    assert torch.equal(other.state_dict()["scale"].float(), model.state_dict()["scale"].float())
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items() if k != "scale")


def test_adam_moments_kept_at_a_step_count_set_back_to_0_are_saved_and_loaded(tmp_path):
    # optimizer.state[p]["step"].zero_() keeps the moments (as torch.optim's); a checkpoint, or a state dict loaded,
    # then had none, and the resumed run started them afresh.
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    model, batches = mlp(), mlp_batches(4)
    plain = copy.deepcopy(model)
    plain_opt = adamw(plain.parameters())
    first, first_opt = make(model, adamw, "fp32", device_memory=param_bytes(model) // 2)
    for net, opt in ((plain, plain_opt), (first, first_opt)):
        train(net, opt, batches[:2], mlp_loss)
        for param in net.parameters():
            opt.state[param]["step"].zero_()
    chunkmem.save_checkpoint(tmp_path / "ckpt", first, first_opt)
    want = train(plain, plain_opt, batches[2:], mlp_loss)
    for load in ("checkpoint", "state dict"):
        second, second_opt = make(mlp(seed=99), adamw, "fp32", device_memory=param_bytes(model) // 2)
        if load == "checkpoint":
            chunkmem.load_checkpoint(tmp_path / "ckpt", second, second_opt)
        else:
            second.load_state_dict(first.state_dict())
            second_opt.load_state_dict(first_opt.state_dict())
        assert len(second_opt.state_dict()["state"]) == len(plain_opt.state_dict()["state"]) == 14
        assert train(second, second_opt, batches[2:], mlp_loss) == want


def test_a_checkpoint_resumed_in_another_dtype_says_so(tmp_path, caplog):
    # It loaded in silence, fp16's loss scale dropped.
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    saved, saved_opt = make(mlp(), adamw, "fp16")
    chunkmem.save_checkpoint(tmp_path / "ckpt", saved, saved_opt)
    for dtype, said in (("fp16", None), ("bf16", "resumes in dtype='bf16': its loss scale is not used")):
        model, opt = make(mlp(), adamw, dtype)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chunkmem"):
            chunkmem.load_checkpoint(tmp_path / "ckpt", model, opt)
        assert [r.getMessage().endswith(said) for r in caplog.records] == ([] if said is None else [True])


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


def test_a_save_where_nothing_can_be_written_says_so_and_claims_no_previous_checkpoint(tmp_path):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match=r"could not write the checkpoint .*\): save where this process can"):
        chunkmem.save_checkpoint(tmp_path / "a_file" / "c", model, opt)


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(1), mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    saved = model.state_dict()
    train(model, opt, mlp_batches(2, seed=5), mlp_loss)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(CheckpointError, match="could not write the checkpoint .*disk full.*previous checkpoint"):
        chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    monkeypatch.undo()
    assert not (tmp_path / "c.tmp").exists()  # nothing half-written left to fill the disk
    chunkmem.load_checkpoint(tmp_path / "c", model, opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())


@pytest.mark.parametrize("place", ["c", "c.old", "c.tmp"])
@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_save_replaces_or_removes_only_what_a_save_wrote(tmp_path, place, kind):
    # It swaps its directory in by renames and removes the one before (the Note on atomic save): given a folder of
    # the user's, or with the user's backup beside it at <path>.old, it deleted them.
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(1), mlp_loss)
    if place != "c":
        chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    users = tmp_path / place
    if kind == "file":
        users.write_text("mine")
    else:
        users.mkdir()
        (users / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"{users} is a (file|directory holding notes.txt), not a chunkmem "
                                              "checkpoint.*new or empty directory"):
        chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    assert (users if kind == "file" else users / "notes.txt").read_text() == "mine"
    (users.unlink() if kind == "file" else (users / "notes.txt").unlink())
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)  # an empty directory is the user's to give
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)  # and one a save wrote is replaced


def test_a_checkpoint_with_momentum_into_an_sgd_without_is_refused_and_changes_nothing(tmp_path):
    # The load took the momentum and dropped its buffers, and the next step raised an error that did not name the
    # checkpoint.
    model, opt = make(mlp(), functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9), "fp32")
    train(model, opt, mlp_batches(2), mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    other, other_opt = make(mlp(seed=3), functools.partial(torch.optim.SGD, lr=0.05), "fp32")
    before = other.state_dict()
    with pytest.raises(CheckpointError, match=r"param_groups\[0\] was saved with momentum=0.9.*make it with the "):
        chunkmem.load_checkpoint(tmp_path / "c", other, other_opt)
    assert other_opt.param_groups[0]["momentum"] == 0
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())


def test_interrupted_swap_falls_back_to_the_old_checkpoint(tmp_path, caplog):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(1), mlp_loss)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    chunkmem.save_checkpoint(tmp_path / "newer", model, opt)
    (tmp_path / "c").rename(tmp_path / "c.old")  # the crash came between the two renames
    (tmp_path / "newer").rename(tmp_path / "c.tmp")
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        meta = chunkmem.load_checkpoint(tmp_path / "c", model, opt)
    assert meta["format"] == ckpt.FORMAT
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"{tmp_path / 'c.old'}, is read; the one it wrote, {tmp_path / 'c.tmp'}, may be whole" in said


def test_missing_checkpoint_and_wrong_objects_are_clear_errors(tmp_path):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    with pytest.raises(FileNotFoundError, match="no chunkmem checkpoint at"):
        chunkmem.load_checkpoint(tmp_path / "nothing", model, opt)
    with pytest.raises(TypeError, match="returned by chunkmem.prepare"):
        chunkmem.save_checkpoint(tmp_path / "c", model.module, opt)
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    with pytest.raises(FileNotFoundError, match=f"pass its directory, {tmp_path / 'c'}"):
        chunkmem.load_checkpoint(tmp_path / "c" / ckpt.META, model, opt)
    other, sgd = make(mlp(), functools.partial(torch.optim.SGD, lr=0.1), "fp32")
    with pytest.raises(ValueError, match="checkpoint holds AdamW state but the optimizer is SGD"):
        chunkmem.load_checkpoint(tmp_path / "c", other, sgd)


# -- a failed load changes nothing; damage is found and named (issue 12, items 4 and 5) -------------------

def _trained(steps: int = 2):
    model, opt = make(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    train(model, opt, mlp_batches(steps), mlp_loss)
    return model, opt


def _snapshot(model, opt) -> dict:
    """Everything a load could change: values, every optimizer state, step counts, group settings."""
    runtime = model.runtime
    states = {f"{kind}/{r.name}": v for kind in opt.rule.states for r, v in runtime.data.values(kind).items()}
    return {"model": model.state_dict(), "states": states,
            "steps": {r.name: float(s) for r, s in opt.steps.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def _assert_same(before: dict, after: dict) -> None:
    for part in ("model", "states"):
        assert before[part].keys() == after[part].keys()
        for key in before[part]:
            assert torch.equal(before[part][key], after[part][key]), (part, key)
    assert before["steps"] == after["steps"] and before["groups"] == after["groups"]


def _rewrite(path, tensors=None, meta=None, checksums=True) -> None:
    """Replace a checkpoint's files, with checksums that match (so only the change under test is wrong)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / ckpt.TENSORS) if tensors is None else tensors
    meta = json.loads((path / ckpt.META).read_text()) if meta is None else meta
    if checksums:
        meta["checksums"] = {k: ckpt.checksum(v) for k, v in tensors.items()}
        meta["meta_checksum"] = ckpt.meta_checksum(meta)
    save_file(tensors, path / ckpt.TENSORS)
    (path / ckpt.META).write_text(json.dumps(meta))


def _saved(tmp_path, model, opt):
    from safetensors.torch import load_file

    path = chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    return path, load_file(path / ckpt.TENSORS), json.loads((path / ckpt.META).read_text())


def _drop(mapping: dict, key: str) -> dict:
    return {k: v for k, v in mapping.items() if k != key}


def _damage(kind: str, tensors: dict, meta: dict) -> tuple[dict, dict, str]:
    """One way a checkpoint can be wrong, applied to a good one; the text its error must name."""
    last = "model/12.weight"  # the last layer: a load that writes as it checks has overwritten the rest
    if kind == "no steps":
        return tensors, _drop(meta, "steps"), "'steps'"
    if kind == "no param_groups":
        return tensors, _drop(meta, "param_groups"), "'param_groups'"
    if kind == "step missing for one parameter":
        return tensors, meta | {"steps": _drop(meta["steps"], "12.bias")}, "steps['12.bias']"
    if kind == "late shape":
        return tensors | {last: torch.zeros(4, 31)}, meta, "model/12.weight has shape (4, 31)"
    if kind == "lr, then a bad shape":
        groups = [g | {"lr": 0.5} for g in meta["param_groups"]]
        return tensors | {last: torch.zeros(3, 32)}, meta | {"param_groups": groups}, "model/12.weight"
    if kind == "exp_avg of a bias's shape":
        return tensors | {"optim/exp_avg/0.weight": torch.zeros(32)}, meta, "'optim/exp_avg/0.weight' has shape (32,)"
    if kind == "missing exp_avg_sq":
        return _drop(tensors, "optim/exp_avg_sq/4.weight"), meta, "no 'optim/exp_avg_sq/4.weight'"
    if kind == "missing buffer-free model key":
        return _drop(tensors, "model/2.bias"), meta, "no value for model/2.bias"
    if kind == "unknown model key":
        return tensors | {"model/99.weight": torch.zeros(2)}, meta, "model/99.weight"
    if kind == "half-precision weight":  # a value rounded (or, an int, truncated) as it is copied in
        return tensors | {last: tensors[last].half()}, meta, "'model/12.weight' is torch.float16, expected torch.float32"
    if kind == "bf16 exp_avg_sq":
        key = "optim/exp_avg_sq/4.weight"
        return tensors | {key: tensors[key].bfloat16()}, meta, f"{key!r} is torch.bfloat16"
    if kind == "NaN step count":  # the next step would fill the weights with NaN
        return tensors, meta | {"steps": meta["steps"] | {"12.bias": float("nan")}}, "steps['12.bias'] is nan"
    if kind == "half a step":
        return tensors, meta | {"steps": meta["steps"] | {"12.bias": 2.5}}, "steps['12.bias'] is 2.5"
    if kind == "lr a string":  # the next step would raise, the optimizer already changed
        groups = [g | {"lr": "fast"} for g in meta["param_groups"]]
        return tensors, meta | {"param_groups": groups}, "param_groups[0]['lr'] is 'fast'"
    if kind == "betas a number":
        groups = [g | {"betas": 0.9} for g in meta["param_groups"]]
        return tensors, meta | {"param_groups": groups}, "param_groups[0]['betas'] is 0.9"
    if kind == "another group layout":
        groups = [meta["param_groups"][0], meta["param_groups"][0]]
        return tensors, meta | {"param_groups": groups}, "param_groups holds 2 groups"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["no steps", "no param_groups", "step missing for one parameter", "late shape",
                                  "lr, then a bad shape", "exp_avg of a bias's shape", "missing exp_avg_sq",
                                  "missing buffer-free model key", "unknown model key", "another group layout",
                                  "half-precision weight", "bf16 exp_avg_sq", "NaN step count", "half a step",
                                  "lr a string", "betas a number"])
def test_a_load_that_fails_changes_nothing_and_names_file_and_key(tmp_path, kind):
    model, opt = _trained()
    path, tensors, meta = _saved(tmp_path, model, opt)
    train(model, opt, mlp_batches(2, seed=7), mlp_loss)  # the target now differs from the checkpoint
    before = _snapshot(model, opt)
    tensors, meta, names = _damage(kind, tensors, meta)
    _rewrite(path, tensors, meta)
    with pytest.raises(CheckpointError) as caught:
        chunkmem.load_checkpoint(path, model, opt)
    assert str(path) in str(caught.value) and names in str(caught.value), str(caught.value)
    _assert_same(before, _snapshot(model, opt))
    assert train(model, opt, mlp_batches(1, seed=8), mlp_loss)  # and it still trains


def test_a_changed_digit_in_the_metadata_fails_its_checksum(tmp_path):
    model, opt = _trained()
    path, tensors, meta = _saved(tmp_path, model, opt)
    before = _snapshot(model, opt)
    meta["param_groups"][0]["lr"] *= 10  # a digit of the learning rate, its checksum left as saved
    (path / ckpt.META).write_text(json.dumps(meta))
    for load in (lambda: chunkmem.load_checkpoint(path, model, opt), lambda: ckpt.verify_checkpoint(path)):
        with pytest.raises(CheckpointDamaged, match=f"{ckpt.META} has checksum crc32:[0-9a-f]+, it recorded"):
            load()
    _assert_same(before, _snapshot(model, opt))


def test_flipped_bytes_in_a_weight_fail_the_checksum(tmp_path):
    model, opt = _trained()
    path = chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    before = _snapshot(model, opt)
    from safetensors import safe_open

    with safe_open(str(path / ckpt.TENSORS), "pt") as handle:
        value = handle.get_tensor("model/6.weight")
    data = bytearray((path / ckpt.TENSORS).read_bytes())
    at = bytes(data).find(value.contiguous().view(torch.uint8).numpy().tobytes())
    assert at > 0
    data[at + 17] ^= 0x40  # one bit of one weight: still a valid safetensors file
    (path / ckpt.TENSORS).write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged, match=r"tensor 'model/6.weight' has checksum .* recorded"):
        chunkmem.load_checkpoint(path, model, opt)
    with pytest.raises(CheckpointDamaged, match="model/6.weight"):
        ckpt.verify_checkpoint(path)
    _assert_same(before, _snapshot(model, opt))


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty meta"])
def test_unreadable_files_are_named_not_a_raw_safetensors_error(tmp_path, cut):
    model, opt = _trained()
    path = chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    data = (path / ckpt.TENSORS).read_bytes()
    if cut == "truncated":
        (path / ckpt.TENSORS).write_bytes(data[:len(data) // 2])
    elif cut == "garbage":
        (path / ckpt.TENSORS).write_bytes(b"\x07" * 64)
    else:
        (path / ckpt.META).write_text("")
    file = path / (ckpt.META if cut == "empty meta" else ckpt.TENSORS)
    for load in (lambda: chunkmem.load_checkpoint(path, model, opt), lambda: ckpt.verify_checkpoint(path)):
        with pytest.raises(CheckpointDamaged) as caught:
            load()
        assert str(file) in str(caught.value) and "earlier" in str(caught.value)


def test_checkpoints_before_checksums_still_load(tmp_path, caplog):
    """Format 1 (no checksums) loads with a warning, so runs saved before the upgrade resume."""
    model, opt = _trained()
    path, tensors, meta = _saved(tmp_path, model, opt)
    expected = _snapshot(model, opt)
    meta = _drop(_drop(meta, "checksums"), "meta_checksum")
    _rewrite(path, tensors, meta | {"format": ckpt.UNVERIFIED_FORMAT}, checksums=False)
    other, other_opt = make(mlp(seed=3), functools.partial(torch.optim.AdamW, lr=1e-2), "fp32")
    with caplog.at_level("WARNING", logger="chunkmem"):
        chunkmem.load_checkpoint(path, other, other_opt)
    assert "cannot be verified" in caplog.text
    _assert_same(expected, _snapshot(other, other_opt))
    _rewrite(path, tensors, meta | {"format": "chunkmem-checkpoint/9"}, checksums=False)
    with pytest.raises(CheckpointError, match="has format 'chunkmem-checkpoint/9'"):
        chunkmem.load_checkpoint(path, other, other_opt)


def test_save_fsyncs_the_directory_after_the_renames_and_verifies_first(tmp_path, monkeypatch):
    model, opt = _trained()
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    events = []
    monkeypatch.setattr(ckpt, "fsync_dir", lambda p: events.append(("fsync", p, sorted(x.name for x in p.iterdir()))))
    verify = ckpt.verify_checkpoint
    monkeypatch.setattr(ckpt, "verify_checkpoint", lambda p: events.append(("verify", p)) or verify(p))
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    parent = [e for e in events if e[0] == "fsync" and e[1] == tmp_path]
    assert parent and "c" in parent[-1][2] and "c.tmp" not in parent[-1][2]  # after the new one is in place
    assert events.index(("verify", tmp_path / "c.tmp")) < events.index(parent[0])  # verified before the swap


def _rename_refused(monkeypatch) -> None:
    rename = Path.rename

    def refused(self: Path, target):
        if self.name.endswith(".tmp"):
            raise PermissionError(13, "Permission denied")
        return rename(self, target)
    monkeypatch.setattr(Path, "rename", refused)


def _read_back_wrong(monkeypatch) -> None:
    def bad_disk(path):
        raise CheckpointDamaged(f"{path}: read back wrong")
    monkeypatch.setattr(ckpt, "verify_checkpoint", bad_disk)


@pytest.mark.parametrize("fault, error, message", [
    # The renames' OSError came bare, and said nothing of the checkpoint moved aside, which a load reads.
    (_rename_refused, CheckpointError, "Permission denied.*the previous checkpoint is intact, and load_"),
    (_read_back_wrong, CheckpointDamaged, "c.tmp: read back wrong"),
], ids=["rename refused", "read back wrong"])
def test_a_save_that_fails_at_the_end_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fault, error, message):
    model, opt = _trained()
    chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    before = _snapshot(model, opt)
    train(model, opt, mlp_batches(1, seed=5), mlp_loss)
    fault(monkeypatch)
    with pytest.raises(error, match=message):
        chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    monkeypatch.undo()
    chunkmem.load_checkpoint(tmp_path / "c", model, opt)
    _assert_same(before, _snapshot(model, opt))


def test_tensor_file_has_the_mode_of_the_other_files(tmp_path):
    """Issue 15, item 6: safetensors writes 0600 whatever the umask."""
    import os

    model, opt = _trained(1)
    old = os.umask(0o002)
    try:
        path = chunkmem.save_checkpoint(tmp_path / "c", model, opt)
    finally:
        os.umask(old)
    assert (path / ckpt.TENSORS).stat().st_mode & 0o777 == 0o664 == (path / ckpt.META).stat().st_mode & 0o777


def test_loading_a_checkpoint_without_optimizer_state_leaves_the_state_chunks_free(tmp_path):
    # No parameter has stepped: nothing to restore into the state chunks, which stay unmade (they read as zeros).
    model, adamw = mlp(), functools.partial(torch.optim.AdamW, lr=1e-2)
    budget = param_bytes(model)  # below the model data: nothing is brought to the device at prepare
    cm, opt = make(model, adamw, "fp32", device_memory=budget)
    chunkmem.save_checkpoint(tmp_path / "ckpt", cm, opt)
    fresh, fresh_opt = make(model, adamw, "fp32", device_memory=budget)
    chunkmem.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    states = [c for g in fresh.runtime.store.trainable_groups() for k, c in g.chunks.items() if k.startswith("exp_avg")]
    assert states and all(c.state.name == "FREE" for c in states)
