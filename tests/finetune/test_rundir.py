"""A run's output directory: run.json written atomically, checkpoints pruned only after a verified save,
metrics cut back to the step a run resumes from."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import chunkmem.checkpoint as ckpt
import chunkmem.files
from chunkmem.errors import CheckpointDamaged
from chunkmem.finetune.hf import InputError
from chunkmem.finetune.rundir import RunDir
from tests.helpers import mlp, mlp_batches, mlp_loss, prepared, train


def trained():
    model, opt = prepared(mlp(), functools.partial(torch.optim.AdamW, lr=1e-2))
    train(model, opt, mlp_batches(1), mlp_loss)
    return model, opt


def test_run_json_is_replaced_atomically_and_the_directory_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12, item 7: run.json was written in place, so a kill mid-write left it half-written."""
    out = RunDir(tmp_path / "run")
    out.start({"lr": 1.0}, resume=False)
    replaced, synced = [], []
    replace = chunkmem.files.os.replace
    monkeypatch.setattr(chunkmem.files.os, "replace", lambda a, b: replaced.append((Path(a), Path(b))) or replace(a, b))
    monkeypatch.setattr(chunkmem.files, "fsync_dir", lambda path: synced.append(Path(path)))
    out.start({"lr": 1.0}, resume=True)
    assert (tmp_path / "run" / "run.json.tmp", tmp_path / "run" / "run.json") in replaced
    assert tmp_path / "run" in synced
    assert json.loads((tmp_path / "run" / "run.json").read_text()) == {"lr": 1.0}


def test_a_crash_while_writing_run_json_leaves_the_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = RunDir(tmp_path)
    out.start({"lr": 1.0}, resume=False)

    def full_disk(handle: int) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(chunkmem.files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="no space"):
        out.start({"lr": 1.0}, resume=True)
    assert json.loads((tmp_path / "run.json").read_text()) == {"lr": 1.0}


def test_older_checkpoints_go_only_after_the_new_one_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15, item 4: never delete an intact checkpoint before a newer one is verified."""
    model, opt = trained()
    out = RunDir(tmp_path)
    out.start({}, resume=False)
    out.save(model, opt, 1, keep=1)
    train(model, opt, mlp_batches(1, seed=3), mlp_loss)

    def unreadable(path: Path) -> dict:
        raise CheckpointDamaged(f"{path}: reads back wrong")

    monkeypatch.setattr(ckpt, "verify_checkpoint", unreadable)
    with pytest.raises(CheckpointDamaged):
        out.save(model, opt, 2, keep=1)
    monkeypatch.undo()
    assert out.saved_steps() == [1] and ckpt.verify_checkpoint(tmp_path / "checkpoints" / "step-00000001")
    out.save(model, opt, 2, keep=1)
    assert out.saved_steps() == [2] and not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_resume_or_start_starts_where_an_earlier_run_saved_nothing_whatever_its_settings(tmp_path: Path) -> None:
    # A run killed before its first checkpoint left run.json: --resume-or-start with other settings was refused as a
    # resume with changed settings, though there was nothing to resume; its metrics rows are not this run's.
    out = RunDir(tmp_path)
    out.start({"lr": 1.0}, resume=False)
    out.log_metrics({"step": 1, "loss": 1.0})
    out.start({"lr": 2.0}, resume=True)
    assert json.loads((tmp_path / "run.json").read_text()) == {"lr": 2.0}
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    with pytest.raises(InputError, match="no checkpoint"):  # --resume itself still needs one
        out.start({"lr": 2.0}, resume=True, required=True)


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path: Path) -> None:
    out = RunDir(tmp_path)
    out.start({}, resume=False)
    for step in (1, 2, 3):
        out.log_metrics({"step": step, "loss": 1.0})
    out.log_metrics({"step": 2, "eval_loss": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "lo')  # the line a kill cut short
    out.cut_metrics(2)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"step": 2, "eval_loss": 1.0}]


def test_a_save_of_the_same_step_killed_between_its_renames_leaves_the_earlier_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The earlier save was moved aside (step-N.old) and the new one not yet put in place (step-N.tmp): the next
    # start removed the .tmp and never looked at the .old, so step N was gone.
    model, opt = trained()
    out = RunDir(tmp_path)
    out.start({}, resume=False)
    out.save(model, opt, 3, keep=2)
    rename = Path.rename

    def killed(self: Path, target: Path) -> Path:
        if self.name.endswith(".tmp"):
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        out.save(model, opt, 3, keep=2)
    monkeypatch.undo()
    assert out.saved_steps() == []
    RunDir(tmp_path).start({}, resume=True)
    assert out.saved_steps() == [3] and ckpt.verify_checkpoint(tmp_path / "checkpoints" / "step-00000003")


def test_an_output_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    with pytest.raises(InputError, match=r"--output .*a_file/run: cannot make that directory \(Not a directory\)"):
        RunDir(tmp_path / "a_file" / "run").start({"lr": 1.0}, resume=False)
