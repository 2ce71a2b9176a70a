"""`chunkmem env`: what a bug report or a plan needs to know about this machine."""

from __future__ import annotations

import argparse
import json
import sys

from chunkmem.commands import json_output

HELP = "versions, devices, host RAM, locked-memory limit and a pinned-copy bandwidth probe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.add_argument("--probe-mib", type=int, default=256, help="size of the bandwidth probe copy (default: 256)")


def run(args: argparse.Namespace) -> int:
    from chunkmem.trace.environment import describe

    if args.probe_mib <= 0:
        print(f"chunkmem env: --probe-mib {args.probe_mib}: expected a positive number of MiB", file=sys.stderr)
        return 2
    with json_output(args.json) as stdout:
        info = describe(args.probe_mib)
    if args.json:
        print(json.dumps(info, indent=1), file=stdout)
        return 0
    for key, value in info.items():
        print(f"{key:22} {value}")
    return 0
