"""The report's machine-readable files: CSV of every kept moment, a Chrome/Perfetto trace, the PNG.

Perfetto (ui.perfetto.dev, chrome://tracing) shows each rank as a process: memory categories as
counter tracks, module forwards as nested slices, chunk copies as slices on a "copies" thread
(their measured duration), and annotations as instant events. The PNG needs matplotlib (the
optional `plot` extra); without it the PNG is skipped with a message, the rest is written.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from chunkmem.trace.schema import DEVICE_FIELDS, HOST_FIELDS

log = logging.getLogger("chunkmem")
_COLUMNS = ["rank", "step", "i", "t", "name", "stage", "where", "warmup"]


def write_csv(data: dict[str, Any], path: Path) -> None:
    header = _COLUMNS + [f"device_{k}" for k in DEVICE_FIELDS] + [f"host_{k}" for k in HOST_FIELDS]
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(header)
        for rank in data["ranks"]:
            for x, m in enumerate(rank["moments"]):
                row = [rank["rank"], m["step"], m["i"], m["t"], m["name"], m["stage"], m["where"], int(m["warmup"])]
                row += [rank["series"]["device"][k][x] for k in DEVICE_FIELDS]
                row += [rank["series"]["host"][k][x] for k in HOST_FIELDS]
                writer.writerow(row)


def perfetto_events(data: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for rank in data["ranks"]:
        pid = rank["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "copies"}})
        for x, m in enumerate(rank["moments"]):
            us = m["t"] * 1e6
            for side in ("device", "host"):
                values = {k: v[x] for k, v in rank["series"][side].items() if k in data["stacked"]}
                events.append({"ph": "C", "name": f"{side} memory", "pid": pid, "ts": us, "args": values})
            if m["name"] in ("pre_forward", "post_forward"):
                events.append({"ph": "B" if m["name"] == "pre_forward" else "E", "name": m["where"], "pid": pid,
                               "tid": 0, "ts": us, "cat": "forward"})
            elif m["name"] in ("backward", "grad", "pre_optimizer"):
                events.append({"ph": "i", "s": "t", "name": f"{m['name']} {m['where']}", "pid": pid, "tid": 0,
                               "ts": us, "cat": m["stage"]})
        for move in rank["moves"]:
            events.append({"ph": "X", "name": f"{move['reason']} {move['chunk']}", "pid": pid, "tid": 1,
                           "ts": move["t"] * 1e6 - move["seconds"] * 1e6, "dur": move["seconds"] * 1e6,
                           "cat": move["reason"], "args": {"bytes": move["bytes"], "from": move["src"],
                                                           "to": move["dst"]}})
        for marker in rank["markers"]:
            phase = {"point": "i", "begin": "B", "end": "E"}[marker["phase"]]
            event = {"ph": phase, "name": marker["name"], "pid": pid, "tid": 2, "ts": marker["t"] * 1e6,
                     "cat": "annotation"}
            if phase == "i":
                event["s"] = "p"
            events.append(event)
    return events


def write_perfetto(data: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps({"traceEvents": perfetto_events(data), "displayTimeUnit": "ms"}))


def write_png(data: dict[str, Any], path: Path) -> bool:
    """The main chart (rank 0): stacked memory by category, device and host side by side; none for a trace that kept
    no moment (`chunkmem trace --keep-last 0 --keep-warmup 0`)."""
    if not data["ranks"] or not data["ranks"][0]["moments"]:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG (pip install 'chunkmem[plot]'); HTML, CSV and "
                    "Perfetto files are written")
        return False
    rank = data["ranks"][0]
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharex=True)
    for axis, side in zip(axes, ("device", "host")):
        keys = [k for k in data["stacked"] if any(rank["series"][side][k])]
        x = range(len(rank["moments"]))
        axis.stackplot(x, *[[v / 2**20 for v in rank["series"][side][k]] for k in keys], labels=keys,
                       colors=[COLORS.get(k, "#999") for k in keys], linewidth=0)
        if side == "host" and any(rank["series"]["host"]["rss"]):
            axis.plot(x, [v / 2**20 for v in rank["series"]["host"]["rss"]], color="#222", lw=1, label="process RSS")
        starts = _step_starts(rank)
        for start in starts:
            axis.axvline(start, color="#bbb", lw=0.5)
        axis.set_xticks(starts, [f"s{rank['moments'][x]['step']}" for x in starts])
        if side == "device" and rank.get("device_limit"):
            axis.axhline(rank["device_limit"] / 2**20, color="#000", lw=1, ls="--", label="device budget")
        _annotations(axis, rank.get("spans", []), len(rank["moments"]))
        axis.set_title(f"{side} memory, rank {rank['rank']} ({rank['device']})")
        axis.set_xlabel("moments of the kept steps (grey lines: step starts; shaded: annotations)")
        axis.set_ylabel("MiB")
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, ncol=5, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _annotations(axis: Any, spans: list[dict[str, Any]], moments: int) -> None:
    for j, span in enumerate(spans):
        axis.axvspan(span["x0"], max(span["x1"], span["x0"] + 0.5), color="#000", alpha=0.06, lw=0)
        right = span["x0"] > 0.85 * moments  # near the right edge: the label goes to the left of its span
        axis.annotate(span["name"], (span["x0"], 1), xycoords=("data", "axes fraction"),
                      xytext=(-2 if right else 2, -10 - 9 * (j % 3)), textcoords="offset points", fontsize=7,
                      ha="right" if right else "left")


def _step_starts(rank: dict[str, Any]) -> list[int]:
    starts, previous = [], None
    for x, m in enumerate(rank["moments"]):
        if m["step"] != previous:
            starts.append(x)
            previous = m["step"]
    return starts


# One palette for every format (the HTML reads it too).
COLORS = {"param": "#4c78a8", "grad": "#f58518", "master": "#54a24b", "exp_avg": "#b279a2",
          "exp_avg_sq": "#9d755d", "momentum_buffer": "#bab0ac", "optim_other": "#d4a6c8",
          "nonmodel": "#e45756"}
