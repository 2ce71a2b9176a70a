"""The simulation's copy engine: a thread that lands copies beside compute, on CPU time compute leaves idle.

On a GPU the copy engines move bytes while the SMs compute, so a copy issued early enough costs the
step nothing. The simulation's compute is the CPU, and a copy landed on the compute thread (when someone
learns of it: sim.py's "wait" landing) costs the step its whole memcpy. With "background" landing, a
thread of the lowest scheduling class (Linux's SCHED_IDLE: it runs only on a core nothing else wants)
lands every copy in issue order as soon as it can; learning of a copy the thread has not landed yet
lands it on the spot, as before. So copies overlap what leaves a core idle (Python between ops, waits),
never compute itself: a copy thread of normal priority measured no faster, its copies slowing the
compute they shared cores with.

[Note: order]
At most one copy runs on the thread, and the thread takes copies strictly in issue order: it never
starts one while an earlier one is landing on the compute thread. The compute thread lands what it
needs in issue order too. So copies of one stream never run at the same time, as on a GPU, where a
stream runs its copies one after another; copies of two streams may, as on two copy engines.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class Landable(Protocol):
    """A copy in flight (sim.Copy): `land` moves its bytes, None once it has landed, as is `held`, the buffer
    it keeps alive until then."""

    id: int
    land: Callable[[], Any] | None
    held: Any


def idle_priority_available() -> bool:
    """Whether a thread can put itself in the idle scheduling class here (Linux)."""
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")


class CopyThread:
    """Lands copies in issue order on a thread of idle priority (the module's Note on order). The thread stops
    when this object is collected (its device is) or the interpreter exits, after the copy it is landing."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child starts a thread of its own (the parent's is not there)
        self._queue = _Queue()
        thread = threading.Thread(target=self._queue.run, name="chunkmem-sim-copies", daemon=True)
        thread.start()
        # Also at exit, before the interpreter tears torch down: a thread left inside a torch op aborts it.
        self._finalizer = weakref.finalize(self, self._queue.close, thread)

    def add(self, copy: Landable) -> None:
        self._queue.add(copy)

    def land(self, copy: Landable) -> None:
        """Make sure `copy` has landed, landing it here if the thread has not started it."""
        self._queue.land(copy)

    @property
    def landed(self) -> int:
        """Copies the thread landed (the others landed where someone waited for them)."""
        return self._queue.landed

    def close(self) -> None:
        self._finalizer()


class _Queue:
    """The state the compute thread and the copy thread share, under one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.copies: collections.deque[Landable] = collections.deque()
        self.landing: Landable | None = None  # the copy the copy thread is landing
        self.claimed: Landable | None = None  # the copy the compute thread is landing
        self.closed = False
        self.landed = 0  # by the copy thread

    def add(self, copy: Landable) -> None:
        with self.cond:
            self.copies.append(copy)
            self.cond.notify_all()

    def land(self, copy: Landable) -> None:
        with self.cond:
            while self.landing is copy:
                self.cond.wait()
            move = copy.land
            if move is None:
                return
            self.claimed = copy
        self._move(copy, move)

    def run(self) -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        while True:
            with self.cond:
                while not self.copies and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                copy = self.copies[0]
                if copy is self.claimed:  # landing on the compute thread: the next waits for it (Note on order)
                    self.cond.wait()
                    continue
                self.copies.popleft()
                move = copy.land
                if move is None:
                    continue
                self.landing = copy
            try:
                self._move(copy, move)
                self.landed += 1
            except Exception:  # noqa: BLE001  left unlanded: whoever waits for it lands it again and sees the error
                pass
            del move  # its closure holds the copy's buffers: free them for reuse before waiting for the next

    def _move(self, copy: Landable, move: Callable[[], Any]) -> None:
        """Land `copy` (claimed by this thread), and mark it landed; if it fails, it stays unlanded."""
        landed = False
        try:
            move()
            landed = True
        finally:
            with self.cond:
                if landed:
                    copy.land = copy.held = None
                if self.landing is copy:
                    self.landing = None
                if self.claimed is copy:
                    self.claimed = None
                self.cond.notify_all()

    def close(self, thread: threading.Thread) -> None:
        with self.cond:
            self.closed = True
            self.copies.clear()
            self.cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()
