"""Ctrl-C and SIGTERM during a long run: finish the step, save, and say how to resume.

A run killed between two checkpoints loses the steps since the last one, so the first SIGINT or
SIGTERM only asks the loop to stop: it finishes the step in progress (a checkpoint mid-step would
not be resumable), saves, prints one line and exits with 128 + the signal's number, as a shell
expects of a process ended by that signal. A second signal means "now": it raises
KeyboardInterrupt at once (and what was saved before stays saved; a save cut short leaves only a
`.tmp` folder, removed by the next run).

Handlers are installed only while a `StopOnSignal` block runs, on the main thread (Python delivers
signals there only), and the previous ones are put back when it ends.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    """`with StopOnSignal() as stop:` ... `if stop.signal is not None:` save and leave."""

    def __init__(self, message: str = "stopping after this step to save a checkpoint") -> None:
        self.message = message
        self.signal: int | None = None  # the first signal received
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._restore()

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            self._restore()
            raise KeyboardInterrupt(f"second {signal.Signals(number).name}: aborted")
        self.signal = number
        name = signal.Signals(number).name
        # os.write, not print: this may run while the main thread is inside a print to the same stream.
        os.write(2, f"\n{name}: {self.message} (send it again to abort now)\n".encode())
