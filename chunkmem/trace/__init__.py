"""Memory tracing, reports and the planner (issue 5).

`chunkmem.trace(...)` records what a run holds on device and host, moment by moment
(chunkmem/trace/recorder.py); `chunkmem report` renders a trace directory
(chunkmem/trace/report_*.py); `chunkmem plan` estimates whether a model fits before running it
(chunkmem/trace/planner.py). The trace format is chunkmem/trace/schema.py.
"""

from chunkmem.trace.api import Session, annotate, trace
from chunkmem.trace.recorder import Recorder, Retention
from chunkmem.trace.schema import SCHEMA, TraceError, read_trace

__all__ = ["SCHEMA", "Recorder", "Retention", "Session", "TraceError", "annotate", "read_trace", "trace"]
