"""The recorder: an observer of one runtime (or plain model) that writes one rank's trace file.

[Note: bounded size]
A long run must not fill the disk, and the interesting steps are the first ones (warm-up: the
runtime records, places conservatively, optimizer states appear) and the latest ones (the steady
state the user lives with). So: the first `keep_warmup` steps, and any later step the runtime
flags as warm-up (a re-warm) while fewer than `keep_warmup` have been kept, are written as soon as
they end; the rest go to a ring of the last `keep_last` steps, written when the trace closes. A
step pushed out of the ring leaves a count in one `gap` record. Every step, kept or not, leaves
a one-line `step` summary (peaks, bytes moved), so the whole run's shape survives. A step with
more than `max_records` records (a very long step) keeps its first ones and counts the rest.

[Note: levels]
"counters" (default) reads what is known without waiting for the device: the runtime's books,
the allocator's current counters, RSS. "exact" also synchronises the device at every moment and
reads (then resets) the allocator's peak since the previous moment, so short spikes between
moments show; it slows training and is meant for a few steps.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import IO, Any

import torch

from chunkmem.chunks.observe import Moment, Move
from chunkmem.trace.schema import SCHEMA, layout_file, total, trace_file
from chunkmem.trace.sources import Source, host_readings, kinds_of

log = logging.getLogger("chunkmem")

LEVELS = ("counters", "exact")
# A move's (src, dst) -> the step summary's counter ("<direction>_bytes"); the disk tier's are the last two.
DIRECTIONS = {("host", "device"): "h2d", ("device", "host"): "d2h", ("disk", "host"): "disk_read",
              ("host", "disk"): "disk_write"}


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which steps keep their moments and moves (see the Note on bounded size)."""

    keep_warmup: int = 3
    keep_last: int = 20
    max_records: int = 200_000

    def __post_init__(self) -> None:
        for name in ("keep_warmup", "keep_last", "max_records"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"trace retention {name}={value!r}: expected a non-negative int of steps")


@dataclasses.dataclass
class _Step:
    step: int
    start: float
    lines: list[str] = dataclasses.field(default_factory=list)
    moments: int = 0
    trailing: int = 0  # markers at the end of `lines`, after the step's last moment or move
    dropped: int = 0
    warmup: bool = False
    device_peak: int = 0
    host_rss_peak: int = 0
    disk_peak: int = 0  # most model data only on disk (the disk tier, chunks/hostcache.py)
    moved: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(DIRECTIONS.values(), 0))


class Recorder:
    """Observer (chunkmem.chunks.observe.Observer) that turns moments and moves into trace records."""

    def __init__(self, directory: Path, rank: int, source: Source, level: str = "counters",
                 retention: Retention = Retention()) -> None:
        if level not in LEVELS:
            raise ValueError(f"trace level {level!r}: expected one of {LEVELS}")
        self.directory, self.rank, self.source, self.level, self.retention = directory, rank, source, level, retention
        self.simulated = source.torch_device.type != "cuda"
        self.t0 = time.perf_counter()
        self.current = _Step(0, 0.0)
        self.index = 0
        self.warm_kept = 0
        self.tail: collections.deque[_Step] = collections.deque()
        self.gap: list[int] = []  # [first, last, count] of dropped steps
        self.last_resident: list[str] | None = None
        self.closed = False
        self._last_point: str | None = None
        directory.mkdir(parents=True, exist_ok=True)
        (directory / layout_file(rank)).write_text(json.dumps(source.layout()))
        self.file: IO[str] = (directory / trace_file(rank)).open("w")
        self._write({"type": "header", "schema": SCHEMA, "rank": rank, "source": source.kind, "level": level,
                     "device": str(source.torch_device), "simulated": self.simulated,
                     "retention": dataclasses.asdict(retention), "unix_time": time.time()})
        self.file.flush()

    # -- observer interface ------------------------------------------------------------------
    def moment(self, moment: Moment) -> None:
        if moment.step != self.current.step:
            self._end_step(moment.step)
        self.index = moment.index
        record = {"type": "moment", "step": moment.step, "i": moment.index, "t": self._now(), "name": moment.name,
                  "stage": moment.stage, "where": moment.where, "warmup": moment.warmup, **self.read()}
        step = self.current
        step.moments += 1
        step.warmup |= moment.warmup
        step.device_peak = max(step.device_peak, record["device"].get("allocated", 0))
        step.host_rss_peak = max(step.host_rss_peak, record["host"].get("rss", 0))
        step.disk_peak = max(step.disk_peak, total(record.get("disk", {})))
        self._add(record)

    def moved(self, move: Move) -> None:
        self.current.moved[DIRECTIONS.get((move.src, move.dst), "d2h")] += move.nbytes
        self._add({"type": "move", "step": self.current.step, "i": self.index, "t": self._now(), "chunk": move.chunk,
                   "kind": move.kind, "src": move.src, "dst": move.dst, "bytes": move.nbytes,
                   "seconds": round(move.seconds, 9), "reason": move.reason})

    def marker(self, name: str, phase: str) -> None:
        lines = self.current.lines
        if phase == "begin" and lines and lines[-1] == self._last_point:
            lines.pop()  # `with annotate(name):` first made a point marker: the span replaces it
            self.current.trailing -= 1
        self._add({"type": "marker", "step": self.current.step, "i": self.index, "t": self._now(), "name": name,
                   "phase": phase})
        self._last_point = self.current.lines[-1] if phase == "point" and self.current.lines else None

    # -- readings ----------------------------------------------------------------------------
    def read(self) -> dict[str, Any]:
        """Device and host figures now; zero categories are left out to keep lines short."""
        sides = kinds_of(self.source.model_bytes())
        device, host = dict(sides["device"]), dict(sides["host"])
        device_model, host_model = total(device), total(host)
        device["nonmodel"] = self.source.nonmodel_device()
        if self.simulated:
            # No allocator to ask: the simulated device holds exactly its chunks and saved activations.
            device["allocated"] = device["reserved"] = device_model + device["nonmodel"]
        else:
            device["allocated"] = torch.cuda.memory_allocated(self.source.torch_device)
            device["reserved"] = torch.cuda.memory_reserved(self.source.torch_device)
            if self.level == "exact":
                torch.cuda.synchronize(self.source.torch_device)
                device["peak_allocated"] = torch.cuda.max_memory_allocated(self.source.torch_device)
                torch.cuda.reset_peak_memory_stats(self.source.torch_device)
        pinned = self.source.pinned_bytes()  # chunkmem's pool (in the simulation, its twin's count)
        if pinned is not None:
            host["pinned_chunkmem"] = pinned
        host.update(host_readings(self.source.torch_device))
        # What the process holds beyond host model data (and, in the simulation, the "device").
        simulated_device = device["allocated"] if self.simulated else 0
        host["nonmodel"] = max(0, host["rss"] - host_model - simulated_device)
        record: dict[str, Any] = {"device": {k: v for k, v in device.items() if v},
                                  "host": {k: v for k, v in host.items() if v}}
        if any(sides.get("disk", {}).values()):
            record["disk"] = {k: v for k, v in sides["disk"].items() if v}
        resident = self.source.resident()
        if resident is not None and resident != self.last_resident:
            record["resident"] = resident  # only when it changed: readers carry it forward
            self.last_resident = resident
        return record

    # -- steps and retention -----------------------------------------------------------------
    def _add(self, record: dict[str, Any]) -> None:
        step = self.current
        if len(step.lines) >= self.retention.max_records:
            step.dropped += 1
            return
        step.lines.append(json.dumps(record, separators=(",", ":")))
        step.trailing = step.trailing + 1 if record["type"] == "marker" else 0

    def _end_step(self, next_step: int, carry: bool = True) -> None:
        step = self.current
        # Markers after a step's last moment come between steps (an evaluation after the optimizer
        # step): they belong to the next step, before its first moment (i = -1), so that they are
        # kept or dropped with the moments they annotate.
        carried = step.lines[len(step.lines) - step.trailing:] if carry and step.trailing else []
        del step.lines[len(step.lines) - len(carried):]
        if step.lines or step.moments:
            self._write({"type": "step", "step": step.step, "t_start": step.start, "t_end": self._now(),
                         "moments": step.moments, "warmup": step.warmup, "records_dropped": step.dropped,
                         "device_peak": step.device_peak, "host_rss_peak": step.host_rss_peak,
                         **{f"{direction}_bytes": n for direction, n in step.moved.items()},
                         "disk_peak": step.disk_peak})
            self._retain(step)
        self.current = _Step(next_step, self._now())
        self.last_resident = None  # each kept step starts with its full resident set
        for line in carried:
            self._add(dict(json.loads(line), step=next_step, i=-1))

    def _retain(self, step: _Step) -> None:
        if self.warm_kept < self.retention.keep_warmup and (step.warmup or step.step < self.retention.keep_warmup):
            self.warm_kept += 1
            self._write_lines(step.lines)
            return
        self.tail.append(step)
        while len(self.tail) > self.retention.keep_last:
            dropped = self.tail.popleft()
            self.gap = [self.gap[0] if self.gap else dropped.step, dropped.step, (self.gap[2] if self.gap else 0) + 1]

    def close(self) -> None:
        """Write the kept tail and the footer; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._end_step(self.current.step + 1, carry=False)
        if self.gap:
            self._write({"type": "gap", "first": self.gap[0], "last": self.gap[1], "steps": self.gap[2]})
        for step in self.tail:
            self._write_lines(step.lines)
        self._write({"type": "footer", "unix_time": time.time()})
        self.file.close()
        log.info("chunkmem trace: rank %d written to %s", self.rank, self.directory)

    # -- output ------------------------------------------------------------------------------
    def _now(self) -> float:
        return round(time.perf_counter() - self.t0, 6)

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def _write_lines(self, lines: list[str]) -> None:
        self.file.write("".join(line + "\n" for line in lines))
        self.file.flush()
