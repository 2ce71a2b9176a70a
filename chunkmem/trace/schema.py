"""The trace format on disk: file names, record types, the schema version, and reading it back.

A trace directory holds, per rank, one JSONL file of records and one static chunk-layout file, and
one metadata file for the run. JSONL because a run that dies still leaves every line written
before it; one file per rank so that ranks never share a file handle. Readers check the schema
version before anything else, so an old report never misreads a newer trace.

Record types (the "type" field of each JSONL line):
  header  first line: schema, rank, source ("chunks" | "observer"), level, retention policy
  moment  step, i, t, name, stage, where, warmup, device {...}, host {...} (bytes; absent = 0), and
          disk {...} (model data only on disk, by kind) when a disk tier holds any
  move    step, i (the moment it follows), t, chunk, kind, src, dst, bytes, seconds, reason
  marker  step, i (the moment it follows; -1: before the step's first), t, name, phase ("point" |
          "begin" | "end") — from chunkmem.annotate
  step    step, t, moments, kept, peaks and bytes moved (h2d, d2h, disk_read, disk_write; disk_peak:
          most model data only on disk) — one per step, never dropped
  gap     first, last: steady-state steps whose moments and moves were dropped by the policy
  footer  last line of a trace closed cleanly
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SCHEMA = "chunkmem.trace/1"
META_FILE = "meta.json"
PLAN_FILE = "plan.json"  # written by `chunkmem plan --json` into a trace dir: the report compares

# Model data, in the order charts stack them (the chunk families of chunkmem.chunks.store).
MODEL_KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq", "momentum_buffer", "optim_other")
# Per side, besides model data: see docs/glossary.md for what each means and how it is read.
DEVICE_FIELDS = MODEL_KINDS + ("nonmodel", "allocated", "reserved", "peak_allocated")
HOST_FIELDS = MODEL_KINDS + ("nonmodel", "rss", "pinned_chunkmem", "pinned_torch")


def trace_file(rank: int) -> str:
    return f"trace.rank{rank}.jsonl"


def layout_file(rank: int) -> str:
    return f"layout.rank{rank}.json"


class TraceError(ValueError):
    """A trace directory or file that cannot be read; the message says which and what to do."""


@dataclasses.dataclass
class RankTrace:
    """Everything one rank recorded, parsed."""

    rank: int
    header: dict[str, Any]
    moments: list[dict[str, Any]]
    moves: list[dict[str, Any]]
    markers: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    gaps: list[dict[str, Any]]
    layout: dict[str, Any]
    complete: bool  # a footer was written


@dataclasses.dataclass
class Trace:
    directory: Path
    meta: dict[str, Any]
    ranks: list[RankTrace]
    plan: dict[str, Any] | None


def read_trace(directory: str | Path) -> Trace:
    """Parse a trace directory written by chunkmem.trace; TraceError on anything unreadable."""
    directory = Path(directory)
    if not directory.is_dir():
        what = f"a file, not a trace directory (the directory that holds it is {directory.parent})" \
            if directory.is_file() else "no such trace directory"
        raise TraceError(f"{directory}: {what}; record one with `chunkmem trace -- python script.py` or "
                         f"`with chunkmem.trace(dir, model=model):`")
    files = sorted(directory.glob("trace.rank*.jsonl"), key=lambda p: int(p.stem.split("rank")[1]))
    if not files:
        raise TraceError(f"{directory}: holds no trace.rank*.jsonl file: is this a chunkmem trace directory?")
    meta = _read_json(directory / META_FILE) if (directory / META_FILE).exists() else {}
    plan = _read_json(directory / PLAN_FILE) if (directory / PLAN_FILE).exists() else None
    return Trace(directory, meta, [_read_rank(path) for path in files], plan)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TraceError(f"{path}: not readable JSON ({error}); re-record the trace") from error


def _read_rank(path: Path) -> RankTrace:
    by_type: dict[str, list[dict[str, Any]]] = {k: [] for k in ("header", "moment", "move", "marker", "step",
                                                                  "gap", "footer")}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                # A process killed mid-write leaves a partial last line: keep what came before it.
                break
            by_type.setdefault(record.get("type", "?"), []).append(record)
    if not by_type["header"]:
        raise TraceError(f"{path}: no header line; the file is not a chunkmem trace (or is empty)")
    header = by_type["header"][0]
    if header.get("schema") != SCHEMA:
        raise TraceError(f"{path}: schema {header.get('schema')!r}, this chunkmem reads {SCHEMA!r}: "
                         f"render it with the chunkmem version that recorded it")
    rank = int(header["rank"])
    layout_path = path.parent / layout_file(rank)
    layout = _read_json(layout_path) if layout_path.exists() else {"chunks": []}
    return RankTrace(rank, header, by_type["moment"], by_type["move"], by_type["marker"], by_type["step"],
                     by_type["gap"], layout, bool(by_type["footer"]))


def total(side: dict[str, int], kinds: tuple[str, ...] = MODEL_KINDS) -> int:
    """Sum of the given categories of one side of a moment (absent ones are 0)."""
    return sum(side.get(k, 0) for k in kinds)
