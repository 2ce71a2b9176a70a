"""The output directory of a fine-tuning run: what is in it, and how a run resumes from it.

    OUTPUT/
      config.json, model-0000k-of-N.safetensors, model.safetensors.index.json, tokenizer files
      run.json                     the settings that must not change across a resume
      metrics.jsonl                one JSON line per logged step and per evaluation
      checkpoints/step-00000050/   chunkmem.save_checkpoint directories, the last K kept

A checkpoint's step is its name, and everything else a run needs to continue (data order, learning
rate, dropout seeds) is a function of the step and run.json, so a checkpoint is all a resume reads.

[Note: losing nothing]
A checkpoint is verified against its checksums before it counts (chunkmem.checkpoint), and older
ones are deleted only after that, so an intact checkpoint never goes before a newer one is known to
be whole. A resume takes the newest checkpoint that loads; one that fails its checksums is renamed
`step-N.damaged` (kept for inspection, out of the way of later saves) with a warning, and the one
before it is tried. metrics.jsonl is cut back to the step the run resumes from, so it holds each
step once however often the run was interrupted.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import chunkmem
from chunkmem.errors import CheckpointDamaged
from chunkmem.files import write_text
from chunkmem.finetune.hf import InputError
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.wrapper import ChunkedModel

log = logging.getLogger("chunkmem")

RUN = "run.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"step-(\d{8})")


class RunDir:
    """One run's output directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / CHECKPOINTS

    def is_a_run(self) -> bool:
        """Whether a chunkmem finetune run wrote this directory: its run.json records a run's settings (another tool's
        run.json, Sacred's, does not; a damaged one is ours where checkpoints of ours lie beside it: `start` names
        it)."""
        try:
            settings = json.loads((self.path / RUN).read_text())
        except OSError:
            return False
        except ValueError:
            return bool(self.saved_steps())
        return isinstance(settings, dict) and {"model", "batch_size", "seq_len", "lr"} <= settings.keys()

    def saved_steps(self) -> list[int]:
        """Steps of complete checkpoints, oldest first (a save killed half-way left only a .tmp)."""
        if not self.checkpoints.is_dir():
            return []
        found = (_STEP_DIR.fullmatch(p.name) for p in self.checkpoints.iterdir() if (p / "meta.json").exists())
        return sorted(int(m.group(1)) for m in found if m)

    def start(self, settings: dict[str, Any], resume: bool, required: bool = False) -> None:
        """Create the directory, or check that a resumed run has the same settings (and, when `required`,
        that there is a checkpoint to resume from)."""
        run_file = self.path / RUN
        saved = bool(self.saved_steps())
        if required and not saved:
            raise InputError(f"--resume: there is no checkpoint in {self.checkpoints} to resume from; run "
                             f"without --resume to start, or pass --resume-or-start to do whichever applies")
        if run_file.exists() and saved and not resume:
            raise InputError(f"--output {self.path} holds checkpoints of an earlier run: pass --resume to "
                             f"continue it, or choose another --output")
        # --resume-or-start with no checkpoint starts, whatever settings a run killed before its first save had
        resume = resume and saved
        if resume and run_file.exists():
            try:
                before = json.loads(run_file.read_text())
            except ValueError as error:  # cut short by a full disk, edited by hand
                raise InputError(f"--resume: {run_file} is damaged ({error}): it records the settings the run must keep; "
                                 "restore it, or start again with another --output") from None
            # A setting the earlier run did not record (an older chunkmem's) is not compared.
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k, v) != v}
            if changed:
                raise InputError(f"--resume with settings that differ from the run in {self.path}: "
                                 + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
                                 + "; use the same settings, or another --output")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InputError(f"--output {self.path}: cannot make that directory ({error.strerror or error}); pass one "
                             "you can write") from None
        write_text(run_file, json.dumps(settings, indent=1))
        self._remove_leftovers()
        if not resume:
            self.cut_metrics(0)  # an earlier run's rows (one that saved no checkpoint) are not this run's

    def resume(self, model: ChunkedModel, optimizer: ChunkOptimizer) -> int:
        """Load the newest intact checkpoint; returns its step (0 when there is none)."""
        steps = self.saved_steps()
        damaged = []
        for step in reversed(steps):
            try:
                chunkmem.load_checkpoint(self._step_dir(step), model, optimizer)
            except CheckpointDamaged as error:
                damaged.append(self._set_aside(step, error))
                continue
            log.info("resumed from %s", self._step_dir(step))
            self.cut_metrics(step)
            return step
        if damaged:
            raise InputError(f"--resume: every checkpoint in {self.checkpoints} is damaged ({'; '.join(damaged)}); "
                             f"start again without --resume, or with another --output")
        log.warning("no checkpoint in %s: starting at step 0", self.checkpoints)
        self.cut_metrics(0)
        return 0

    def _set_aside(self, step: int, error: CheckpointDamaged) -> str:
        path = self._step_dir(step)
        aside = path.with_name(path.name + ".damaged")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        log.warning("checkpoint %s is damaged (%s); moved it to %s and trying the one before", path, error, aside)
        return f"{path.name}: {error}"

    def save(self, model: ChunkedModel, optimizer: ChunkOptimizer, step: int, keep: int) -> Path:
        """A verified checkpoint at `step`; then older ones beyond the last `keep` are deleted."""
        path = chunkmem.save_checkpoint(self._step_dir(step), model, optimizer)  # verified before it counts
        older = [s for s in self.saved_steps() if s < step]
        for old in older[:max(0, len(older) - (keep - 1))]:
            shutil.rmtree(self._step_dir(old), ignore_errors=True)
        self._remove_leftovers()
        return path

    def _remove_leftovers(self) -> None:
        """Folders of saves that were killed half-way; a checkpoint such a save of the same step had moved aside
        (checkpoint.swap_in) takes its place again."""
        if self.checkpoints.is_dir():
            for stray in self.checkpoints.glob("*.tmp"):
                shutil.rmtree(stray, ignore_errors=True)
            for old in self.checkpoints.glob("*.old"):
                kept = old.with_suffix("")
                if kept.exists():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.rename(kept)

    def log_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def cut_metrics(self, step: int) -> None:
        """Keep the records of steps up to `step`: those after it will be logged again."""
        file = self.path / METRICS
        if not file.exists():
            return
        kept = [line for line in file.read_text(encoding="utf-8").splitlines()
                if line.strip() and _step_of(line) <= step]
        write_text(file, "".join(line + "\n" for line in kept))

    def _step_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"


def _step_of(line: str) -> float:
    """The step of a metrics line; a line cut short by a kill counts as after every step."""
    try:
        return float(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return float("inf")
