"""`chunkmem selftest`: chunkmem's CUDA path checked on this machine's GPU in a few minutes (chunkmem/selftest.py).

Prints a table and writes JSON (--json). Without a GPU the GPU checks are listed as skipped and the
simulation's check still runs; `--require-gpu` makes that a failure (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HELP = "check the CUDA path on this GPU: copy bandwidth, the CUDA sanitizer, CUDA vs simulation, memory budget, NCCL"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (names as in the table)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 when the GPU checks cannot run")


def run(args: argparse.Namespace) -> int:
    from chunkmem import selftest

    unknown = sorted(set(args.only or ()) - {name for name, _, _ in selftest.CHECKS})
    if unknown:
        names = ", ".join(repr(name) for name, _, _ in selftest.CHECKS)
        print(f"chunkmem selftest: --only {' '.join(unknown)}: no such check; the checks are {names}", file=sys.stderr)
        return 2
    where = Path(args.json or ".").parent
    if args.json and not (where.is_dir() and os.access(where, os.W_OK) and not Path(args.json).is_dir()):
        print(f"chunkmem selftest: --json {args.json}: expected a file path in an existing folder (the report is "
              "written there as each check ends)", file=sys.stderr)
        return 2
    command = ["chunkmem", "selftest", *(["--only", *args.only] if args.only else []),
               *(["--json", args.json] if args.json else []), *(["--require-gpu"] if args.require_gpu else [])]
    report: dict[str, Any] = {"machine": selftest.describe_machine(), "commit": _commit(), "command": " ".join(command),
                              "checks": []}
    rows = []
    _write(args.json, report)  # at once, and after every check: a run cut short keeps the checks it finished
    print(f"{'check':30} {'result':8} detail")
    for row in selftest.run_checks(args.only):
        rows.append(row)
        print(f"{row.check:30} {row.status:8} {row.detail}", flush=True)
        report["checks"] = [dataclasses.asdict(r) for r in rows]
        _write(args.json, report)
    if args.json:
        print(f"report written to {args.json}")
    failed = [r.check for r in rows if r.status == "fail"]
    skipped_gpu = [r.check for r in rows if r.detail == selftest.NEEDS_GPU]
    if skipped_gpu:
        print(f"no CUDA GPU here: {len(skipped_gpu)} checks need one ({', '.join(skipped_gpu)})")
    return 1 if failed or (args.require_gpu and skipped_gpu) else 0


def _write(path: str | None, report: dict[str, Any]) -> None:
    """The report at `path` (if given), whole or not at all: a time limit may end the run mid-write."""
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except OSError:
        return None
    return done.stdout.strip() or None
