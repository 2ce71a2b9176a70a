"""Subcommands of the `chunkmem` command (see chunkmem/cli.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def json_output(enabled: bool) -> Iterator[TextIO]:
    """Where a command prints its result. With JSON, stdout holds the JSON alone: what else is printed
    meanwhile (libraries logging as they import, as DeepSpeed does when transformers imports it) goes to
    stderr."""
    stdout = sys.stdout
    if not enabled:
        yield stdout
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield stdout
