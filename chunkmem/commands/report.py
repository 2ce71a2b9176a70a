"""`chunkmem report DIR`: render a trace directory as HTML, PNG, CSV and a Perfetto trace."""

from __future__ import annotations

import argparse
import sys

HELP = "render a trace directory: self-contained HTML, PNG, CSV and a Chrome/Perfetto trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="trace directory written by `chunkmem trace` or chunkmem.trace()")
    parser.add_argument("--output", help="where to write the report (default: the trace directory)")


def run(args: argparse.Namespace) -> int:
    from chunkmem.trace.report import write_report
    from chunkmem.trace.schema import TraceError

    try:
        written = write_report(args.directory, args.output)
    except TraceError as error:
        print(f"chunkmem report: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # --output a file, or somewhere it cannot write (or a trace it cannot read)
        print(f"chunkmem report: {error}: pass a trace folder it can read, and an --output folder it can write",
              file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
