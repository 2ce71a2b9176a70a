"""The `chunkmem` command: one subcommand per module in chunkmem/commands/.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their command runs, so `chunkmem env` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

COMMANDS = ["finetune", "trace", "report", "plan", "env", "selftest"]


def _available() -> dict[str, ModuleType]:
    found = {}
    for name in COMMANDS:
        try:
            found[name] = importlib.import_module(f"chunkmem.commands.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"chunkmem.commands.{name}":
                raise
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkmem", description="Train models larger than the GPU's memory.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log chunkmem's decisions")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _available().items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return _available()[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
