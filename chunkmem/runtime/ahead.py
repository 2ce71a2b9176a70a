"""Host updates made ahead of `step()`, while backward goes on (Config.overlap_update).

[Note: updates made ahead]
On a GPU the host update of the chunk groups that stream is the longest part of a step (194 of 517 ms at half
the model data of benchmarks/gpu_offload.py's 1.16B LLaMA on the lent H100), and it waited for backward to end,
though a group's gradients are complete long before: its last one lands on the host mid-backward. So once
backward has written every gradient of a host group (each overwritten once: nothing accumulated), a worker
thread waits for their downloads to land and runs the native kernel on them *into spare buffers* (master, states
and the low-precision parameter copy), leaving the chunks as they were. The host joins the worker when backward
ends, so code between backward and `step()` (clipping, logging) runs alone. `step()` adopts a group's result (the
spare buffers become its payloads, the old payloads the next spares; the parameter copy is copied in, since
parameters view their chunk) when nothing the update read has changed:
- the gradients: their chunk's version counter, which every in-place write moves (through `p.grad` too), or,
  where it moved, their bytes against a copy the worker kept of them before the update (torch's
  clip_grad_norm_ multiplies by a coefficient of 1 when the norm is below the limit: the same bytes). The copy
  is a pass over the gradients on the thread that bounds a streaming step (the time model charges it), so it is
  kept only after a step whose gradients were written between backward and `step()`: an update made without one
  whose gradients were then written is redone (`unkept` counts them), and the next step keeps copies. The
  prepared model's own clip_grad_norm_ leaves host gradients unwritten at a coefficient of 1, so a loop that
  clips through it (finetune, the Trainer) keeps none;
- the arguments of the kernel: hyperparameters, step count, loss scale (an fp16 overflow skips the step, and
  adopts nothing);
- master weights and states: their host payloads and version counters (a checkpoint loaded, weights rolled back).
Else the group updates as it would have, and `redone` counts it. A gradient written into a group during
backward after its update started (added to one already written) voids that update. An adopted update is the same
kernel on the same bytes, so its results are the bits of the update after backward. Gradients cleared (`zero_grad`)
or written by another backward before `step()` (accumulation begun this step, a batch thrown away and another taken)
drop every update made so far, once done; so does a backward that raised, and the next starts nothing ahead itself.
Version counters do not see every change of the gradients (the CUDA copy engine's downloads move none), hence these
rules rather than counters alone. An update that failed on the worker is made by `step()`, and backward raises its
error once it has ended (the host's state as after any backward).
A step whose updates made ahead were all redone (clipping that scales every step, say) makes none for the next step,
then for 2, 4, ... up to MAX_REST steps while that goes on (`rested` counts them); a step that adopts one ends it.
Redone work is not free: it takes the host's memory bandwidth from the copies beside it.
Only while a plan is followed (the warm-up records what the optimizer touches), for host groups in low precision
stepped whole by the native Adam, one optimizer per runtime, without a disk tier or ZeRO shards; and only in the
first backward after a step that had one backward (with accumulation, every group would be redone). The spare
buffers cost host memory: 16 bytes per parameter of the groups updated ahead (fp32 master and states, and
a low-precision copy of the gradient and of the parameter). They count against Config.host_memory like chunks: a
group whose spares would take host memory past it is updated in `step()`, as without this option, and one
warning says so (the pool would otherwise hand them out as pageable memory beyond the budget).

[Note: the worker's threads]
On the lent H200 (1.16B LLaMA, half its model data) updates made ahead on 15 of 16 threads made the step slower,
0.437 s against 0.335. The backward stage, which ends waiting for the worker, took 272 ms against 83; with 51% of
the worker's time before backward ended and the update alone taking 150 ms, backward itself took 139 to 199 ms.
The thread that launches backward's kernels, the copy engine's and the OpenMP team shared 16 cores;
benchmarks/host_threads.py, in the same run, saw a launching thread keep 46% of its rate beside a team of 15 and
74% beside one of 8 (the team's update at 110 and 72 GB/s). So while backward runs an update takes half of
torch's threads, and once backward has ended and the host waits for the worker, all of them. Not yet measured on
a GPU: benchmarks/gpu_session.sh's 0.5+ahead row will say whether it pays.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from chunkmem.chunks.chunk import Chunk
from chunkmem.chunks.placement import Phase
from chunkmem.chunks.state import ChunkState
from chunkmem.chunks.store import ChunkGroup, ParamRecord
from chunkmem.memory import native

if TYPE_CHECKING:
    from chunkmem.memory.native import Range
    from chunkmem.runtime.optim import ChunkOptimizer, Span
    from chunkmem.runtime.runtime import Runtime

_log = logging.getLogger("chunkmem")

STATES = ("exp_avg", "exp_avg_sq")
MAX_REST = 16  # steps without updates made ahead, at most, after steps whose updates were all redone


@dataclasses.dataclass
class Spares:
    """Buffers an update ahead writes into, for one chunk group."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    param: torch.Tensor
    grad: torch.Tensor  # the gradients the update read


@dataclasses.dataclass
class Job:
    group: ChunkGroup
    ranges: list[Range]  # the ranges of the chunks native.adam_step updated, and what it was given for each
    spares: Spares
    done: Future
    kept: bool  # the worker kept a copy of the gradients (spares.grad) and updated from it
    inputs: list[tuple[torch.Tensor, int]]  # master's and the states' host payloads, and their version counters
    version: int = -1  # the gradient chunk's version counter when backward ended (-1: it did not end)
    void: bool = False  # a gradient was written into the group after the update started, or the update failed


class Ahead:
    """Updates ahead of `step()` for one runtime and its optimizer (the Note on updates made ahead)."""

    def __init__(self, runtime: Runtime, optimizer: ChunkOptimizer) -> None:
        self.runtime = runtime
        self.optimizer = optimizer
        self.worker = Worker()
        self.spares: dict[int, Spares] = {}  # group index -> its spare buffers, kept across steps
        self.jobs: dict[int, Job] = {}  # group index -> its update ahead in this step
        self.overwritten: dict[int, int] = {}  # group index -> gradients this backward wrote, none accumulated
        self.backwards = 0  # since the last step
        self.task: int | None = None  # the backward (autograd graph task) `overwritten` counts in, until it ends
        self.group_of: dict[ParamRecord, dict] | None = None  # the optimizer's, read once a backward
        self.single = False  # the last step had one backward
        self.adopted = 0  # group updates adopted by step()
        self.redone = 0  # made ahead, then redone by step() (something they read changed)
        self.unkept = 0  # of those, made without a copy of gradients that were written after backward (the Note)
        self.keep = False  # updates made ahead keep a copy of their gradients (the Note)
        self.written_after: bool | None = None  # whether step() found gradients written after backward (None: no job)
        self.busy_s = 0.0  # the worker's time on updates (waits for downloads included)
        self.hidden_s = 0.0  # the part of it before backward ended: what overlapped backward
        self.over_budget: set[int] = set()  # groups whose spares Config.host_memory cannot hold
        self.resting = 0  # steps left that make nothing ahead (the Note: after a step whose updates were all redone)
        self.rest = 1  # how many the next rest lasts
        self.rested = 0  # steps that made nothing ahead, resting
        self.counted = (0, 0)  # (adopted, redone less unkept) when this step began
        self.joined = False  # backward ended and the host waits for the worker (the Note on the worker's threads)

    def written(self, record: ParamRecord, accumulated: bool) -> None:
        """Backward wrote `record`'s gradient (into a host group's chunk); its group's update may start."""
        task = self.runtime.backward_task
        if task != self.task:  # a new backward
            if self.task is not None:  # the one before did not end: it raised
                self.backwards += 1
            if self.backwards:  # what a backward before it in this step started read gradients this one changes
                self.drop()
            self.task, self.joined = task, False
            self.overwritten.clear()
        if self.backwards or not self.single or self.resting:
            return
        index = record.group.index
        count = self.overwritten.get(index, 0)
        if accumulated or count < 0:
            self.overwritten[index] = -1  # this group waits for step()
            if index in self.jobs:  # its update started from gradients this one adds to
                self.jobs[index].void = True
            return
        self.overwritten[index] = count + 1
        if count + 1 == len(record.group.members):
            self._start(record.group)

    def _start(self, group: ChunkGroup) -> None:
        optimizer = self.optimizer
        if not self._allowed(group):
            return
        if self.group_of is None:
            self.group_of = optimizer.group_of()
        if any(r not in self.group_of for r in group.members):  # some parameters are not the optimizer's
            return
        if not optimizer.steps_adam:
            return
        uniform = optimizer.uniform(group, group.members, self.group_of)
        spans = optimizer.spans(group, group.members, self.group_of, uniform)
        if not _tiles(spans, group.master.numel):  # the spares, swapped in whole, must all be written
            return
        ranges = [(start, end, optimizer.adam_args(members, param_group, self.inv_scale()))
                  for start, end, param_group, members in spans]
        chunks = [group.master, *(group.chunks[k] for k in STATES)]
        if not all(_settled(c) for c in chunks):
            return
        spares = self.spares.get(group.index) or self._spares(group)
        if spares is None:
            return
        token = group.grad.read_ahead()
        inputs = [c.host_unfenced for c in chunks]
        grad = group.grad.host_unfenced
        done = self.worker.submit(self._update, token, grad, inputs, spares, ranges, self.keep)
        self.jobs[group.index] = Job(group, ranges, spares, done, self.keep, [(t, t._version) for t in inputs])

    def _allowed(self, group: ChunkGroup) -> bool:
        runtime = self.runtime
        return (runtime.placer.phase is Phase.FOLLOW and not runtime.placer.homed(group.index)
                and runtime.backward_task != -1 and runtime.optimizers == 1 and "master" in group.chunks
                and group.grad.state is ChunkState.HOST)

    def inv_scale(self) -> float:
        """What step() will unscale the gradients by (the factor backward put into them)."""
        scaler = self.runtime.scaler
        return 1.0 / scaler.scale if scaler is not None and self.runtime.grads_scaled else 1.0

    def _spares(self, group: ChunkGroup) -> Spares | None:
        """New spare buffers for `group`, or None where Config.host_memory cannot hold them too."""
        if group.index in self.over_budget:
            return None
        numel, device = group.master.numel, self.runtime.device
        kinds = [torch.float32] * 3 + [group.param.dtype, group.grad.dtype]
        need = sum(numel * dtype.itemsize for dtype in kinds)
        allowed = self.runtime.config.host_memory
        stats = device.host_pool.stats()
        held = stats["host_pinned_bytes"] - stats["host_cached_bytes"] + stats["host_pageable_bytes"]
        if allowed is not None and held + need > int(allowed):
            if not self.over_budget:
                _log.warning("chunkmem: Config.overlap_update: chunk group %d's spare buffers need %d bytes of host "
                             "memory, and with the %d held Config.host_memory=%d cannot hold them: it and any other "
                             "group that does not fit update in step(). Raise host_memory to make them ahead",
                             group.index, need, held, allowed)
            self.over_budget.add(group.index)
            return None
        spares = Spares(*(device.host_alloc(numel, dtype) for dtype in kinds))
        self.spares[group.index] = spares
        return spares

    def _update(self, token: object | None, grad: torch.Tensor, inputs: list[torch.Tensor], spares: Spares,
                ranges: list[Range], keep: bool) -> tuple[float, float]:
        """On the worker: wait for the gradients to land, copy them if `keep`, update into the spares, on half of
        torch's threads while backward runs and all of them once the host waits for the worker (the Note on the
        worker's threads). Returns when it started and ended (time.perf_counter)."""
        start = time.perf_counter()
        device = self.runtime.device.torch_device
        if device.type == "cuda":  # a thread's first CUDA call would otherwise make a context on GPU 0, on every rank
            torch.cuda.set_device(device)
        if token is not None:
            self.runtime.device.wait_landed(token)
        threads = torch.get_num_threads() if self.joined else max(1, torch.get_num_threads() // 2)
        if keep:
            grad = spares.grad.copy_(grad)
        master, exp_avg, exp_avg_sq = inputs
        native.adam_ranges(ranges, master, grad, exp_avg, exp_avg_sq, spares.param,
                    into=(spares.master, spares.exp_avg, spares.exp_avg_sq), threads=threads)
        return start, time.perf_counter()

    def backward_done(self) -> BaseException | None:
        """Backward ended: the host joins the worker and notes each gradient chunk's version (its downloads landed).
        Returns the error of an update that failed (void: step() makes it), for backward to raise once it ended."""
        self.backwards += 1
        self.joined = True
        end = time.perf_counter()
        error = self._join()
        for job in self.jobs.values():
            if job.done.exception() is None:
                job.version = self.runtime.residency.to_host(job.group.grad)._version
                start, done = job.done.result()
                self.busy_s += done - start
                self.hidden_s += max(0.0, min(done, end) - start)
        self.overwritten.clear()
        self.group_of, self.task = None, None
        return error

    def _join(self) -> BaseException | None:
        """Wait for every job, the host learning first that the gradients of one still running landed, as its own reads
        would (in the simulation they may land only then). Those that failed are void (step() makes their updates);
        returns the first one's error."""
        first = None
        for job in self.jobs.values():
            if not job.done.done():
                self.runtime.residency.to_host(job.group.grad)
            error = job.done.exception()
            if error is not None and not job.void:
                job.void = True
                first = first or error
        return first

    def drop(self) -> None:
        """Forget this step's jobs, once they are done (they read chunks the host is about to change): gradients
        cleared (zero_grad) or written by another backward, or the step ended. A job that failed since the last
        backward ended is logged (in a backward that failed, or with none ended since)."""
        error = self._join()
        if error is not None:
            _log.warning("chunkmem: Config.overlap_update: an update made ahead of step() failed: %r", error)
        self.jobs.clear()

    def adopt(self, group: ChunkGroup, ranges: list[Range], grad: torch.Tensor, param_out: torch.Tensor) -> bool:
        """step(): make the update made ahead for `group` its update, if nothing it read changed (True); `ranges` what
        step() would give the kernel, `grad` the gradient chunk's host payload, `param_out` the parameter chunk's,
        about to be written."""
        job = self.jobs.pop(group.index, None)
        if job is None:
            return False
        # Done (not failed) after its backward ended: else made again, as where anything it read changed since: master
        # or states (a loaded checkpoint), what the kernel is given, or the gradients (unless their bytes are the same).
        ended = job.done.exception() is None and job.version >= 0  # waits: done unless its backward failed
        spares = job.spares
        written = ended and grad._version != job.version
        self.written_after = bool(self.written_after) or written
        changed = any(c.host_unfenced is not t or t._version != v
                      for c, (t, v) in zip((group.master, *(group.chunks[k] for k in STATES)), job.inputs))
        if not ended or job.void or changed or job.ranges != ranges or \
                (written and not (job.kept and torch.equal(grad, spares.grad))):
            self.redone += 1
            if written and not job.kept:
                self.unkept += 1
            return False
        spares.master = group.master.swap_host(spares.master)
        spares.exp_avg = group.chunks["exp_avg"].swap_host(spares.exp_avg)
        spares.exp_avg_sq = group.chunks["exp_avg_sq"].swap_host(spares.exp_avg_sq)
        param_out.copy_(spares.param)
        self.adopted += 1
        return True

    def step_done(self) -> None:
        """The step ended: what was not adopted is dropped (the spares stay for the next step)."""
        self.drop()
        self.overwritten.clear()
        self.single, self.backwards, self.task = self.backwards == 1, 0, None
        if self.written_after is not None:  # copies of the gradients are kept next step if they were written
            self.keep, self.written_after = self.written_after, None
        # Updates redone for want of a copy of gradients are no sign that the next step's would be.
        adopted, redone = self.adopted - self.counted[0], (self.redone - self.unkept) - self.counted[1]
        self.counted = (self.adopted, self.redone - self.unkept)
        if self.resting:
            self.resting -= 1
            self.rested += 1
        elif redone and not adopted:  # all it made was redone
            self.resting, self.rest = self.rest, min(2 * self.rest, MAX_REST)
        elif adopted:
            self.rest = 1


def _tiles(spans: list[Span], numel: int) -> bool:
    """Whether `spans` cover a chunk of `numel` elements end to end."""
    return spans[0][0] == 0 and spans[-1][1] == numel and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _settled(chunk: Chunk) -> bool:
    """The host payload is the only copy, with no copy or disk I/O on it and nothing unwritten."""
    return chunk.state is ChunkState.HOST and not chunk.landings and not chunk.io and not chunk.unwritten


class Worker:
    """One daemon thread running jobs in turn. Daemon: a job left waiting for a download that lands only when the
    host learns of it (the simulation's `wait` landing, after a backward that failed) must not hold up the
    interpreter's exit. The thread ends when its Worker is collected."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        weakref.finalize(self, self.jobs.put, None)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self.thread is None:
            self.thread = threading.Thread(target=_run, args=(self.jobs,), name="chunkmem-ahead", daemon=True)
            self.thread.start()
        done: Future = Future()
        self.jobs.put((done, fn, args))
        return done


def _run(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        done, fn, args = job
        try:
            done.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001  the host raises it when it joins
            done.set_exception(error)
        del job, done, fn, args  # the job's buffers go before the next job comes
