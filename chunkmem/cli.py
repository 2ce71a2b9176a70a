"""The `chunkmem` command: one subcommand per module in chunkmem/commands/.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. Nothing heavy is
imported before a command runs (the package itself loads torch only when a name of it is used), so `--help`,
`--version` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from chunkmem.version import __version__

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


class _Defaults(argparse.HelpFormatter):
    """Help that gives each option's default, where its own text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkmem", description="Train models larger than the GPU's memory.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log chunkmem's decisions")
    parser.add_argument("--version", action="version", version=f"chunkmem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _available().items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP,
                                            formatter_class=_Defaults))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return _available()[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
