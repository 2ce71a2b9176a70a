"""`chunkmem trace -- python script.py ...`: record a memory trace of a script with no code change.

The command runs as a child process with CHUNKMEM_TRACE set and chunkmem's start-up hook first on
PYTHONPATH (see chunkmem/trace/autoattach.py); the child's exit status is this command's (128 + N
when a signal N ended it, as a shell reports it).

A trace directory holds one run. The files of an earlier trace in it (plan.json and the report's
outputs included: they describe that run) are removed before the command starts, and said so, so
that neither the report nor the message can mix two runs; a directory holding other files is
refused rather than cleared.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

# What a trace directory holds: the recorder's files, plan.json, and `chunkmem report`'s outputs.
TRACE_FILES = re.compile(r"trace\.rank\d+\.jsonl|layout\.rank\d+\.json|meta\.json|plan\.json|report\.html|"
                         r"moments\.csv|perfetto\.json|memory\.png")

HELP = "record a memory trace of a python or torchrun command: chunkmem trace -- python train.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="chunkmem-trace", help="trace directory")
    parser.add_argument("--level", default="counters", choices=["counters", "exact"],
                        help="counters: cheap (default); exact: synchronise at every moment to read peaks")
    parser.add_argument("--keep-last", type=int, default=20, help="steady-state steps kept in full (default: 20)")
    parser.add_argument("--keep-warmup", type=int, default=3, help="first steps kept in full (default: 3)")
    parser.add_argument("--report", action="store_true", help="render the report when the command ends")
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="-- followed by the command to trace")


def child_environment(args: argparse.Namespace) -> dict[str, str]:
    boot = Path(__file__).resolve().parent.parent / "trace" / "boot"
    root = str(Path(__file__).resolve().parent.parent.parent)  # so the child imports this chunkmem
    env = dict(os.environ, CHUNKMEM_TRACE=str(Path(args.output).resolve()), CHUNKMEM_TRACE_LEVEL=args.level,
               CHUNKMEM_TRACE_KEEP_LAST=str(args.keep_last), CHUNKMEM_TRACE_KEEP_WARMUP=str(args.keep_warmup))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot), root, os.environ.get("PYTHONPATH", "")) if p)
    return env


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        print("chunkmem trace: no command given; usage: chunkmem trace [--output DIR] -- python script.py ARGS "
              "(or torchrun ... script.py)", file=sys.stderr)
        return 2
    for name in ("keep_last", "keep_warmup"):
        if getattr(args, name) < 0:
            print(f"chunkmem trace: --{name.replace('_', '-')} {getattr(args, name)}: expected 0 or more steps",
                  file=sys.stderr)
            return 2
    output = Path(args.output)
    problem = clear_earlier_trace(output)
    if problem is not None:
        print(f"chunkmem trace: {problem}", file=sys.stderr)
        return 2
    try:
        status = subprocess.call(command, env=child_environment(args))
    except FileNotFoundError:
        print(f"chunkmem trace: command {command[0]!r} not found; pass a program on PATH, e.g. -- python script.py",
              file=sys.stderr)
        return 127
    status = 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell says
    written = sorted(p.name for p in output.glob("*") if TRACE_FILES.fullmatch(p.name))
    if not any(name.startswith("trace.rank") for name in written):
        print(f"chunkmem trace: the command ran (exit status {status}) but recorded nothing: it never ran a "
              f"model forward with gradients, or was not Python", file=sys.stderr)
        return status or 1
    if status != 0:
        print(f"chunkmem trace: the command failed (exit status {status}); what it ran before that is in "
              f"{output}: {', '.join(written)}", file=sys.stderr)
    else:
        print(f"chunkmem trace: wrote {', '.join(written)} to {output}; render it with `chunkmem report {output}`")
    if args.report:
        from chunkmem.trace.report import write_report

        for path in write_report(args.output):
            print(path)
    return status


def clear_earlier_trace(output: Path) -> str | None:
    """Remove an earlier trace's files from `output` (made if new); returns why it cannot be used, or None: the traced
    command's prepare would fail to write it, and this would report a trace of nothing."""
    if not output.exists():
        try:
            output.mkdir(parents=True)
        except OSError as error:
            return f"--output {output}: cannot make that directory ({error.strerror}); pass one you can write"
        return None
    if not output.is_dir():
        return f"--output {output} is a file; pass a directory for the trace"
    if not os.access(output, os.W_OK | os.X_OK):
        return f"--output {output}: cannot write there; pass a directory you can write"
    entries = list(output.iterdir())
    foreign = sorted(p.name for p in entries if not TRACE_FILES.fullmatch(p.name))
    if foreign:
        return (f"--output {output} holds files that are not a trace ({', '.join(foreign[:5])}); pass a new or "
                f"empty directory, so that nothing of yours is overwritten")
    if entries:
        for entry in entries:
            entry.unlink()
        print(f"chunkmem trace: removed an earlier trace from {output} ({', '.join(sorted(p.name for p in entries))})",
              file=sys.stderr)
    return None
