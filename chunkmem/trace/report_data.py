"""A parsed trace turned into what every report format draws: series, lanes, moves, summaries.

The HTML page, the PNG, the CSV and the Perfetto trace all read this one structure, so they cannot
disagree. Moments are numbered 0..n-1 in the order kept (x axis); a dropped stretch of steps shows
as a gap between two kept steps.
"""

from __future__ import annotations

from typing import Any

from chunkmem.trace.schema import DEVICE_FIELDS, HOST_FIELDS, MODEL_KINDS, RankTrace, Trace, total

STACKED = MODEL_KINDS + ("nonmodel",)  # what the stacked charts show; the rest are lines or columns


def rank_view(rank: RankTrace) -> dict[str, Any]:
    moments = rank.moments
    series = {side: {k: [m[side].get(k, 0) for m in moments] for k in fields}
              for side, fields in (("device", DEVICE_FIELDS), ("host", HOST_FIELDS))}
    order = {(m["step"], m["i"]): x for x, m in enumerate(moments)}
    return {
        "rank": rank.rank,
        "source": rank.header.get("source"),
        "device": rank.header.get("device"),
        "simulated": rank.header.get("simulated"),
        "device_limit": rank.layout.get("device_limit_bytes"),  # the budget (chunk runtime only)
        "moments": [{"step": m["step"], "i": m["i"], "t": m["t"], "name": m["name"], "stage": m["stage"],
                     "where": m["where"], "warmup": m["warmup"]} for m in moments],
        "series": series,
        "lanes": lanes(rank),
        "moves": [dict(m, x=_x_of(order, m)) for m in rank.moves],
        "markers": [dict(m, x=_x_of(order, m)) for m in rank.markers],
        "spans": marker_spans([dict(m, x=_x_of(order, m)) for m in rank.markers]),
        "steps": rank.steps,
        "gaps": rank.gaps,
        "phases": phase_summary(rank),
        "complete": rank.complete,
    }


def _x_of(order: dict[tuple[int, int], int], record: dict[str, Any]) -> int:
    return order.get((record["step"], max(record["i"], 0)), -1)  # i = -1: before the step's first moment


def marker_spans(markers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Annotations as [x0, x1] ranges: a `with annotate(...)` block from its begin to its end (the
    moments between are the block's), a point as x0 == x1. Unfinished or unplaced ones are left out."""
    out, open_ = [], {}
    for marker in markers:
        if marker["phase"] == "begin":
            open_[marker["name"]] = marker
        elif marker["phase"] == "end" and marker["name"] in open_:
            begin = open_.pop(marker["name"])
            out.append({"name": marker["name"], "x0": begin["x"], "x1": marker["x"]})
        elif marker["phase"] == "point":
            out.append({"name": marker["name"], "x0": marker["x"], "x1": marker["x"]})
    return [s for s in out if s["x0"] >= 0 and s["x1"] >= 0]


def lanes(rank: RankTrace) -> list[dict[str, Any]]:
    """Per chunk, the [first, last] moment ranges it was resident on the device."""
    names = [c["name"] for c in rank.layout.get("chunks", [])]
    spans: dict[str, list[list[int]]] = {name: [] for name in names}
    resident: set[str] = set()
    for x, moment in enumerate(rank.moments):
        if "resident" in moment:  # written when it changes, and at the first moment of every step
            resident = set(moment["resident"])
        for name in resident:
            runs = spans.setdefault(name, [])
            if runs and runs[-1][1] == x - 1:
                runs[-1][1] = x
            else:
                runs.append([x, x])
    known = {c["name"]: c for c in rank.layout.get("chunks", [])}
    return [{"chunk": name, "kind": known.get(name, {}).get("kind"), "bytes": known.get(name, {}).get("bytes", 0),
             "spans": runs} for name, runs in spans.items()]


def phase_summary(rank: RankTrace) -> dict[str, dict[str, float]]:
    """Warm-up steps against steady-state steps: mean peaks, bytes moved and step time."""
    out = {}
    for label, chosen in (("warm-up", [s for s in rank.steps if s["warmup"]]),
                          ("steady", [s for s in rank.steps if not s["warmup"]])):
        if not chosen:
            continue
        count = len(chosen)
        out[label] = {"steps": count,
                      "device_peak": max(s["device_peak"] for s in chosen),
                      "h2d_per_step": sum(s["h2d_bytes"] for s in chosen) / count,
                      "d2h_per_step": sum(s["d2h_bytes"] for s in chosen) / count,
                      # The disk tier (absent in traces from before it): read and written per step, and held.
                      "disk_read_per_step": sum(s.get("disk_read_bytes", 0) for s in chosen) / count,
                      "disk_write_per_step": sum(s.get("disk_write_bytes", 0) for s in chosen) / count,
                      "disk_peak": max(s.get("disk_peak", 0) for s in chosen),
                      "seconds_per_step": sum(s["t_end"] - s["t_start"] for s in chosen) / count}
    return out


def predicted_vs_actual(trace: Trace) -> list[dict[str, Any]]:
    """Rows comparing a plan (plan.json in the trace directory) with what rank 0 recorded.

    The planner's "all chunks resident" figure is the device peak only when everything fits; when
    chunks move the runtime fills the budget instead, so the predicted peak is the smaller of the two.
    """
    if trace.plan is None or not trace.ranks or not trace.ranks[0].moments:
        return []
    rank, plan = trace.ranks[0], trace.plan
    moments = rank.moments
    budget = plan.get("request", {}).get("device_memory")
    resident = plan.get("device_all_resident")
    rows = [("model data (host)", plan.get("model_data_bytes"), max(total(m["host"]) for m in moments)),
            ("activations (device, peak)", plan.get("activation_bytes"),
             max(m["device"].get("nonmodel", 0) for m in moments)),
            ("device total (peak)", min(resident, budget) if resident and budget else resident,
             max(m["device"].get("allocated", 0) for m in moments)),
            ("device budget", budget, rank.layout.get("device_limit_bytes"))]
    return [{"what": what, "predicted": predicted, "actual": actual, "difference": _difference(predicted, actual)}
            for what, predicted, actual in rows]


def _difference(predicted: int | None, actual: int | None) -> str:
    if not predicted or actual is None:
        return ""
    return f"{actual / predicted - 1:+.1%}"


def build(trace: Trace) -> dict[str, Any]:
    return {"meta": trace.meta, "ranks": [rank_view(r) for r in trace.ranks], "stacked": list(STACKED),
            "plan": trace.plan, "compare": predicted_vs_actual(trace)}
