"""The output directory of a fine-tuning run: what is in it, and how a run resumes from it.

    OUTPUT/
      config.json, model-0000k-of-N.safetensors, model.safetensors.index.json, tokenizer files
      run.json                     the settings that must not change across a resume
      metrics.jsonl                one JSON line per logged step and per evaluation
      checkpoints/step-00000050/   chunkmem.save_checkpoint directories, the last K kept

A checkpoint's step is its name, and everything else a run needs to continue (data order, learning
rate, dropout seeds) is a function of the step and run.json, so a checkpoint is all a resume reads.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import chunkmem
from chunkmem.hf import InputError
from chunkmem.optim import ChunkOptimizer
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

    def saved_steps(self) -> list[int]:
        """Steps of complete checkpoints, oldest first (a save killed half-way left only a .tmp)."""
        if not self.checkpoints.is_dir():
            return []
        found = (_STEP_DIR.fullmatch(p.name) for p in self.checkpoints.iterdir() if (p / "meta.json").exists())
        return sorted(int(m.group(1)) for m in found if m)

    def start(self, settings: dict[str, Any], resume: bool) -> None:
        """Create the directory, or check that a resumed run has the same settings."""
        run_file = self.path / RUN
        if run_file.exists() and self.saved_steps() and not resume:
            raise InputError(f"--output {self.path} holds checkpoints of an earlier run: pass --resume to "
                             f"continue it, or choose another --output")
        if resume and run_file.exists():
            before = json.loads(run_file.read_text())
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            if changed:
                raise InputError(f"--resume with settings that differ from the run in {self.path}: "
                                 + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items())
                                 + "; use the same settings, or another --output")
        self.path.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(settings, indent=1))

    def resume(self, model: ChunkedModel, optimizer: ChunkOptimizer) -> int:
        """Load the newest checkpoint; returns its step (0 when there is none)."""
        steps = self.saved_steps()
        if not steps:
            log.info("nothing to resume in %s: starting at step 0", self.checkpoints)
            return 0
        chunkmem.load_checkpoint(self._step_dir(steps[-1]), model, optimizer)
        log.info("resumed from %s", self._step_dir(steps[-1]))
        return steps[-1]

    def save(self, model: ChunkedModel, optimizer: ChunkOptimizer, step: int, keep: int) -> Path:
        """An atomic checkpoint at `step`; older ones beyond the last `keep` are deleted."""
        path = chunkmem.save_checkpoint(self._step_dir(step), model, optimizer)
        for old in self.saved_steps()[:-keep]:
            shutil.rmtree(self._step_dir(old), ignore_errors=True)
        for stray in self.checkpoints.glob("*.tmp"):  # left by a save that was killed
            shutil.rmtree(stray, ignore_errors=True)
        return path

    def log_metrics(self, record: dict[str, Any]) -> None:
        with open(self.path / METRICS, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def _step_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"
