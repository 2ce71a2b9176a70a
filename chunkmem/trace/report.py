"""`chunkmem report DIR`: every output of a trace directory, written next to it (or to --output)."""

from __future__ import annotations

from pathlib import Path

from chunkmem.trace.report_data import build
from chunkmem.trace.report_files import write_csv, write_perfetto, write_png
from chunkmem.trace.report_html import render
from chunkmem.trace.schema import read_trace


def write_report(directory: str | Path, output: str | Path | None = None) -> list[Path]:
    """Render `directory`; returns the files written (report.html, memory.png, moments.csv, perfetto.json)."""
    trace = read_trace(directory)
    out = Path(output) if output is not None else Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    data = build(trace)
    written = [out / "report.html", out / "moments.csv", out / "perfetto.json"]
    written[0].write_text(render(data, f"chunkmem trace {trace.directory.name}"))
    write_csv(data, written[1])
    write_perfetto(data, written[2])
    if write_png(data, out / "memory.png"):
        written.append(out / "memory.png")
    return written
