"""Subcommands of the `chunkmem` command (see chunkmem/cli.py)."""
